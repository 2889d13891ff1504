// TCP backend of the data plane (Boost.Asio): one io thread owns every socket; TCP_NODELAY;
// a frame is written as one gather write of [64-byte header, caller's payload].
#pragma once
#include <memory>

#include "net/transport.h"

namespace fm::net {

// Creates a TCP transport; errors name the bad option (self_name).
Result<std::unique_ptr<Transport>> MakeTcpTransport(const TransportOptions& options);

}  // namespace fm::net
