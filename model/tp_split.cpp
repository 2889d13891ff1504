// Tensor-parallel row shares (tp_split.h).
#include "model/tp_split.h"

#include <algorithm>
#include <string>

namespace fm {

Status CheckTensorParallel(const ModelConfig& cfg, int t) {
  if (t < 1) return InvalidArgument("tensor_parallel " + std::to_string(t) + " must be >= 1");
  auto divides = [&](int64_t n, const char* what) -> Status {
    if (n % t != 0)
      return InvalidArgument("tensor_parallel " + std::to_string(t) + " does not divide " + what +
                             " " + std::to_string(n));
    return Status::Ok();
  };
  FM_RETURN_IF_ERROR(divides(cfg.num_attention_heads, "num_attention_heads"));
  FM_RETURN_IF_ERROR(divides(cfg.o_groups, "o_groups"));
  FM_RETURN_IF_ERROR(divides(cfg.hidden_size, "hidden_size"));
  FM_RETURN_IF_ERROR(divides(cfg.moe_intermediate_size, "moe_intermediate_size"));
  if (cfg.n_routed_experts < t)
    return InvalidArgument("tensor_parallel " + std::to_string(t) + " exceeds n_routed_experts " +
                           std::to_string(cfg.n_routed_experts));
  return Status::Ok();
}

bool TpSplitRows(const ModelConfig& cfg, const std::string& name, int rank, int size,
                 TpRange* rows) {
  if (size <= 1 || name.rfind("layers.", 0) != 0) return false;
  const size_t dot = name.find('.', 7);
  if (dot == std::string::npos) return false;
  const size_t end = name.rfind('.');   // ".weight" / ".scale"
  if (end <= dot) return false;
  const std::string part = name.substr(dot + 1, end - dot - 1);
  const int64_t D = cfg.head_dim, R = cfg.o_lora_rank, H = cfg.hidden_size;
  const int64_t Is = cfg.moe_intermediate_size * std::max<int64_t>(cfg.n_shared_experts, 1);
  const TpRange heads = TpShare(cfg.num_attention_heads, rank, size);
  const TpRange groups = TpShare(cfg.o_groups, rank, size);
  if (part == "attn.wq_b") *rows = {heads.begin * D, heads.end * D};
  else if (part == "attn.wo_a") *rows = {groups.begin * R, groups.end * R};
  else if (part == "attn.wo_b" || part == "ffn.shared_experts.w2") *rows = TpShare(H, rank, size);
  else if (part == "ffn.shared_experts.w1" || part == "ffn.shared_experts.w3")
    *rows = TpShare(Is, rank, size);
  else return false;
  return true;
}

}  // namespace fm
