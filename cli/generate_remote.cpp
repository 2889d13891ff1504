#include "cli/generate_remote.h"

#include <cstdio>

#include "common/log.h"
#include "coordinator/api_client.h"
#include "rpc/grpc_status.h"

namespace fm::cli {

Status GenerateRemote(const RemoteGenerateArgs& args) {
  FM_ASSIGN_OR_RETURN(ApiClient client, ConnectApi(args.server, args.token_file, args.tls_ca));
  flashmesh::v1::GenerateRequest req;
  if (args.tokens.empty()) {
    req.set_text(args.prompt);
    req.set_raw(args.raw);
  } else {
    for (int32_t id : args.tokens) req.mutable_tokens()->add_ids(id);
  }
  req.set_max_tokens(static_cast<int32_t>(args.gen.max_tokens));
  auto* s = req.mutable_sampling();
  s->set_greedy(args.gen.sampling.greedy);
  s->set_temperature(args.gen.sampling.temperature);
  s->set_top_p(args.gen.sampling.top_p);
  s->set_top_k(args.gen.sampling.top_k);
  s->set_min_p(args.gen.sampling.min_p);
  s->set_repetition_penalty(args.gen.sampling.repetition_penalty);
  s->set_frequency_penalty(args.gen.sampling.frequency_penalty);
  s->set_presence_penalty(args.gen.sampling.presence_penalty);
  for (const auto& [id, bias] : args.gen.sampling.logit_bias) (*s->mutable_logit_bias())[id] = bias;
  req.mutable_stop_token_ids()->Add(args.gen.stop_token_ids.begin(), args.gen.stop_token_ids.end());
  req.set_min_tokens(static_cast<int32_t>(args.gen.min_tokens));
  s->set_seed(args.gen.sampling.seed);
  s->set_has_seed(true);   // like the local mode: the seed (default 0) fixes the tokens
  auto ctx = client.Context(static_cast<double>(args.timeout_s));
  auto reader = client.stub->Generate(ctx.get(), req);
  flashmesh::v1::GenerateResponse resp;
  std::vector<int32_t> ids;
  flashmesh::v1::Finish finish;
  while (reader->Read(&resp)) {
    if (resp.has_token()) {
      ids.push_back(resp.token().id());
      if (args.text) {
        std::fwrite(resp.token().text().data(), 1, resp.token().text().size(), stdout);
        std::fflush(stdout);
      }
    } else if (resp.has_finish()) {
      finish = resp.finish();
    }
  }
  grpc::Status st = reader->Finish();
  if (args.text && !ids.empty()) std::fputc('\n', stdout);
  std::fflush(stdout);   // the text ends its line before an error or the summary goes to stderr
  if (!st.ok()) return FromGrpc(st, args.server);
  if (!args.text) {
    for (size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i ? " " : "", ids[i]);
    std::printf("\n");
    std::fflush(stdout);
  }
  const char* reason = finish.reason() == flashmesh::v1::FINISH_REASON_STOP     ? "stop"
                       : finish.reason() == flashmesh::v1::FINISH_REASON_LENGTH ? "length"
                                                                                : "cancelled";
  FM_LOG(kInfo, "generate") << "prompt " << finish.usage().prompt_tokens() << " tokens; generated "
                            << finish.usage().completion_tokens() << " tokens; finish " << reason;
  return Status::Ok();
}

}  // namespace fm::cli
