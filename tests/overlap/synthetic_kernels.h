// The kernels of the synthetic MoE decode stack (tests and benchmark only): embedding, top-k
// routing, the shared expert's SiLU gate, the checksum consumer that stands in for the routed
// expert GEMM, and the residual combine. bf16 values travel as their uint16_t bit patterns.
// Every launch is enqueued on the given stream and returns launch errors only; no allocation and
// no synchronisation, so all of them can be captured. Plain C++ header; without CUDA every launch
// returns Unavailable.
#ifndef MOE_TESTS_OVERLAP_SYNTHETIC_KERNELS_H_
#define MOE_TESTS_OVERLAP_SYNTHETIC_KERNELS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "moe_cache/gpu/gather_kernels.h"

struct CUstream_st;

namespace moe::overlap_test {

// Largest routed experts per layer and top-k the routing kernel handles.
inline constexpr int kMaxRoutedExperts = 1024;
inline constexpr int kMaxTopK = 16;
// Blocks per route of the checksum consumer (partial sums, added in fixed order by Combine).
inline constexpr int kChecksumSplit = 8;

// x: [T, H] bf16 out; h: [T, H] f32 out (residual); tokens: [T]; table: [vocab, H] bf16.
absl::Status LaunchEmbed(const int32_t* tokens, const uint16_t* table, int vocab, int tokens_n,
                         int hidden, uint16_t* x, float* h, CUstream_st* stream);

// logits: [T, E] f32. ids: [T, k] out (lowest index wins ties); weights: [T, k] out, softmax of
// the chosen logits.
absl::Status LaunchTopK(const float* logits, int tokens_n, int experts, int k, int32_t* ids,
                        float* weights, CUstream_st* stream);

// gate_up: [T, 2*I] bf16 (gate | up); act: [T, I] bf16 out = silu(gate) * up.
absl::Status LaunchSiluMul(const uint16_t* gate_up, int tokens_n, int inter, uint16_t* act,
                           CUstream_st* stream);

// The routed GEMM's stand-in: for route r (of T*k), reads every bank of slot slot_ids[r] and
// writes kChecksumSplit partial sums of word_i * (2*i + 1) (mod 2^32, i the word index within its
// bank) to partials[r * kChecksumSplit + s]. Slot -1 gives zeros. `desc` gives the banks' device
// bases and pitches (its dst side is the slot pool).
absl::Status LaunchChecksum(const moe_cache::GatherDescriptor& desc, const int32_t* slot_ids,
                            int routes, uint32_t* partials, CUstream_st* stream);

// checksums: [T*k] out (partials added in order); h: [T, H] f32 in/out:
//   h = 0.5 * h + shared + sum_j weights[t, j] * Mix(checksum[t, j], i);  x = bf16(h).
// shared: [T, H] bf16.
absl::Status LaunchCombine(const uint32_t* partials, const float* weights,
                           const uint16_t* shared, int tokens_n, int k, int hidden,
                           uint32_t* checksums, float* h, uint16_t* x, CUstream_st* stream);

// The consumer's checksum of one bank row computed on the host (the reference): sum over 32-bit
// words w_i of w_i * (2*i + 1) mod 2^32. `bytes` is a multiple of 4.
uint32_t HostChecksum(const uint8_t* row, uint64_t bytes);

}  // namespace moe::overlap_test

#endif  // MOE_TESTS_OVERLAP_SYNTHETIC_KERNELS_H_
