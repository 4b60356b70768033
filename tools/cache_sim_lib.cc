#include "tools/cache_sim_lib.h"

#include <cmath>
#include <map>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/status.h"
#include "moe_cache/trace.h"
#include "nlohmann/json.hpp"

namespace moe {
namespace tools {
namespace {

using moe_cache::SimPolicy;

absl::Status FlagError(absl::string_view flag, absl::string_view value, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, "=", value, ": ", why, " (see --help)"));
}

absl::Status ParseInt(absl::string_view flag, absl::string_view v, int64_t lo, int64_t hi,
                      int64_t* out) {
  if (!absl::SimpleAtoi(v, out)) return FlagError(flag, v, "not an integer");
  if (*out < lo || *out > hi) {
    return FlagError(flag, v, absl::StrFormat("must be in [%d, %d]", lo, hi));
  }
  return absl::OkStatus();
}

absl::Status ParseDouble(absl::string_view flag, absl::string_view v, double lo, double hi,
                         double* out) {
  if (!absl::SimpleAtod(v, out) || !std::isfinite(*out)) return FlagError(flag, v, "not a number");
  if (*out < lo || *out > hi) return FlagError(flag, v, absl::StrFormat("must be in [%g, %g]", lo, hi));
  return absl::OkStatus();
}

}  // namespace

std::string CacheSimUsage() {
  return R"(cache_sim: replay a routing trace through the expert-cache eviction policies.

Usage:
  cache_sim --trace FILE.npy [options]
  cache_sim --synthetic [--layers 48 --experts 128 --topk 8 --tokens 1000 --zipf 1.0 --reuse 0.3
                         --seed 1] [options]

Trace source (exactly one):
  --trace FILE       .npy int16/int32/int64 array [tokens, layers, k] of expert ids, -1 = padding
  --synthetic        generate: per-layer Zipf popularity (random rank permutation per layer) plus
                     temporal locality (each previous-token expert reused with probability --reuse)
    --layers N       MoE layers (default 48)
    --experts N      experts per layer (default 128; with --trace, ids must be below it)
    --topk N         experts per token (default 8)
    --tokens N       tokens (default 1000)
    --zipf X         popularity exponent, 0 = uniform (default 1.0)
    --reuse X        temporal reuse probability in [0, 1] (default 0.3)
    --seed N         generator seed (default 1)
  --write_trace FILE save the replayed trace as .npy

Cache:
  --slots N[,N...]        slot counts (one pool shared by all layers)
  --slots_frac F[,F...]   slot counts as fractions of layers*experts (e.g. 0.1,0.25)
                          (default when neither is given: 0.1,0.25)
  --gpu_expert_budget_gb G[,G...]
                          slot counts from GPU memory budgets: floor(G * 1e9 / bytes_per_expert),
                          as the engine's --gpu-expert-budget-gb sizes its slot pool
  --bytes_per_expert B    bytes fetched per miss (default 9.44e6, Qwen3-30B-A3B bf16)
  --policies P[,P...]     subset of lru,lfu,scored,pinned_scored,belady (default: all)
  --adapt_every N         pinned_scored: steps between pin adaptations (default 16)
  --pin_fraction X        pinned_scored: max share of slots pinned (default 0.25)
  --max_swaps N           pinned_scored: pin replacements per adaptation (default 16)
  --margin X              pinned_scored: hysteresis, candidate heat > weakest*(1+X) (default 0.25)

Scored-policy constants (for tuning; defaults in moe_cache/policy_core.h):
  --freq_shift N          frequency EMA weight 2^-N per visit of the expert's layer (default 6)
  --recent_bonus X        extra reuse probability of an expert used at its layer's last visit (0.25)
  --recent_decay_shift N  the bonus is shifted right by N per visit missed since (default 3)
  --min_p X               floor of the reuse probability estimate (default 1/256)

Output:
  --json             one JSON object per (policy, slots) line with keys policy, slots, hit_rate,
                     misses_per_token, fetched_gb_per_token (plus gap_closed, tokens, pin_swaps)
  default            a table; gap_closed = (hit - lru) / (belady - lru) at the same slot count
  --help             this text

Hit rate counts each distinct (layer, expert) request of a call once; cold start included.
Exit codes: 0 ok, 1 bad trace file or simulation error, 2 bad flags.
)";
}

