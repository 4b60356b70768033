// The bandwidth profile of hybrid experts, measured on a model's own expert store: the host link
// copying experts from the store's pinned memory into GPU memory (top_k at a time, as a batch-1
// step's misses), and cpu_moe computing batch-1 steps of top_k experts straight from the same
// memory; each alone, then both at once. The two compete for host DRAM, so the split uses the
// figures measured together (moe_cache/hybrid_split.h).
//
// Thread-safety: one call at a time per pool.
#ifndef MOE_ENGINE_CUDA_HYBRID_HYBRID_PROFILE_H_
#define MOE_ENGINE_CUDA_HYBRID_HYBRID_PROFILE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/thread_pool.h"
#include "cpu_moe/cpu_moe.h"
#include "moe_cache/gpu/expert_store.h"
#include "moe_cache/hybrid_split.h"

namespace moe::engine::hybrid {

struct HybridProfileMeasurement {
  double link_alone_gbps = 0;
  double cpu_alone_gbps = 0;
  double link_both_gbps = 0;
  double cpu_both_gbps = 0;
  uint64_t bytes_per_expert = 0;
  // The split's input: the figures measured together.
  moe_cache::BandwidthProfile profile() const {
    return moe_cache::BandwidthProfile{link_both_gbps, cpu_both_gbps, true};
  }
};

// `banks`: the store's layers as cpu_moe reads them (in place). Runs each of the three phases
// for `seconds_per_phase`. Unavailable without a GPU.
absl::StatusOr<HybridProfileMeasurement> MeasureHybridProfile(
    const moe_cache::ExpertStore& store, const std::vector<cpu_moe::ExpertBank>& banks,
    int top_k, const cpu_moe::Options& options, common::ThreadPool& pool,
    double seconds_per_phase);

}  // namespace moe::engine::hybrid

#endif  // MOE_ENGINE_CUDA_HYBRID_HYBRID_PROFILE_H_
