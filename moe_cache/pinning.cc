#include "moe_cache/pinning.h"

#include <algorithm>
#include <numeric>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace moe {
namespace moe_cache {

absl::StatusOr<HotPinner> HotPinner::Create(int32_t layers, int32_t experts, int32_t slots,
                                            int32_t reserve, const PinningConfig& config) {
  if (layers <= 0 || experts <= 0 || slots <= 0 || reserve < 0) {
    return absl::InvalidArgumentError("pinner needs positive layers, experts, slots");
  }
  if (!(config.pin_fraction >= 0 && config.pin_fraction <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("pin fraction must be in [0, 1], got %g", config.pin_fraction));
  }
  if (config.adapt_every <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("adapt_every must be positive, got %d", config.adapt_every));
  }
  if (config.max_swaps < 0 || !(config.margin >= 0) ||
      !(config.heat_alpha > 0 && config.heat_alpha <= 1)) {
    return absl::InvalidArgumentError(
        "pinning needs max_swaps >= 0, margin >= 0, heat_alpha in (0, 1]");
  }
  const int32_t budget = std::max<int32_t>(
      0, std::min<int32_t>(static_cast<int32_t>(config.pin_fraction * slots), slots - reserve));
  return HotPinner(layers, experts, budget, config);
}

HotPinner::HotPinner(int32_t layers, int32_t experts, int32_t budget, const PinningConfig& config)
    : layers_(layers),
      experts_(experts),
      budget_(budget),
      config_(config),
      step_counts_(static_cast<size_t>(layers) * experts, 0),
      heat_(static_cast<size_t>(layers) * experts, 0.0),
      pinned_(static_cast<size_t>(layers) * experts, 0) {}

absl::Status HotPinner::Observe(int32_t layer, absl::Span<const int32_t> ids) {
  if (layer < 0 || layer >= layers_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer %d out of range [0, %d)", layer, layers_));
  }
  for (int32_t id : ids) {
    if (id >= experts_) {
      return absl::InvalidArgumentError(
          absl::StrFormat("expert id %d of layer %d is >= experts %d", id, layer, experts_));
    }
  }
  for (int32_t id : ids) {
    if (id < 0) continue;  // padding
    ++step_counts_[static_cast<size_t>(layer) * experts_ + id];
  }
  return absl::OkStatus();
}

std::vector<PinChange> HotPinner::EndStep() {
  const double a = config_.heat_alpha;
  for (size_t g = 0; g < heat_.size(); ++g) {
    heat_[g] += a * (static_cast<double>(step_counts_[g]) - heat_[g]);
    step_counts_[g] = 0;
  }
  ++steps_;
  if (steps_ % config_.adapt_every != 0) return {};
  return Adapt();
}

std::vector<PinChange> HotPinner::Adapt() {
  std::vector<PinChange> changes;
  if (budget_ == 0) return changes;
  // Unpinned candidates, hottest first; pinned ones, coldest first. Ties by lower id.
  std::vector<int32_t> cand, pins;
  for (int32_t g = 0; g < static_cast<int32_t>(heat_.size()); ++g) {
    if (pinned_[g]) {
      pins.push_back(g);
    } else if (heat_[g] > 0) {
      cand.push_back(g);
    }
  }
  auto hotter = [&](int32_t x, int32_t y) {
    return heat_[x] > heat_[y] || (heat_[x] == heat_[y] && x < y);
  };
  std::sort(cand.begin(), cand.end(), hotter);
  std::sort(pins.begin(), pins.end(), [&](int32_t x, int32_t y) { return hotter(y, x); });
  size_t ci = 0;
  // Fill free budget first: additions do not evict anything pinned, so they are not swaps.
  while (num_pinned_ < budget_ && ci < cand.size()) {
    pinned_[cand[ci]] = 1;
    changes.push_back({cand[ci], true});
    ++num_pinned_;
    ++ci;
  }
  // Replace the weakest pinned experts by clearly hotter candidates, at most max_swaps.
  size_t pi = 0;
  for (int32_t swaps = 0; swaps < config_.max_swaps && ci < cand.size() && pi < pins.size();
       ++swaps) {
    const int32_t c = cand[ci], w = pins[pi];
    if (!(heat_[c] > heat_[w] * (1.0 + config_.margin))) break;
    pinned_[w] = 0;
    pinned_[c] = 1;
    changes.push_back({w, false});
    changes.push_back({c, true});
    ++ci;
    ++pi;
    ++total_swaps_;
  }
  return changes;
}

}  // namespace moe_cache
}  // namespace moe
