// Hybrid miss handling: split one step's misses between fetching over PCIe (the gather) and
// computing on the CPU, in proportion to the two measured bandwidths so both paths finish together,
// and the bandwidth profile file that holds those bandwidths.
//
// The profile must be measured with both paths busy at once (//tools:bandwidth_probe does): a CPU
// expert kernel and a PCIe gather compete for host DRAM, and a ratio measured with each alone picks
// the wrong mode.
//
// Profile file: text, one `key=value` per line, '#' comments and blank lines ignored:
//   pcie_gather_gbps=51.0      # GB/s of the gather while the CPU path runs (> 0)
//   cpu_expert_gbps=74.0       # GB/s of expert weights the CPU path consumes while the gather runs (>= 0)
//   contended=true             # optional: both measured under contention (default true)
// Unknown keys, duplicates, missing keys and bad numbers are errors naming the line.
//
// Thread-safety: pure functions.
#ifndef MOE_MOE_CACHE_HYBRID_SPLIT_H_
#define MOE_MOE_CACHE_HYBRID_SPLIT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "moe_cache/policy_core.h"

namespace moe {
namespace moe_cache {

struct BandwidthProfile {
  double pcie_gather_gbps = 0;
  double cpu_expert_gbps = 0;
  bool contended = true;
};

struct MissSplit {
  std::vector<MissPlanEntry> fetch;  // copy into their slots
  std::vector<MissPlanEntry> cpu;    // compute on the CPU this step
};

// Fetches m of the n misses and leaves n - m to the CPU, m chosen in {floor, ceil} of
// n * pcie / (pcie + cpu) to minimize the slower path's time (ties: fetch more). Deterministic:
// the first m misses in plan order are fetched. The slots of the CPU misses were assigned by
// ensure_experts; the caller must not treat them as filled (invalidate or copy them later).
// InvalidArgument for a profile without a positive PCIe bandwidth or a negative CPU one.
absl::StatusOr<MissSplit> SplitMisses(absl::Span<const MissPlanEntry> misses,
                                      const BandwidthProfile& profile);

// The same rule as a table for ensure_experts (FetchCount in policy_core.h), which applies it
// on the GPU inside the captured step: entry n is how many of n misses SplitMisses fetches, for
// n = 0..num_experts. InvalidArgument for a bad profile or num_experts <= 0.
absl::StatusOr<std::vector<int32_t>> FetchTable(const BandwidthProfile& profile,
                                                int num_experts);

absl::StatusOr<BandwidthProfile> ParseBandwidthProfile(const std::string& text);
std::string SerializeBandwidthProfile(const BandwidthProfile& profile);
absl::StatusOr<BandwidthProfile> ReadBandwidthProfile(const std::string& path);
absl::Status WriteBandwidthProfile(const BandwidthProfile& profile, const std::string& path);

}  // namespace moe_cache
}  // namespace moe

#endif  // MOE_MOE_CACHE_HYBRID_SPLIT_H_