absl::StatusOr<CacheSimOptions> ParseCacheSimArgs(const std::vector<std::string>& args) {
  CacheSimOptions o;
  bool experts_given = false;
  bool synth_flag_given = false;
  for (size_t i = 0; i < args.size(); ++i) {
    absl::string_view a = args[i];
    if (a == "--help" || a == "-h" || a == "--helpfull") {
      o.help = true;
      return o;
    }
    if (!absl::ConsumePrefix(&a, "--")) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", a, "' (see --help)"));
    }
    std::string name, value;
    bool has_value = false;
    if (size_t eq = a.find('='); eq != absl::string_view::npos) {
      name = std::string(a.substr(0, eq));
      value = std::string(a.substr(eq + 1));
      has_value = true;
    } else {
      name = std::string(a);
    }
    if (name == "synthetic" || name == "json") {
      bool b = true;
      if (has_value && !absl::SimpleAtob(value, &b)) return FlagError(name, value, "not a boolean");
      (name == "json" ? o.json : o.synthetic) = b;
      continue;
    }
    if (!has_value) {
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value (see --help)"));
      }
      value = args[++i];
    }
    int64_t n = 0;
    double x = 0;
    if (name == "trace") {
      o.trace_path = value;
    } else if (name == "write_trace") {
      o.write_trace = value;
    } else if (name == "layers") {
      RETURN_IF_ERROR(ParseInt(name, value, 1, 4096, &n));
      o.synth.layers = static_cast<int32_t>(n);
      synth_flag_given = true;
    } else if (name == "experts") {
      RETURN_IF_ERROR(ParseInt(name, value, 1, 1 << 16, &n));
      o.experts = static_cast<int32_t>(n);
      experts_given = true;
    } else if (name == "topk") {
      RETURN_IF_ERROR(ParseInt(name, value, 1, 1 << 16, &n));
      o.synth.k = static_cast<int32_t>(n);
      synth_flag_given = true;
    } else if (name == "tokens") {
      RETURN_IF_ERROR(ParseInt(name, value, 1, 1 << 24, &n));
      o.synth.tokens = static_cast<int32_t>(n);
      synth_flag_given = true;
    } else if (name == "zipf") {
      RETURN_IF_ERROR(ParseDouble(name, value, 0, 16, &x));
      o.synth.zipf = x;
      synth_flag_given = true;
    } else if (name == "reuse") {
      RETURN_IF_ERROR(ParseDouble(name, value, 0, 1, &x));
      o.synth.reuse = x;
      synth_flag_given = true;
    } else if (name == "seed") {
      RETURN_IF_ERROR(ParseInt(name, value, 0, INT64_MAX, &n));
      o.synth.seed = static_cast<uint64_t>(n);
      synth_flag_given = true;
    } else if (name == "slots") {
      for (absl::string_view part : absl::StrSplit(value, ',')) {
        RETURN_IF_ERROR(ParseInt(name, part, 1, 1 << 30, &n));
        o.slots.push_back(static_cast<int32_t>(n));
      }
    } else if (name == "slots_frac") {
      for (absl::string_view part : absl::StrSplit(value, ',')) {
        RETURN_IF_ERROR(ParseDouble(name, part, 1e-9, 1, &x));
        o.slots_frac.push_back(x);
      }
    } else if (name == "gpu_expert_budget_gb") {
      for (absl::string_view part : absl::StrSplit(value, ',')) {
        RETURN_IF_ERROR(ParseDouble(name, part, 1e-9, 1e9, &x));
        o.budget_gb.push_back(x);
      }
    } else if (name == "bytes_per_expert") {
      RETURN_IF_ERROR(ParseDouble(name, value, 0, 1e15, &x));
      o.sim.bytes_per_expert = x;
    } else if (name == "policies") {
      o.policies.clear();
      for (absl::string_view part : absl::StrSplit(value, ',')) {
        auto p = moe_cache::ParseSimPolicy(part);
        if (!p.ok()) return FlagError(name, value, p.status().message());
        o.policies.push_back(*p);
      }
    } else if (name == "adapt_every") {
      RETURN_IF_ERROR(ParseInt(name, value, 1, 1 << 30, &n));
      o.sim.pinning.adapt_every = static_cast<int32_t>(n);
    } else if (name == "pin_fraction") {
      RETURN_IF_ERROR(ParseDouble(name, value, 0, 1, &x));
      o.sim.pinning.pin_fraction = x;
    } else if (name == "max_swaps") {
      RETURN_IF_ERROR(ParseInt(name, value, 0, 1 << 30, &n));
      o.sim.pinning.max_swaps = static_cast<int32_t>(n);
    } else if (name == "margin") {
      RETURN_IF_ERROR(ParseDouble(name, value, 0, 1e6, &x));
      o.sim.pinning.margin = x;
    } else if (name == "freq_shift") {
      RETURN_IF_ERROR(ParseInt(name, value, 1, 16, &n));
      o.sim.scored.freq_shift = static_cast<uint32_t>(n);
    } else if (name == "recent_bonus") {
      RETURN_IF_ERROR(ParseDouble(name, value, 0, 1, &x));
      o.sim.scored.recent_bonus_q16 = static_cast<uint32_t>(x * moe_cache::kFreqOne);
    } else if (name == "recent_decay_shift") {
      RETURN_IF_ERROR(ParseInt(name, value, 0, 31, &n));
      o.sim.scored.recent_decay_shift = static_cast<uint32_t>(n);
    } else if (name == "min_p") {
      RETURN_IF_ERROR(ParseDouble(name, value, 1.0 / moe_cache::kFreqOne, 1, &x));
      o.sim.scored.min_p_q16 = static_cast<uint32_t>(x * moe_cache::kFreqOne);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, " (see --help)"));
    }
  }
  if (o.synthetic == !o.trace_path.empty()) {
    return absl::InvalidArgumentError("give exactly one of --trace FILE or --synthetic (see --help)");
  }
  if (!o.synthetic && synth_flag_given) {
    return absl::InvalidArgumentError(
        "--layers/--topk/--tokens/--zipf/--reuse/--seed only apply to --synthetic (see --help)");
  }
  o.synth.experts = o.experts;
  (void)experts_given;
  if (o.synth.k > o.synth.experts) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--topk %d exceeds --experts %d (see --help)", o.synth.k, o.synth.experts));
  }
  if (o.slots.empty() && o.slots_frac.empty() && o.budget_gb.empty()) o.slots_frac = {0.1, 0.25};
  o.sim.experts = o.experts;
  return o;
}

