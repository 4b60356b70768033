#include "moe_cache/ensure_cpu.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace moe {
namespace moe_cache {

void EnsureExpertsCpu(CacheStateView* st, int32_t layer, const int32_t* ids, int32_t num_ids,
                      int32_t* out_slots, MissPlanEntry* plan, int32_t* plan_size,
                      uint8_t* used_scratch, EnsureCounts* counts,
                      const int32_t* fetch_of_misses) {
  const int32_t E = st->num_experts;
  const uint32_t counter = *st->call_counter;
  const int32_t base = layer * E;
  std::memset(used_scratch, 0, static_cast<size_t>(E));
  *counts = EnsureCounts();

  // (1) resolve hits, mark used experts.
  for (int32_t i = 0; i < num_ids; ++i) {
    const int32_t id = ids[i];
    if (!IsRoutedId(id, E)) {
      counts->padding += id < 0 ? 1 : 0;
      continue;
    }
    const int32_t s = st->slot_of[base + id];
    if (s >= 0 && !used_scratch[id]) {
      OnHit(st, s, counter);
      ++counts->hits;
    }
    used_scratch[id] = 1;
  }
  // (1b) the split: which distinct misses go to the CPU. used_scratch: 1 routed, 2 sent to
  // the CPU, 3 found unplaceable, 4 to be sent to the CPU when first met in (2).
  if (fetch_of_misses != nullptr) {
    std::vector<std::pair<int32_t, int32_t>> misses;  // (expert, first index), by first index
    for (int32_t i = 0; i < num_ids; ++i) {
      const int32_t id = ids[i];
      if (!IsRoutedId(id, E) || st->slot_of[base + id] >= 0 || used_scratch[id] != 1) continue;
      used_scratch[id] = 5;  // listed (reset below)
      misses.emplace_back(id, i);
    }
    const int32_t fetch = FetchCount(fetch_of_misses, static_cast<int32_t>(misses.size()));
    for (const auto& [a, first_a] : misses) {
      int32_t rank = 0;
      for (const auto& [b, first_b] : misses) {
        rank += FetchBefore(st->freq[base + b], first_b, st->freq[base + a], first_a);
      }
      used_scratch[a] = rank < fetch ? 1 : 4;
    }
  }
  // (2) one victim per distinct miss to fetch, in order of first occurrence.
  int32_t n = 0;
  for (int32_t i = 0; i < num_ids; ++i) {
    const int32_t id = ids[i];
    if (!IsRoutedId(id, E)) continue;
    const int32_t g = base + id;
    if (st->slot_of[g] >= 0) continue;
    if (used_scratch[id] == 2 || used_scratch[id] == 3) continue;  // handled already
    ++counts->misses;
    if (used_scratch[id] == 4) {
      ++counts->cpu;
      used_scratch[id] = 2;
      continue;
    }
    const int32_t victim = PickVictimSerial(st, layer, counter);
    if (victim < 0) {
      ++counts->unplaced;
      used_scratch[id] = 3;
      continue;
    }
    OnFill(st, g, victim, counter);
    plan[n++] = MissPlanEntry{g, victim};
  }
  *plan_size = n;
  // (2b) outputs. A non-resident routed expert is either on the CPU or unplaced.
  for (int32_t i = 0; i < num_ids; ++i) {
    const int32_t id = ids[i];
    if (!IsRoutedId(id, E)) {
      out_slots[i] = -1;
      continue;
    }
    const int32_t s = st->slot_of[base + id];
    out_slots[i] = s >= 0 ? s : (used_scratch[id] == 2 ? kCpuSlot : -1);
  }
  // (3) per-call updates.
  for (int32_t e = 0; e < E; ++e) UpdateFrequency(st, base + e, used_scratch[e] != 0);
  FinishCall(st);
}

CpuExpertCache::CpuExpertCache(const CacheConfig& config)
    : config_(config),
      slot_of_(static_cast<size_t>(config.num_layers) * config.num_experts, -1),
      expert_of_slot_(config.num_slots, -1),
      last_use_(config.num_slots, 0),
      freq_(static_cast<size_t>(config.num_layers) * config.num_experts, 0),
      pinned_(static_cast<size_t>(config.num_layers) * config.num_experts, 0),
      used_scratch_(config.num_experts, 0) {}

absl::StatusOr<CpuExpertCache> CpuExpertCache::Create(const CacheConfig& config) {
  if (config.num_layers <= 0 || config.num_experts <= 0 || config.num_slots <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cache config needs positive layers, experts and slots (got %d, %d, %d)",
        config.num_layers, config.num_experts, config.num_slots));
  }
  if (static_cast<int64_t>(config.num_layers) * config.num_experts > (1 << 30)) {
    return absl::InvalidArgumentError("layers * experts too large for int32 expert ids");
  }
  const PolicyParams& p = config.params;
  if (p.policy != kPolicyLru && p.policy != kPolicyLfu && p.policy != kPolicyScored) {
    return absl::InvalidArgumentError(absl::StrFormat("unknown policy id %d", p.policy));
  }
  if (p.freq_shift < 1 || p.freq_shift > 16) {
    return absl::InvalidArgumentError(
        absl::StrFormat("freq_shift must be in [1, 16], got %u", p.freq_shift));
  }
  if (!config.fetch_of_misses.empty() &&
      config.fetch_of_misses.size() != static_cast<size_t>(config.num_experts) + 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the hybrid split table has %d entries; it needs num_experts + 1 = %d (one per miss "
        "count 0..E)",
        config.fetch_of_misses.size(), config.num_experts + 1));
  }
  return CpuExpertCache(config);
}

