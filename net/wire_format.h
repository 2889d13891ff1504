// The data plane's wire-format constants (docs/wire-format.md), header-only and without
// dependencies, so that every process may include them: the frame codec (frame.h,
// frame_auth.h) and the cost model (coordinator/cost_model.cpp), which links no fm_net.
#pragma once
#include <cstddef>
#include <cstdint>

namespace fm::net {

inline constexpr uint8_t kFrameMagic[4] = {'F', 'M', 'S', 'H'};
inline constexpr uint16_t kFrameVersion = 1;
inline constexpr size_t kFrameHeaderSize = 64;
// The tag after every frame of a connection under a cluster secret (frame_auth.h).
inline constexpr size_t kFrameTagSize = 16;

}  // namespace fm::net