absl::Status RunCacheSim(const CacheSimOptions& o, std::ostream& out) {
  moe_cache::Trace trace;
  if (o.synthetic) {
    ASSIGN_OR_RETURN(trace, moe_cache::GenerateSyntheticTrace(o.synth));
  } else {
    ASSIGN_OR_RETURN(trace, moe_cache::ReadNpyTrace(o.trace_path));
    if (trace.MaxId() >= o.experts) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: expert id %d is not below --experts %d", o.trace_path, trace.MaxId(), o.experts));
    }
  }
  if (trace.tokens == 0 || trace.layers == 0 || trace.k == 0) {
    return absl::InvalidArgumentError("trace is empty");
  }
  if (!o.write_trace.empty()) RETURN_IF_ERROR(moe_cache::WriteNpyTrace(trace, o.write_trace));
  const int64_t total = static_cast<int64_t>(trace.layers) * o.experts;
  std::vector<int32_t> slots = o.slots;
  for (double f : o.slots_frac) {
    slots.push_back(static_cast<int32_t>(std::max<int64_t>(1, std::llround(std::floor(f * total)))));
  }
  for (double gb : o.budget_gb) {
    const double n = std::floor(gb * 1e9 / o.sim.bytes_per_expert);
    if (n < 1) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--gpu_expert_budget_gb %g holds no expert of %g bytes", gb, o.sim.bytes_per_expert));
    }
    slots.push_back(static_cast<int32_t>(std::min<double>(n, static_cast<double>(total))));
  }
  if (!o.json) {
    out << absl::StrFormat("trace: %d tokens x %d layers x top-%d, %d experts/layer (%d in all)\n",
                           trace.tokens, trace.layers, trace.k, o.experts, total);
    out << absl::StrFormat("%-14s %8s %9s %12s %12s %10s\n", "policy", "slots", "hit_rate",
                           "miss/token", "GB/token", "gap_closed");
  }
  for (int32_t s : slots) {
    std::map<SimPolicy, moe_cache::SimResult> results;
    // LRU and Belady first: the gap needs both.
    std::vector<SimPolicy> order;
    for (SimPolicy p : {SimPolicy::kLru, SimPolicy::kBelady}) order.push_back(p);
    for (SimPolicy p : moe_cache::AllSimPolicies()) {
      if (p != SimPolicy::kLru && p != SimPolicy::kBelady) order.push_back(p);
    }
    for (SimPolicy p : order) {
      bool wanted = false;
      for (SimPolicy q : o.policies) wanted |= (q == p);
      const bool needed_for_gap = (p == SimPolicy::kLru || p == SimPolicy::kBelady);
      if (!wanted && !needed_for_gap) continue;
      ASSIGN_OR_RETURN(results[p], moe_cache::Simulate(trace, p, s, o.sim));
    }
    const double lru = results.at(SimPolicy::kLru).hit_rate();
    const double belady = results.at(SimPolicy::kBelady).hit_rate();
    for (SimPolicy p : moe_cache::AllSimPolicies()) {
      bool wanted = false;
      for (SimPolicy q : o.policies) wanted |= (q == p);
      if (!wanted) continue;
      const moe_cache::SimResult& r = results.at(p);
      const double gap = moe_cache::GapClosed(lru, belady, r.hit_rate());
      if (o.json) {
        nlohmann::json j;
        j["policy"] = moe_cache::SimPolicyName(p);
        j["slots"] = s;
        j["hit_rate"] = r.hit_rate();
        j["misses_per_token"] = r.misses_per_token();
        j["fetched_gb_per_token"] = r.fetched_gb_per_token();
        j["gap_closed"] = gap;
        j["tokens"] = r.tokens;
        j["pin_swaps"] = r.pin_swaps;
        out << j.dump() << "\n";
      } else {
        out << absl::StrFormat("%-14s %8d %9.4f %12.2f %12.4f %10.3f\n",
                               moe_cache::SimPolicyName(p), s, r.hit_rate(), r.misses_per_token(),
                               r.fetched_gb_per_token(), gap);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace tools
}  // namespace moe
