// `flashmesh generate --server HOST:PORT`: the same prompt/sampling options as the local mode,
// sent to a coordinator's Generate stream; output printed as it arrives.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/generate.h"

namespace fm::cli {

struct RemoteGenerateArgs {
  std::string server, token_file, tls_ca;
  std::string prompt;             // used when tokens is empty: chat-formatted unless raw
  bool raw = false;
  std::vector<int32_t> tokens;
  GenerateOptions gen;            // sampling and max_tokens (EOS is the server's)
  bool text = true;               // stream text pieces; else print the ids on one line
  int64_t timeout_s = 600;        // the whole request's deadline: a frozen server cannot hang it
};

Status GenerateRemote(const RemoteGenerateArgs& args);

}  // namespace fm::cli
