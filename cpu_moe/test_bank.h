// Test and benchmark helpers for cpu_moe (testonly): an expert bank that owns its storage, built
// by quantizing random float weights with //common:formats, and the float64 scalar reference
// forward that works from the dequantized weights.
#ifndef MOE_CPU_MOE_TEST_BANK_H_
#define MOE_CPU_MOE_TEST_BANK_H_

#include <cstdint>
#include <random>
#include <vector>

#include "cpu_moe/cpu_moe.h"
#include "cpu_moe/internal/tuning.h"

namespace moe::cpu_moe::testing {

// Owns the bytes `bank` points at. Not copyable (bank holds pointers into it); movable.
struct HostBank {
  ExpertBank bank;
  std::vector<uint8_t> gate_up_w, gate_up_s, down_w, down_s;
  std::vector<float> gate_up_g, down_g;
  // Dequantized weights, [E, 2I, H] and [E, H, I] (only when requested).
  std::vector<float> gate_up_f, down_f;

  HostBank() = default;
  HostBank(const HostBank&) = delete;
  HostBank& operator=(const HostBank&) = delete;
  HostBank(HostBank&&) = default;
  HostBank& operator=(HostBank&&) = default;
};

// Routes of T tokens, k distinct experts each, drawn with probability proportional to
// (rank + 1)^-skew_exponent (0: uniform), with routing weights uniform in [0.05, 1).
struct Routing {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};
Routing MakeRouting(int T, int E, int k, double skew_exponent, std::mt19937_64& rng);

// ||y - ref|| / ||ref|| (Frobenius norms).
double RelFrobenius(const std::vector<float>& y, const std::vector<double>& ref);

// Random weights (gate_up ~ U(-a, a) with a = sqrt(3 / H), down likewise with I), quantized to
// `format`; keeps the dequantized copies when `keep_float`.
HostBank MakeRandomBank(common::WeightFormat format, int num_experts, int hidden,
                        int intermediate, uint64_t seed, bool keep_float = true);

// The activation quantization the kernels apply for quantized formats (int8 per 32-block,
// scale amax / 127, round to nearest even), returning the dequantized values; `step` gets each
// element's block scale.
void EmulateActQuant(const float* x, size_t n, double* out, double* step);

// The activation rounding of the bf16 dot product path (Options::bf16_dot_product): each element
// rounded to bf16 (common::FloatToBf16), bf16 denormals as zero (vdpbf16ps's DAZ); `step` gets
// one bf16 ulp of each element (what a rounding flip moves it by).
void EmulateActBf16(const float* x, size_t n, double* out, double* step);

// float64 reference of Forward on bank.gate_up_f / down_f (must be kept).
// emulate_act_quant: quantize x and h as the kernels do (so only accumulation order separates
// kernel and reference): int8 for quantized formats (EmulateActQuant); for bf16 banks, bf16
// rounding (EmulateActBf16) when options.bf16_dot_product, which the caller sets to what the run
// it compares did (ForwardStats::bf16_dot_product). Fills y [T, H] (rows without routes 0),
// abs_scale [T, H] = sum over routes |w| sum_i |D_ji h_i| (the magnitude the rounding acts on) and
// flip [T, H] = sum over routes |w| max_i |D_ji| * step(h_i) (what one rounding flip of h can move
// the output by; 0 unless emulating).
// tuning.fp8_fp16 (fp8 banks; the caller sets it, tuning.amx and options.dedup to what the
// run did, ForwardStats::fp8_fp16 and ::amx): the fp16 kernels emulated instead, their
// activation scaling and rounding with the same float operations and their fp16 sums lane by
// lane, so that only the fp32 summation of the 16 folded lanes differs; the experts that went
// through AMX (the kernels' rule: at least tuning.amx_min_routes routes in the call, kAuto = 5)
// with bf16-rounded activations. flip then holds what one fp16 rounding flip of h (the kernel's
// fp32 h against this one) can move each output by: the flipped product and one ulp of the
// lane's later partial sums.
void ReferenceForward(const HostBank& hb, int num_tokens, int top_k,
                      const std::vector<int32_t>& ids, const std::vector<float>& weights,
                      const std::vector<float>& x, const Options& options,
                      bool emulate_act_quant, std::vector<double>* y,
                      std::vector<double>* abs_scale, std::vector<double>* flip,
                      const internal::Tuning& tuning = internal::Tuning());

}  // namespace moe::cpu_moe::testing

#endif  // MOE_CPU_MOE_TEST_BANK_H_
