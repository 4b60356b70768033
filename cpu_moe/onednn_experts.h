// onednn_experts: the prefill path of cpu_moe for bf16 banks. Experts with many routed tokens are
// computed as three small GEMMs each through oneDNN matmul (brgemm with AMX tiles where the CPU
// has them, AVX-512 BF16 otherwise), instead of the GEMV kernels of internal/*-inl.h:
//
//   per expert e with m routed tokens:
//     xg = bf16(x[tokens])                  [m, H]
//     g  = swish(xg @ gate_e^T)             [m, I] fp32   (gate_e = rows [0, I) of gate_up_e,
//                                                          read in place as an [H, I] "ba"
//                                                          weights memory: no copy)
//     a  = bf16((xg @ up_e^T) * g)          [m, I]        (up_e = rows [I, 2I))
//     yp = a @ down_e^T                     [m, H] fp32   (down_e [H, I] as [I, H] "ba")
//     y[token] += weight * yp[row]                         (fp32)
//   (swigluoai clips gate at `limit` before swish(alpha), up to [-limit, limit] and adds 1.)
//
// Forward (cpu_moe.h) calls this for the experts whose route count reaches
// Options::onednn_min_tokens_per_expert; library users normally never touch it directly.
// Plain types only: no oneDNN types in this header.
#ifndef MOE_CPU_MOE_ONEDNN_EXPERTS_H_
#define MOE_CPU_MOE_ONEDNN_EXPERTS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace moe::cpu_moe {

// How the experts of one call share the CPU. oneDNN (Debian's libdnnl) runs on OpenMP threads
// (libgomp), never on cpu_moe's ThreadPool.
enum class OnednnThreading {
  kAuto,               // kExpertsParallel when there are >= 2 experts per OpenMP thread, else
                       // kExpertsSequential
  kExpertsSequential,  // one expert after another, oneDNN parallelizes inside each GEMM
  kExpertsParallel,    // experts spread over OpenMP threads, each GEMM single-threaded
};

// One call's work: a set of experts of one bf16 bank and their routes.
struct OnednnExpertsWork {
  int hidden = 0;        // H
  int intermediate = 0;  // I
  const uint16_t* gate_up = nullptr;  // bf16 bits [E, 2I, H] (rows [0, I) gate, [I, 2I) up)
  const uint16_t* down = nullptr;     // bf16 bits [E, H, I]
  const void* x = nullptr;            // [T, H], fp32 or bf16 bits
  bool x_bf16 = false;
  bool swiglu_oai = false;  // false: silu(g) * u; true: gpt-oss clamped variant
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;
  // Expert experts[g] has routes [group_begin[g], group_begin[g + 1]) of route_token /
  // route_weight (group_begin has experts.size() + 1 entries).
  absl::Span<const int> experts;
  absl::Span<const int> group_begin;
  absl::Span<const int> route_token;
  absl::Span<const float> route_weight;
  float* y = nullptr;  // fp32 [T, H]: y[t] += w * expert(x[t]) for every route (never overwritten)
  OnednnThreading threading = OnednnThreading::kAuto;
};

// How oneDNN's OpenMP threads share the machine with the caller's ThreadPool. libgomp threads
// cannot be handed a pool, and after each parallel region they spin before sleeping: for up to
// 300,000 iterations by default (GOMP_SPINCOUNT; milliseconds), forever with
// OMP_WAIT_POLICY=ACTIVE, not at all with OMP_WAIT_POLICY=PASSIVE. libgomp reads those variables
// once at start-up, so the wait policy is the process environment's: a process that runs other
// thread pools beside the prefill path (an engine) should set OMP_WAIT_POLICY=PASSIVE.
struct OnednnConfig {
  // OpenMP threads per Run (0: OpenMP's default, OMP_NUM_THREADS or every logical CPU). Set on
  // the calling thread for the call (omp_set_num_threads) and restored after it.
  int num_threads = 0;
  // Forward (cpu_moe.h) parks the ThreadPool it was given (ThreadPool::Park) while this runs,
  // so the pool's idle workers sleep at once instead of spinning beside oneDNN's threads.
  bool park_pool = true;
};

// Owns the oneDNN CPU engine and a cache of matmul primitives keyed by (M, N, K, data types,
// post-ops, threads). Creating a primitive JIT-compiles kernels (0.5-4 ms measured), so each
// shape is created once and reused.
//
// M: oneDNN 2.6 only offers its non-AMX "gemm:jit" matmul for a runtime M (DNNL_RUNTIME_DIM_VAL;
// brgemm refuses runtime dims), measured 2-5x slower than brgemm on a 2-core AMX Xeon VM, so M is
// static: rounded up to a multiple of 16 above 16 (zero rows; AMX tiles have 16 rows anyway),
// one cached primitive per rounded M. A prefill's experts see only a few distinct rounded M.
//
// The activation is fused into the gate_up GEMMs as oneDNN post-ops (fp32): the gate GEMM
// (N = I) applies swish (after a clip at `limit` for swigluoai), the up GEMM (N = I) applies the
// clip and +1 for swigluoai and then multiplies by the gate result, writing bf16.
//
// Owned by the caller and passed to Forward like the thread pool (no process-wide instance):
// an engine keeps one for its lifetime, so primitives are created once per shape. Thread-safe:
// concurrent Run calls share the cache (under a lock) and each uses its own stream and
// scratchpad. oneDNN's OpenMP threads are bounded by OnednnConfig::num_threads (or
// OMP_NUM_THREADS) and their spinning by OMP_WAIT_POLICY (see OnednnConfig).
class OnednnExperts {
 public:
  explicit OnednnExperts(const OnednnConfig& config = OnednnConfig());
  ~OnednnExperts();
  OnednnExperts(const OnednnExperts&) = delete;
  OnednnExperts& operator=(const OnednnExperts&) = delete;

  absl::Status Run(const OnednnExpertsWork& work);

  const OnednnConfig& config() const { return config_; }
  // The OpenMP threads a Run from the calling thread uses (config().num_threads, or OpenMP's
  // default for this thread when 0).
  int threads() const;

  // Primitives created so far (both GEMMs, all shapes).
  size_t num_primitives() const;
  // The rounded M a group of m routes runs at.
  int PaddedRows(int m) const;

  // oneDNN's effective ISA ("avx512_core_amx", "avx512_core_bf16", ...), its version, the
  // OpenMP threads it uses by default, and the OpenMP wait policy of the environment
  // ("OMP_WAIT_POLICY=passive", "GOMP_SPINCOUNT=0", or "default").
  static std::string CpuIsa();
  static std::string Version();
  static int MaxThreads();
  static std::string WaitPolicy();

 private:
  const OnednnConfig config_;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::cpu_moe

#endif  // MOE_CPU_MOE_ONEDNN_EXPERTS_H_
