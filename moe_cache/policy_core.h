// The shared decision core of ensure_experts: state layout, eviction scores, eligibility and the
// per-call bookkeeping, written once and compiled both by the host compiler (the CPU mirror,
// ensure_cpu.cc) and by nvcc (the CUDA ensure kernel), so the two make the same decisions victim for
// victim.
//
// Rules for this file: plain C++17 that nvcc accepts; no std:: containers, no exceptions, no CUDA
// includes, no floating point in any decision; fixed-width integers and POD structs passed by
// pointer. Functions are `MOE_HD inline` (host + device under nvcc, host only otherwise).
//
// Ownership / thread-safety: nothing here allocates or owns memory. `CacheStateView` points at
// arrays owned by the caller (host arrays for the mirror, device arrays for the kernel). The
// functions are not synchronized; one call of ensure_experts at a time is the single writer of the
// state (on the GPU: one block, with the per-miss victim search done as a block-wide argmin).
//
// THE DECISION ORDER of one call `ensure(layer, ids[T, k])`, which both implementations follow:
//   counter = *state->call_counter
//   (1) for i in 0..T*k-1 (row-major): id = ids[i]; if !IsRoutedId(id, E): out[i] = -1, skip.
//       g = layer*E + id; mark expert `id` used in this call (for step 3);
//       if slot_of[g] >= 0: OnHit(state, slot_of[g], counter) (counts as a hit once per distinct g).
//   (1b) the n distinct experts marked in (1) that are not resident (slot_of < 0) are the
//       call's misses; m = FetchCount(fetch_of_misses, n) of them are fetched (all without a
//       split): those first in FetchBefore's order (the most frequent, then the first routed);
//       the other n - m go to the CPU for this call (no slot, no state change).
//   (2) for i in 0..T*k-1 (row-major): skip padding; g = layer*E + ids[i];
//       if slot_of[g] >= 0 continue (a hit, or a miss already placed earlier in this call);
//       if expert ids[i] was already handled as a miss in this call (sent to the CPU or found
//       unplaceable) continue; if it goes to the CPU, mark it handled and continue; else
//       victim = argmin over slots s with SlotEligible(state, s, counter) of
//                (SlotScore(state, s, layer, counter), s)        [ArgminBetter orders the pairs]
//       if no eligible slot: leave g unplaced (its outputs stay -1); else
//       OnFill(state, g, victim, counter) and append plan entry {g, victim}.
//   (2b) for i: out[i] = padding ? -1 : slot_of[layer*E + ids[i]] if resident, else kCpuSlot
//       for an expert sent to the CPU, else -1 (unplaced).
//   (3) for e in 0..E-1: UpdateFrequency(state, layer*E + e, used[e]); then FinishCall(state).
// A slot's score depends only on its own state and the call (layer, counter), never on decisions
// for other misses of the same call, so the per-miss argmin can be computed in parallel; a slot
// filled or hit in this call has last_use == counter and is therefore ineligible.
#ifndef MOE_MOE_CACHE_POLICY_CORE_H_
#define MOE_MOE_CACHE_POLICY_CORE_H_

#include <stdint.h>

#ifdef __CUDACC__
#define MOE_HD __host__ __device__
#else
#define MOE_HD
#endif

