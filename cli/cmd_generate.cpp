// flashmesh generate (--model DIR | --server HOST:PORT) (--prompt TEXT | --tokens 3,17,42) [--max-tokens N]
//   [--greedy | --temperature T --top-p P --top-k K --seed S] [--raw] [--format text|ids]
//   [--threads N]
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/generate_remote.h"
#include "common/log.h"
#include "common/thread_pool.h"
#include "model/checkpoint.h"
#include "model/forward.h"
#include "model/generate.h"
#include "model/tokenizer.h"

namespace fm::cli {
namespace {

struct GenerateArgs {
  std::string model;
  std::string server, token_file, tls_ca;   // --server: generate on a running coordinator
  int64_t timeout_s = 600;                  // --server: the request's deadline
  std::string prompt;
  std::string tokens;  // "3,17,42"
  std::vector<int32_t> prompt_ids;  // parsed --tokens
  bool has_prompt = false, has_tokens = false;
  bool raw = false;
  bool greedy = false, sampling_flag = false;
  std::string format = "text";
  int threads = 0;
  GenerateOptions gen;
};

Status ParseInt(const std::string& flag, const char* v, int64_t lo, int64_t hi, int64_t* out) {
  const char* end = v + std::strlen(v);
  auto [p, ec] = std::from_chars(v, end, *out);
  if (ec != std::errc() || p != end || *out < lo || *out > hi)
    return InvalidArgument(flag + ": expected an integer in [" + std::to_string(lo) + ", " +
                           std::to_string(hi) + "], got '" + v + "'");
  return Status::Ok();
}

Status ParseFloat(const std::string& flag, const char* v, float* out) {
  char* end = nullptr;
  *out = std::strtof(v, &end);
  if (!*v || *end || !std::isfinite(*out))
    return InvalidArgument(flag + ": expected a number, got '" + v + "'");
  return Status::Ok();
}

// One row per option: name, value placeholder (null for a switch), help, how to apply it.
struct Flag {
  const char* name;
  const char* value;
  const char* help;
  std::function<Status(GenerateArgs*, const char*)> apply;
};

const std::vector<Flag>& Flags() {
  static const std::vector<Flag> flags = {
      {"--model", "DIR", "checkpoint directory (config.json, shards, tokenizer.json)",
       [](GenerateArgs* a, const char* v) { a->model = v; return Status::Ok(); }},
      {"--server", "HOST:PORT", "generate on a running coordinator / serve instead of --model",
       [](GenerateArgs* a, const char* v) { a->server = v; return Status::Ok(); }},
      {"--token-file", "FILE", "with --server: bearer token file (security.token_file)",
       [](GenerateArgs* a, const char* v) { a->token_file = v; return Status::Ok(); }},
      {"--timeout", "S", "with --server: fail after S seconds (default 600)",
       [](GenerateArgs* a, const char* v) { return ParseInt("--timeout", v, 1, 86400, &a->timeout_s); }},
      {"--tls-ca", "FILE", "with --server: CA of the coordinator's certificate (security.tls)",
       [](GenerateArgs* a, const char* v) { a->tls_ca = v; return Status::Ok(); }},
      {"--prompt", "TEXT", "user message, wrapped in the chat format (see --raw)",
       [](GenerateArgs* a, const char* v) { a->prompt = v; a->has_prompt = true; return Status::Ok(); }},
      {"--tokens", "IDS", "prompt as comma-separated token ids, fed as is",
       [](GenerateArgs* a, const char* v) { a->tokens = v; a->has_tokens = true; return Status::Ok(); }},
      {"--raw", nullptr, "encode --prompt as plain text after BOS, without the chat format",
       [](GenerateArgs* a, const char*) { a->raw = true; return Status::Ok(); }},
      {"--max-tokens", "N", "generate at most N tokens (default 64)",
       [](GenerateArgs* a, const char* v) {
         return ParseInt("--max-tokens", v, 1, 1 << 24, &a->gen.max_tokens);
       }},
      {"--greedy", nullptr, "argmax decoding (ties to the lower id)",
       [](GenerateArgs* a, const char*) { a->greedy = true; return Status::Ok(); }},
      {"--temperature", "T", "sampling temperature >= 0 (default 1; 0 = greedy)",
       [](GenerateArgs* a, const char* v) {
         a->sampling_flag = true;
         return ParseFloat("--temperature", v, &a->gen.sampling.temperature);
       }},
      {"--top-p", "P", "nucleus sampling, P in (0, 1] (default 1)",
       [](GenerateArgs* a, const char* v) {
         a->sampling_flag = true;
         return ParseFloat("--top-p", v, &a->gen.sampling.top_p);
       }},
      {"--top-k", "K", "keep the K most likely tokens, 0 = all (default 0)",
       [](GenerateArgs* a, const char* v) {
         a->sampling_flag = true;
         int64_t k = 0;
         FM_RETURN_IF_ERROR(ParseInt("--top-k", v, 0, INT32_MAX, &k));
         a->gen.sampling.top_k = static_cast<int32_t>(k);
         return Status::Ok();
       }},
      {"--seed", "S", "sampling seed (default 0); same seed, same tokens",
       [](GenerateArgs* a, const char* v) {
         a->sampling_flag = true;
         int64_t s = 0;
         FM_RETURN_IF_ERROR(ParseInt("--seed", v, 0, INT64_MAX, &s));
         a->gen.sampling.seed = static_cast<uint64_t>(s);
         return Status::Ok();
       }},
      {"--format", "text|ids", "stream decoded text (default) or print the ids on one line",
       [](GenerateArgs* a, const char* v) {
         a->format = v;
         if (a->format != "text" && a->format != "ids")
           return InvalidArgument(std::string("--format: expected text or ids, got '") + v + "'");
         return Status::Ok();
       }},
      {"--threads", "N", "kernel threads (default: all cores)",
       [](GenerateArgs* a, const char* v) {
         int64_t n = 0;
         FM_RETURN_IF_ERROR(ParseInt("--threads", v, 1, 1024, &n));
         a->threads = static_cast<int>(n);
         return Status::Ok();
       }},
  };
  return flags;
}

void PrintUsage(FILE* f) {
  std::fprintf(f,
               "usage: flashmesh generate (--model DIR | --server HOST:PORT) (--prompt TEXT | --tokens IDS)\n"
               "                         [options]\n"
               "  prefill the prompt, then decode token by token until EOS or --max-tokens\n\n");
  for (const Flag& fl : Flags()) {
    std::string left = std::string(fl.name) + (fl.value ? std::string(" ") + fl.value : "");
    std::fprintf(f, "  %-22s %s\n", left.c_str(), fl.help);
  }
  std::fprintf(f,
               "\nThe same cluster speaks OpenAI's HTTP API when coordinator.http (or serve --http) is set:\n"
               "  curl -s http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\\n"
               "    -d '{\"model\": \"flashmesh\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}'\n"
               "  (any OpenAI client with base URL http://127.0.0.1:8080/v1; docs/api.md, README)\n");
}

Result<std::vector<int32_t>> ParseIds(const std::string& s) {
  std::vector<int32_t> ids;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    int64_t v = 0;
    FM_RETURN_IF_ERROR(ParseInt("--tokens[" + std::to_string(ids.size()) + "]", item.c_str(), 0,
                                INT32_MAX, &v));
    ids.push_back(static_cast<int32_t>(v));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return ids;
}

// Accepts "--name value" and "--name=value".
Status ParseArgs(int argc, char** argv, GenerateArgs* args) {
  for (int i = 1; i < argc; ++i) {
    std::string name = argv[i];
    const char* value = nullptr;
    std::string inline_value;
    if (size_t eq = name.find('='); name.rfind("--", 0) == 0 && eq != std::string::npos) {
      inline_value = name.substr(eq + 1);
      name = name.substr(0, eq);
      value = inline_value.c_str();
    }
    const Flag* flag = nullptr;
    for (const Flag& f : Flags())
      if (name == f.name) flag = &f;
    if (!flag) return InvalidArgument("unknown option '" + name + "'");
    if (flag->value && !value) {
      if (i + 1 >= argc) return InvalidArgument(name + ": needs a value (" + flag->value + ")");
      value = argv[++i];
    } else if (!flag->value && value) {
      return InvalidArgument(name + ": takes no value");
    }
    FM_RETURN_IF_ERROR(flag->apply(args, value));
  }
  if (args->model.empty() == args->server.empty())
    return InvalidArgument("give exactly one of --model and --server");
  if (args->has_prompt == args->has_tokens)
    return InvalidArgument("give exactly one of --prompt and --tokens");
  if (args->raw && !args->has_prompt) return InvalidArgument("--raw: only applies to --prompt");
  if (args->greedy && args->sampling_flag)
    return InvalidArgument("--greedy: conflicts with --temperature/--top-p/--top-k/--seed");
  args->gen.sampling.greedy = args->greedy;
  FM_RETURN_IF_ERROR(ValidateSamplerConfig(args->gen.sampling));
  if (args->has_tokens) {
    FM_ASSIGN_OR_RETURN(args->prompt_ids, ParseIds(args->tokens));
  }
  return Status::Ok();
}

Status Run(GenerateArgs& args) {
  if (!args.server.empty()) {
    return GenerateRemote({args.server, args.token_file, args.tls_ca, args.prompt, args.raw,
                           args.prompt_ids, args.gen, args.format == "text", args.timeout_s});
  }
  FM_ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(args.model));
  // The tokenizer is needed for text in or out, and for the EOS id.
  Result<Tokenizer> tok = Tokenizer::Load(args.model);
  const bool need_tokenizer = args.has_prompt || args.format == "text";
  if (!tok.ok() && need_tokenizer) return tok.status();
  if (tok.ok()) args.gen.eos_id = tok->eos_id();

