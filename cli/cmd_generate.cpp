// flashmesh generate (--model DIR | --server HOST:PORT) (--prompt TEXT | --tokens 3,17,42) [--max-tokens N]
//   [--greedy | --temperature T --top-p P --top-k K --seed S] [--raw] [--format text|ids]
//   [--threads N]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/generate_remote.h"
#include "common/log.h"
#include "common/thread_pool.h"
#include "config/cluster_config.h"
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

const CommandSpec kSpec{
    "generate",
    "prefill the prompt, then decode token by token until EOS or --max-tokens. Give one of\n"
    "--model and --server, and one of --prompt and --tokens.\n"
    "The same cluster speaks OpenAI's HTTP API when coordinator.http (or serve --http) is set:\n"
    "  curl -s http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\\n"
    "    -d '{\"model\": \"flashmesh\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}'\n"
    "  (any OpenAI client with base URL http://127.0.0.1:8080/v1; docs/api.md, README)",
    {{"model", "DIR", "checkpoint directory (config.json, shards, tokenizer.json)"},
     {"server", "HOST:PORT", "generate on a running coordinator / serve instead of --model"},
     {"token-file", "FILE", "with --server: bearer token file (security.token_file)"},
     {"timeout", "S", "with --server: fail after S seconds (default 600)"},
     {"tls-ca", "FILE", "with --server: CA of the coordinator's certificate (security.tls)"},
     {"prompt", "TEXT", "user message, wrapped in the chat format (see --raw)"},
     {"tokens", "IDS", "prompt as comma-separated token ids, fed as is"},
     {"raw", nullptr, "encode --prompt as plain text after BOS, without the chat format"},
     {"max-tokens", "N", "generate at most N tokens (default 64)"},
     {"greedy", nullptr, "argmax decoding (ties to the lower id)"},
     {"temperature", "T", "sampling temperature >= 0 (default 1; 0 = greedy)"},
     {"top-p", "P", "nucleus sampling, P in (0, 1] (default 1)"},
     {"top-k", "K", "keep the K most likely tokens, 0 = all (default 0)"},
     {"seed", "S", "sampling seed (default 0); same seed, same tokens"},
     {"min-p", "P", "drop tokens below P x the most likely's probability, P in [0, 1] (default 0)"},
     {"repetition-penalty", "R", "divide (l > 0) or multiply (l < 0) the logits of the prompt's and\n"
                                 "generated tokens by R > 0 (default 1 = off)"},
     {"frequency-penalty", "F", "subtract F x times generated from a token's logit, F in [-2, 2]\n"
                                "(default 0)"},
     {"presence-penalty", "Q", "subtract Q from a generated token's logit, Q in [-2, 2] (default 0)"},
     {"logit-bias", "ID:B,..", "add B in [-100, 100] to token ID's logit (OpenAI's logit_bias)"},
     {"stop-token-ids", "IDS", "also stop after one of these comma-separated token ids"},
     {"min-tokens", "N", "no stop (end-of-sentence, --stop-token-ids) before N tokens"},
     {"format", "text|ids", "stream decoded text (default) or print the ids on one line"},
     {"threads", "N", "with --model: kernel threads (default: all cores)"},
     {"max-step-tokens", "N", "with --model: prefill the prompt in chunks of N tokens, as a\n"
                              "server with limits.max_step_tokens N does (default 2048)"}}};

// "42:100,7:-5" -> {(42, 100), (7, -5)}; errors name --logit-bias and the item.
Result<std::vector<std::pair<int32_t, float>>> ParseLogitBias(const std::string& list) {
  std::vector<std::pair<int32_t, float>> out;
  size_t at = 0;
  for (int i = 0; at <= list.size(); ++i) {
    const size_t end = std::min(list.find(',', at), list.size());
    const std::string item = list.substr(at, end - at);
    const size_t colon = item.find(':');
    auto bad = [&] {
      return InvalidArgument("--logit-bias: item " + std::to_string(i) + " '" + item + "' is not ID:BIAS");
    };
    if (colon == std::string::npos) return bad();
    auto id = ParseTokenIds("logit-bias", item.substr(0, colon));
    if (!id.ok() || id->size() != 1) return bad();
    char* stop = nullptr;
    const std::string b = item.substr(colon + 1);
    const float bias = std::strtof(b.c_str(), &stop);
    if (b.empty() || *stop != '\0') return bad();
    out.emplace_back((*id)[0], bias);
    at = end + 1;
  }
  return out;
}