CacheStateView CpuExpertCache::View() {
  CacheStateView v;
  v.slot_of = slot_of_.data();
  v.expert_of_slot = expert_of_slot_.data();
  v.last_use = last_use_.data();
  v.freq = freq_.data();
  v.pinned = pinned_.data();
  v.call_counter = &call_counter_;
  v.num_layers = config_.num_layers;
  v.num_experts = config_.num_experts;
  v.num_slots = config_.num_slots;
  v.params = config_.params;
  return v;
}

absl::Status CpuExpertCache::EnsureInto(int32_t layer, absl::Span<const int32_t> ids,
                                        int32_t tokens, int32_t k, EnsureResult* result) {
  if (layer < 0 || layer >= config_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer %d out of range [0, %d)", layer, config_.num_layers));
  }
  if (tokens < 0 || k < 0 || static_cast<int64_t>(tokens) * k != static_cast<int64_t>(ids.size())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ids has %d entries, expected tokens * k = %d * %d", ids.size(), tokens, k));
  }
  const int32_t n = static_cast<int32_t>(ids.size());
  for (int32_t i = 0; i < n; ++i) {
    if (ids[i] >= config_.num_experts) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "expert id %d at [%d, %d] of layer %d is >= num_experts %d", ids[i], i / std::max(k, 1),
          i % std::max(k, 1), layer, config_.num_experts));
    }
  }
  result->slots.resize(n);
  result->plan.resize(std::min(n, config_.num_slots));
  int32_t plan_size = 0;
  CacheStateView v = View();
  EnsureExpertsCpu(&v, layer, ids.data(), n, result->slots.data(), result->plan.data(), &plan_size,
                   used_scratch_.data(), &result->counts,
                   config_.fetch_of_misses.empty() ? nullptr : config_.fetch_of_misses.data());
  result->plan.resize(plan_size);
  return absl::OkStatus();
}

absl::StatusOr<EnsureResult> CpuExpertCache::Ensure(int32_t layer, absl::Span<const int32_t> ids,
                                                    int32_t tokens, int32_t k) {
  EnsureResult r;
  absl::Status s = EnsureInto(layer, ids, tokens, k, &r);
  if (!s.ok()) return s;
  return r;
}

}  // namespace moe_cache
}  // namespace moe
