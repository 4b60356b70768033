// The cache simulator tool's logic (//tools:cache_sim): command-line parsing into CacheSimOptions,
// the trace source (.npy file or synthetic generator), the replay of every policy at every slot
// count, and the table / JSON-lines report. A library so tests can drive it without a process.
//
// Thread-safety: pure functions.
#ifndef MOE_TOOLS_CACHE_SIM_LIB_H_
#define MOE_TOOLS_CACHE_SIM_LIB_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "moe_cache/simulator.h"
#include "moe_cache/synthetic_trace.h"

namespace moe {
namespace tools {

struct CacheSimOptions {
  bool help = false;
  std::string trace_path;       // --trace
  bool synthetic = false;       // --synthetic
  moe_cache::SyntheticTraceConfig synth;
  std::string write_trace;      // --write_trace: save the replayed trace as .npy
  std::vector<int32_t> slots;   // --slots
  std::vector<double> slots_frac;  // --slots_frac (of layers * experts)
  std::vector<double> budget_gb;   // --gpu_expert_budget_gb (slots = budget / bytes_per_expert)
  int32_t experts = 128;        // --experts (also the id range checked for --trace)
  std::vector<moe_cache::SimPolicy> policies = moe_cache::AllSimPolicies();
  moe_cache::SimOptions sim;
  bool json = false;
};

// Usage text printed by --help.
std::string CacheSimUsage();

// Parses argv[1..]. InvalidArgument naming the flag on anything wrong (unknown flag, bad number,
// missing source, ...).
absl::StatusOr<CacheSimOptions> ParseCacheSimArgs(const std::vector<std::string>& args);

// Runs the simulation and writes the report to `out`. Errors: NotFound / InvalidArgument for a bad
// trace file, InvalidArgument for inconsistent options.
absl::Status RunCacheSim(const CacheSimOptions& options, std::ostream& out);

}  // namespace tools
}  // namespace moe

#endif  // MOE_TOOLS_CACHE_SIM_LIB_H_
