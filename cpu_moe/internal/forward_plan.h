// Internal: the validated description of one Forward call that cpu_moe.cc hands to the per-target
// kernels (forward-inl.h and the files it includes). Plain data; built and owned by Forward for
// the duration of one call.
#ifndef MOE_CPU_MOE_INTERNAL_FORWARD_PLAN_H_
#define MOE_CPU_MOE_INTERNAL_FORWARD_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/thread_pool.h"
#include "cpu_moe/cpu_moe.h"
#include "cpu_moe/internal/tuning.h"

namespace moe::cpu_moe::internal {

// Routes of one expert: routes[begin, end) of ForwardPlan::group_routes.
struct ExpertGroup {
  int expert;
  int begin;
  int end;
};

struct ForwardPlan {
  const ExpertBank* bank;
  const Options* options;
  // The call's tuning with every kAuto value resolved to the format's own (validated).
  const Tuning* tuning;
  common::ThreadPool* pool;
  int num_tokens;
  int top_k;
  const void* x;
  DType x_dtype;
  void* y;
  DType y_dtype;
  // bf16 or fp8 bank on the AVX3_DL target of a CPU with AVX512_BF16, and
  // options->bf16_dot_product: the row kernels use vdpbf16ps (or AMX, below) against
  // bf16-rounded activations. Decided once per call by Forward; the other targets never see it
  // set.
  bool bf16_dot_product = false;
  // AMX tiles (tdpbf16ps) for experts with at least amx_min_routes routes (> 0): set only with
  // bf16_dot_product (bf16 and fp8 banks), where the CPU has AMX-TILE and AMX-BF16, Linux granted
  // the tile state, and tuning->amx.
  bool amx = false;
  int amx_min_routes = 0;
  // fp8 banks with bf16_dot_product, where the CPU has AVX512-FP16 and tuning->fp8_fp16: the
  // experts that do not go through AMX are dotted with fp16 FMAs (Fp8F16Pass1 / 2).
  bool fp8_fp16 = false;
  // Whether an expert with `routes` routes in this call goes through AMX (the one rule that both
  // the kernels and ForwardStats::amx follow).
  bool UsesAmx(int routes) const { return amx && routes >= amx_min_routes; }
  // fp8's fp16 kernels read experts with at most few_routes_max routes with these prefetch
  // distances instead of tuning->prefetch_bytes / prefetch_l2_bytes (0: no expert; set by
  // Forward only where both were kAuto).
  int few_routes_max = 0;
  int few_routes_prefetch_l1 = 0;
  int few_routes_prefetch_l2 = 0;

  // Valid routes, in token order: route r is token route_token[r], weight route_weight[r].
  std::vector<int> route_token;
  std::vector<float> route_weight;
  std::vector<int> route_expert;
  // Work groups of both passes: one per unique expert when deduping, else one per route (expert
  // repeated). group_routes indexes routes.
  std::vector<ExpertGroup> groups;
  std::vector<int> group_routes;
  // Per token: routes [token_route_begin[t], token_route_begin[t+1]) (summed at the end of
  // pass 2).
  std::vector<int> token_route_begin;

  // Set by the kernels when the call's scratch (sized from its tokens and routes) could not be
  // allocated: the bytes asked for. Nothing was read or written; Forward returns
  // ResourceExhausted.
  size_t scratch_bytes_missing = 0;

  // Wall time of the phases, filled by the kernels (caller thread's clock): activation prep of x,
  // pass 1, activation prep of h, pass 2.
  double phase_seconds[4] = {0, 0, 0, 0};
};

}  // namespace moe::cpu_moe::internal

#endif  // MOE_CPU_MOE_INTERNAL_FORWARD_PLAN_H_
