// Hot-expert pinning: an EMA of routing heat per expert, and every `adapt_every` steps a re-chosen
// set of pinned experts (the hottest, up to a budget of slots), changed by at most `max_swaps`
// replacements per adaptation and only when a candidate beats the weakest pinned expert by a
// relative `margin` (hysteresis), so the set does not thrash. Pinned experts never leave the cache
// once resident (they are loaded on their next miss, then stay): the pinner only decides the
// `pinned[]` flags, which the caller copies into the cache state between steps.
//
// Runs on the host between steps. Not thread-safe.
#ifndef MOE_MOE_CACHE_PINNING_H_
#define MOE_MOE_CACHE_PINNING_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moe {
namespace moe_cache {

struct PinningConfig {
  double pin_fraction = 0.25;  // at most this share of the slots is pinned
  int32_t adapt_every = 16;    // steps between adaptations (--adapt-every)
  int32_t max_swaps = 16;      // replacements of a pinned expert per adaptation
  double heat_alpha = 1.0 / 32;  // EMA weight of the newest step's counts
  double margin = 0.25;        // a candidate must exceed the weakest pinned heat by this ratio
};

struct PinChange {
  int32_t expert;  // global id
  bool pinned;
};

class HotPinner {
 public:
  // `reserve`: slots that must stay unpinned (at least the distinct experts of one call).
  static absl::StatusOr<HotPinner> Create(int32_t layers, int32_t experts, int32_t slots,
                                          int32_t reserve, const PinningConfig& config);

  // Routed ids of one layer in the current step (padding, < 0, ignored). InvalidArgument,
  // observing nothing, for a layer out of range or an id >= experts.
  absl::Status Observe(int32_t layer, absl::Span<const int32_t> ids);
  // Ends a step: folds its counts into the heat and, every adapt_every steps, adapts. Returns the
  // flag changes to apply (empty between adaptations).
  std::vector<PinChange> EndStep();

  bool IsPinned(int32_t g) const { return pinned_[g] != 0; }
  int32_t num_pinned() const { return num_pinned_; }
  int32_t budget() const { return budget_; }
  uint64_t total_swaps() const { return total_swaps_; }
  double heat(int32_t g) const { return heat_[g]; }

 private:
  HotPinner(int32_t layers, int32_t experts, int32_t budget, const PinningConfig& config);
  std::vector<PinChange> Adapt();

  int32_t layers_;
  int32_t experts_;
  int32_t budget_;
  PinningConfig config_;
  std::vector<uint32_t> step_counts_;
  std::vector<double> heat_;
  std::vector<uint8_t> pinned_;
  int32_t num_pinned_ = 0;
  int64_t steps_ = 0;
  uint64_t total_swaps_ = 0;
};

}  // namespace moe_cache
}  // namespace moe

#endif  // MOE_MOE_CACHE_PINNING_H_