namespace moe {
namespace moe_cache {

// Policy ids. Pinned+scored is kPolicyScored with the host writing `pinned[]` between steps.
enum : int32_t {
  kPolicyLru = 0,     // evict the least recently used slot (global, per-slot last use)
  kPolicyLfu = 1,     // evict the lowest decayed frequency, then least recently used
  kPolicyScored = 2,  // evict the largest expected time to next use (see SlotScore)
};

// Frequencies are Q16 fixed point: kFreqOne means "routed at every visit of its layer".
constexpr uint32_t kFreqOne = 1u << 16;

// Constants of the scored policy. Defaults are the values from DefaultPolicyParams(); how they were
// chosen is documented there.
struct PolicyParams {
  int32_t policy;              // kPolicyLru / kPolicyLfu / kPolicyScored
  uint32_t freq_shift;         // EMA: f += (used ? kFreqOne : 0) - f, scaled by 2^-freq_shift
  uint32_t recent_bonus_q16;   // extra reuse probability of an expert used at its layer's last visit
  uint32_t recent_decay_shift; // the bonus halves (>> this) per visit of its layer missed since use
  uint32_t min_p_q16;          // floor of the probability estimate (keeps the division bounded)
};

// A view of the cache state. All pointers are owned by the caller and live on the side that runs
// the functions (host or device). Global expert id g = layer * num_experts + expert.
struct CacheStateView {
  int32_t* slot_of;          // [L*E] slot holding expert g, -1 if not resident
  int32_t* expert_of_slot;   // [S]   global expert in slot s, -1 if free
  uint32_t* last_use;        // [S]   call counter of the last call that used (hit or filled) s
  uint32_t* freq;            // [L*E] decayed frequency, Q16 (kFreqOne = every visit)
  uint8_t* pinned;           // [L*E] 1: once resident never evicted (written by the host pinner)
  uint32_t* call_counter;    // [1]   index of the current call; starts at 1, +1 per call
  int32_t num_layers;        // L
  int32_t num_experts;       // E
  int32_t num_slots;         // S
  PolicyParams params;
};

// One entry of the miss plan: copy expert `expert` (global id) into slot `slot`.
struct MissPlanEntry {
  int32_t expert;
  int32_t slot;
};

// Default constants of each policy. How the scored constants were chosen: see the comment in
// DefaultPolicyParams's body.
MOE_HD inline PolicyParams DefaultPolicyParams(int32_t policy) {
  PolicyParams p;
  p.policy = policy;
  // Chosen by replay (tools:cache_sim, scored only) on 18 SYNTHETIC traces (seed 7, 400 tokens,
  // L=48, E=128, top-8; zipf 0.7/1.0/1.3 x reuse 0.1/0.3/0.5 x slots 10%/25%), maximizing the mean
  // fraction of the LRU->Belady gap closed, over freq_shift 3..8, recent_bonus 0..0.75,
  // recent_decay_shift 1..3. Longer frequency windows kept improving the stationary synthetic
  // traces (shift 8: 0.44 mean) while the real trace preferred 4-5 (0.32 vs 0.29 at 8); shift 6
  // (about a 64-token window) is the compromise, since real routing drifts with the prompt.
  // recent_bonus 0 is far worse (negative gap on high-reuse traces), 0.25 beat 0.5 and 0.75;
  // decay 3 (the bonus drops 8x per missed visit) slightly beat 1 and 2. Result with these
  // constants: 0.42 mean / 0.29 min gap closed on the tuning set; 0.41 on the default synthetic
  // trace (seed 1, 1000 tokens, 25% slots); 0.29 on the real Qwen3 trace at 10% slots, which was
  // only used as a sanity check.
  p.freq_shift = 6;
  p.recent_bonus_q16 = kFreqOne / 4;
  p.recent_decay_shift = 3;
  // Keeps the expected wait finite (at most about 256 * L calls) for never-seen experts.
  p.min_p_q16 = kFreqOne / 256;
  return p;
}

// Output of ensure_experts for a route whose expert is computed on the CPU in this call (the
// hybrid split): such an expert takes no slot, and the GPU's expert kernels skip the route like
// padding.
constexpr int32_t kCpuSlot = -2;

// The hybrid split rule of step (1b): of a call's n distinct misses, FetchCount(fetch_of_misses,
// n) are fetched into slots and the rest are computed on the CPU. `fetch_of_misses` [E + 1] is a
// table the host builds from the bandwidth profile (hybrid_split.h: FetchTable); null fetches
// every miss (offload only). Integers only, so the kernel and the mirror agree; entries outside
// [0, n] are clamped.
MOE_HD inline int32_t FetchCount(const int32_t* fetch_of_misses, int32_t n) {
  if (fetch_of_misses == nullptr) return n;
  const int32_t m = fetch_of_misses[n];
  return m < 0 ? 0 : (m > n ? n : m);
}

// Which misses the split fetches: miss a (decayed frequency freq_a, first routed at index
// first_a of the call's ids) goes before miss b when it is more frequent, or as frequent and
// routed first. An expert computed on the CPU takes no slot and misses again at its next use, so
// the slots go to the experts most likely to be used again and the CPU takes the rare ones.
MOE_HD inline bool FetchBefore(uint32_t freq_a, int32_t first_a, uint32_t freq_b,
                               int32_t first_b) {
  return freq_a > freq_b || (freq_a == freq_b && first_a < first_b);
}

// Score of a free slot: lowest possible, so free slots are filled first (lowest index first).
constexpr uint64_t kFreeSlotScore = 0;

MOE_HD inline bool IsRoutedId(int32_t id, int32_t num_experts) {
  // Padding (< 0) is skipped everywhere: not counted, not fetched. An id >= E is an error: the
  // host APIs reject it with InvalidArgument before touching any state, and the GPU kernel,
  // which cannot return a Status, skips it like padding and raises its error flag.
  return id >= 0 && id < num_experts;
}

// True if slot `s` may be chosen as a victim in the call with counter `counter`.
MOE_HD inline bool SlotEligible(const CacheStateView* st, int32_t s, uint32_t counter) {
  const int32_t g = st->expert_of_slot[s];
  if (g < 0) return true;                       // free
  if (st->pinned[g]) return false;              // hot pinned experts never leave
  return st->last_use[s] != counter;            // never evict an expert of the current call
}

// Expected number of calls until the expert in slot `s` is used again, in 1/16 call units, for the
// scored policy. Model: layers are visited cyclically, so the next chance to use an expert of layer
// l after the current call (at layer `layer`) comes in dist = ((l - layer - 1) mod L) + 1 calls; at
// each visit it is routed with probability p, so the expected wait is dist + L * (1 - p) / p.
// p = max(min_p, min(1, freq + recent_bonus >> (recent_decay_shift * missed))) where `missed` is the
// number of visits of its layer since the expert was last used (temporal locality: experts of the
// previous token are likely to be routed again).
MOE_HD inline uint64_t ExpectedCallsToNextUse16(const CacheStateView* st, int32_t s, int32_t layer,
                                                uint32_t counter) {
  const int32_t g = st->expert_of_slot[s];
  const int32_t L = st->num_layers;
  const int32_t l = g / st->num_experts;
  const uint32_t dist = (uint32_t)(((l - layer - 1) % L + L) % L) + 1u;  // in [1, L]
  const uint32_t missed = (counter - st->last_use[s]) / (uint32_t)L;
  uint64_t p = st->freq[g];
  const uint32_t shift = st->params.recent_decay_shift * missed;
  if (shift < 32) p += st->params.recent_bonus_q16 >> shift;
  if (p > kFreqOne) p = kFreqOne;
  if (p < st->params.min_p_q16) p = st->params.min_p_q16;
  if (p == 0) p = 1;
  return 16ull * dist + (16ull * (uint64_t)L * (kFreqOne - p)) / p;
}

// Eviction score of slot `s` in the call (layer, counter): lower = evicted first; ties are broken
// by the lowest slot index (ArgminBetter). Only meaningful for eligible slots.
MOE_HD inline uint64_t SlotScore(const CacheStateView* st, int32_t s, int32_t layer,
                                 uint32_t counter) {
  const int32_t g = st->expert_of_slot[s];
  if (g < 0) return kFreeSlotScore;
  // +1 keeps every occupied slot above a free one.
  const uint64_t recency = (uint64_t)st->last_use[s] + 1u;  // < 2^33
  switch (st->params.policy) {
    case kPolicyLfu:
      return ((uint64_t)st->freq[g] << 32) + recency;
    case kPolicyScored: {
      // Keep the experts needed soonest: invert the expected wait (capped at 2^30 / 16 calls), then
      // break ties by recency.
      uint64_t wait = ExpectedCallsToNextUse16(st, s, layer, counter);
      if (wait > (1ull << 30)) wait = 1ull << 30;
      return (((1ull << 30) - wait) << 33) + recency;
    }
    case kPolicyLru:
    default:
      return recency;
  }
}

// Orders (score, slot) pairs: true if candidate a is a better victim than b. Use in the argmin.
MOE_HD inline bool ArgminBetter(uint64_t score_a, int32_t slot_a, uint64_t score_b,
                                int32_t slot_b) {
  if (slot_b < 0) return slot_a >= 0;
  if (slot_a < 0) return false;
  return score_a < score_b || (score_a == score_b && slot_a < slot_b);
}

// Serial reference of the step-(2) victim search (the kernel does the same as a parallel argmin).
// Returns -1 if no slot is eligible.
MOE_HD inline int32_t PickVictimSerial(const CacheStateView* st, int32_t layer, uint32_t counter) {
  int32_t best = -1;
  uint64_t best_score = 0;
  for (int32_t s = 0; s < st->num_slots; ++s) {
    if (!SlotEligible(st, s, counter)) continue;
    const uint64_t sc = SlotScore(st, s, layer, counter);
    if (ArgminBetter(sc, s, best_score, best)) {
      best = s;
      best_score = sc;
    }
  }
  return best;
}

// Step (1) bookkeeping for a hit on slot `s`.
MOE_HD inline void OnHit(CacheStateView* st, int32_t s, uint32_t counter) {
  st->last_use[s] = counter;
}

// Step (2): place global expert `g` into slot `s` (evicting its occupant, if any).
MOE_HD inline void OnFill(CacheStateView* st, int32_t g, int32_t s, uint32_t counter) {
  const int32_t old = st->expert_of_slot[s];
  if (old >= 0) st->slot_of[old] = -1;
  st->expert_of_slot[s] = g;
  st->slot_of[g] = s;
  st->last_use[s] = counter;
}

// Step (3): per-call frequency update of global expert `g` of the call's layer. `used` = the expert
// appeared in a routed (non-padding) id of this call. Integer EMA, identical on host and device.
MOE_HD inline void UpdateFrequency(CacheStateView* st, int32_t g, bool used) {
  const uint32_t shift = st->params.freq_shift;
  uint32_t f = st->freq[g];
  f -= f >> shift;
  if (used) f += kFreqOne >> shift;
  st->freq[g] = f;
}

// Step (3), last: advance the call counter.
MOE_HD inline void FinishCall(CacheStateView* st) { *st->call_counter += 1u; }

}  // namespace moe_cache
}  // namespace moe

#endif  // MOE_MOE_CACHE_POLICY_CORE_H_
