#include "moe_cache/routing_stats.h"

#include <cstdint>
#include <limits>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace moe {
namespace moe_cache {

absl::Status RoutingStats::AddCall(int32_t layer, absl::Span<const int32_t> ids,
                                   const EnsureCounts& outcome) {
  if (layer < 0 || layer >= layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer %d out of range [0, %d)", layer, layers));
  }
  for (int32_t id : ids) {
    if (id >= experts) {
      return absl::InvalidArgumentError(
          absl::StrFormat("expert id %d of layer %d is >= experts %d", id, layer, experts));
    }
  }
  for (int32_t id : ids) {
    if (id < 0) continue;  // padding
    ++counts[static_cast<size_t>(layer) * experts + id];
  }
  hits += outcome.hits;
  misses += outcome.misses;
  return absl::OkStatus();
}

absl::StatusOr<ReplayCounts> ReplayBelady(const Trace& trace, int32_t experts, int32_t slots) {
  if (slots <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat("slots must be positive, got %d", slots));
  }
  for (int32_t id : trace.ids) {
    if (id >= experts) {
      return absl::InvalidArgumentError(
          absl::StrFormat("trace has expert id %d, >= experts %d", id, experts));
    }
  }
  const int64_t num_calls = static_cast<int64_t>(trace.tokens) * trace.layers;
  const size_t num_global = static_cast<size_t>(trace.layers) * experts;
  // Distinct routed experts of every call, flattened, then each occurrence's next-use call.
  std::vector<int64_t> call_begin(num_calls + 1, 0);
  std::vector<int32_t> call_experts;
  std::vector<int64_t> last_seen(num_global, -1);
  for (int64_t c = 0; c < num_calls; ++c) {
    const int32_t layer = static_cast<int32_t>(c % trace.layers);
    const int32_t* row = trace.ids.data() + c * trace.k;
    call_begin[c] = static_cast<int64_t>(call_experts.size());
    for (int32_t j = 0; j < trace.k; ++j) {
      if (row[j] < 0) continue;  // padding
      const int32_t g = layer * experts + row[j];
      if (last_seen[g] == c) continue;
      last_seen[g] = c;
      call_experts.push_back(g);
    }
  }
  call_begin[num_calls] = static_cast<int64_t>(call_experts.size());
  constexpr int64_t kNever = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> next_use(call_experts.size(), kNever);
  std::vector<int64_t> upcoming(num_global, kNever);
  for (int64_t c = num_calls - 1; c >= 0; --c) {
    for (int64_t i = call_begin[c]; i < call_begin[c + 1]; ++i) {
      next_use[i] = upcoming[call_experts[i]];
    }
    for (int64_t i = call_begin[c]; i < call_begin[c + 1]; ++i) upcoming[call_experts[i]] = c;
  }
  // Resident set ordered by next use (furthest last); ties by expert id for determinism.
  std::set<std::pair<int64_t, int32_t>> resident;
  std::vector<int64_t> key(num_global, -1);  // next use of a resident expert, -1 if not resident
  std::vector<int64_t> in_call(num_global, -1);  // call index that last requested g
  ReplayCounts out;
  for (int64_t c = 0; c < num_calls; ++c) {
    for (int64_t i = call_begin[c]; i < call_begin[c + 1]; ++i) in_call[call_experts[i]] = c;
    // Hits first: they move to their next use, which is after this call.
    for (int64_t i = call_begin[c]; i < call_begin[c + 1]; ++i) {
      const int32_t g = call_experts[i];
      if (key[g] >= 0) {
        ++out.hits;
        resident.erase({key[g], g});
        key[g] = next_use[i];
        resident.insert({key[g], g});
      }
    }
    for (int64_t i = call_begin[c]; i < call_begin[c + 1]; ++i) {
      const int32_t g = call_experts[i];
      if (key[g] >= 0) continue;
      ++out.misses;
      if (static_cast<int32_t>(resident.size()) >= slots) {
        // Furthest next use among experts not used by this call.
        auto it = resident.end();
        bool evicted = false;
        while (it != resident.begin()) {
          --it;
          if (in_call[it->second] == c) continue;
          evicted = true;
          break;
        }
        if (!evicted) continue;  // nothing evictable: this expert stays non-resident
        key[it->second] = -1;
        resident.erase(it);
      }
      key[g] = next_use[i];
      resident.insert({key[g], g});
    }
  }
  return out;
}

}  // namespace moe_cache
}  // namespace moe