Status ParseArgs(const Flags& f, GenerateArgs* args) {
  args->model = f.Get("model");
  args->server = f.Get("server");
  args->token_file = f.Get("token-file");
  args->tls_ca = f.Get("tls-ca");
  FM_ASSIGN_OR_RETURN(args->timeout_s, f.GetInt("timeout", args->timeout_s, 1, 86400));
  args->has_prompt = f.Has("prompt");
  args->prompt = f.Get("prompt");
  args->has_tokens = f.Has("tokens");
  args->tokens = f.Get("tokens");
  args->raw = f.Has("raw");
  FM_ASSIGN_OR_RETURN(args->gen.max_tokens, f.GetInt("max-tokens", args->gen.max_tokens, 1, 1 << 24));
  args->greedy = f.Has("greedy");
  SamplerConfig& sampling = args->gen.sampling;
  args->sampling_flag = f.Has("temperature") || f.Has("top-p") || f.Has("top-k") || f.Has("seed") || f.Has("min-p");
  FM_ASSIGN_OR_RETURN(sampling.temperature, f.GetFloat("temperature", sampling.temperature));
  FM_ASSIGN_OR_RETURN(sampling.top_p, f.GetFloat("top-p", sampling.top_p));
  FM_ASSIGN_OR_RETURN(const int64_t top_k, f.GetInt("top-k", sampling.top_k, 0, INT32_MAX));
  sampling.top_k = static_cast<int32_t>(top_k);
  FM_ASSIGN_OR_RETURN(sampling.seed, f.GetSeed("seed"));
  FM_ASSIGN_OR_RETURN(sampling.min_p, f.GetFloat("min-p", sampling.min_p));
  FM_ASSIGN_OR_RETURN(sampling.repetition_penalty, f.GetFloat("repetition-penalty", sampling.repetition_penalty));
  FM_ASSIGN_OR_RETURN(sampling.frequency_penalty, f.GetFloat("frequency-penalty", sampling.frequency_penalty));
  FM_ASSIGN_OR_RETURN(sampling.presence_penalty, f.GetFloat("presence-penalty", sampling.presence_penalty));
  if (f.Has("logit-bias")) {
    FM_ASSIGN_OR_RETURN(sampling.logit_bias, ParseLogitBias(f.Get("logit-bias")));
  }
  if (f.Has("stop-token-ids")) {
    FM_ASSIGN_OR_RETURN(args->gen.stop_token_ids, ParseTokenIds("stop-token-ids", f.Get("stop-token-ids")));
  }
  FM_ASSIGN_OR_RETURN(args->gen.min_tokens, f.GetInt("min-tokens", 0, 0, args->gen.max_tokens));
  args->format = f.Get("format", "text");
  if (args->format != "text" && args->format != "ids")
    return InvalidArgument("--format: expected text or ids, got '" + args->format + "'");
  FM_ASSIGN_OR_RETURN(const int64_t threads, f.GetInt("threads", 0, 1, kMaxThreads));
  FM_ASSIGN_OR_RETURN(args->gen.prefill_chunk,
                      f.GetInt("max-step-tokens", args->gen.prefill_chunk, 1, kMaxContextLimit));
  args->threads = static_cast<int>(threads);
  if (args->model.empty() == args->server.empty())
    return InvalidArgument("give exactly one of --model and --server");
  // The server's own settings decide these (its workers' threads, limits.max_step_tokens).
  for (const char* local : {"threads", "max-step-tokens"})
    if (!args->server.empty() && f.Has(local))
      return InvalidArgument(std::string("--") + local + ": only with --model (a server's own "
                             "settings decide it)");
  if (args->has_prompt == args->has_tokens)
    return InvalidArgument("give exactly one of --prompt and --tokens");
  if (args->raw && !args->has_prompt) return InvalidArgument("--raw: only applies to --prompt");
  if (args->greedy && args->sampling_flag)
    return InvalidArgument("--greedy: conflicts with --temperature/--top-p/--top-k/--seed/--min-p");
  args->gen.sampling.greedy = args->greedy;
  FM_RETURN_IF_ERROR(ValidateSamplerConfig(args->gen.sampling));
  if (args->has_tokens) {
    FM_ASSIGN_OR_RETURN(args->prompt_ids, ParseTokenIds("tokens", args->tokens));
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
  int64_t generated = 0;
  auto on_token = [&](const SampledToken& t) {
    const auto& stops = args.gen.stop_token_ids;
    // A stop token adds no text (as a server's).
    const bool stop_token = ++generated >= args.gen.min_tokens &&
                            std::find(stops.begin(), stops.end(), t.id) != stops.end();
    if (!stream || stop_token) return true;
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
  std::fflush(stdout);   // the text ends its line before the summary goes to stderr
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
  int rc = 0;
  const std::optional<Flags> flags = StartCommand(kSpec, argc, argv, &rc);
  if (!flags) return rc;
  GenerateArgs args;
  if (Status s = ParseArgs(*flags, &args); !s.ok()) return UsageError(kSpec, s.message());
  if (Status s = Run(args); !s.ok()) {
    std::fprintf(stderr, "generate: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace fm::cli