  std::vector<int32_t> prompt = args.prompt_ids;
  if (args.has_prompt) {
    std::string text;
    if (args.raw) {
      FM_ASSIGN_OR_RETURN(std::string bos, tok->TokenBytes(tok->bos_id()));
      text = bos + args.prompt;
    } else {
      FM_ASSIGN_OR_RETURN(text, tok->ApplyChatTemplate({{"user", args.prompt}}));
    }
    FM_ASSIGN_OR_RETURN(prompt, tok->Encode(text));
  }

  ThreadPool pool(args.threads);
  FM_ASSIGN_OR_RETURN(auto model, ShardModel::Create(*ckpt, &pool));
  std::optional<StreamDecoder> stream;
  if (args.format == "text") stream.emplace(*tok);
  Status emit_error;
  auto on_token = [&](const SampledToken& t) {
    if (!stream) return true;
    Result<std::string> piece = stream->Push(t.id);
    if (!piece.ok()) {
      emit_error = piece.status();
      return false;
    }
    std::fwrite(piece->data(), 1, piece->size(), stdout);
    std::fflush(stdout);
    return true;
  };
  FM_ASSIGN_OR_RETURN(GenerateResult res, Generate(*model, prompt, args.gen, on_token));
  FM_RETURN_IF_ERROR(emit_error);
  if (stream) {
    std::string rest = stream->Flush();
    std::fwrite(rest.data(), 1, rest.size(), stdout);
    std::fputc('\n', stdout);
  } else {
    for (size_t i = 0; i < res.tokens.size(); ++i)
      std::printf("%s%d", i ? " " : "", res.tokens[i]);
    std::printf("\n");
  }
  const int64_t n = static_cast<int64_t>(res.tokens.size());
  FM_LOG(kInfo, "generate") << "prompt " << res.prompt_tokens << " tokens in "
                            << res.prefill_seconds << " s ("
                            << res.prompt_tokens / std::max(res.prefill_seconds, 1e-9)
                            << " tok/s); generated " << n << " tokens, decode "
                            << (n > 1 ? (n - 1) / std::max(res.decode_seconds, 1e-9) : 0.0)
                            << " tok/s; finish " << FinishReasonName(res.finish);
  return Status::Ok();
}

}  // namespace

int CmdGenerate(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      PrintUsage(stdout);
      return 0;
    }
  GenerateArgs args;
  if (Status s = ParseArgs(argc, argv, &args); !s.ok()) {
    std::fprintf(stderr, "generate: %s\n\n", s.message().c_str());
    PrintUsage(stderr);
    return 2;
  }
  if (Status s = Run(args); !s.ok()) {
    std::fprintf(stderr, "generate: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace fm::cli
