// cpu_moe: validation, routing plan and the one dynamic dispatch per Forward call. The kernels
// are in internal/*-inl.h (forward-inl.h and the files it includes), compiled once per Highway
// target by foreach_target.h.
#include "cpu_moe/cpu_moe.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "cpu_moe/internal/forward_plan.h"
#include "cpu_moe/internal/tuning.h"
#include "cpu_moe/onednn_experts.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu_moe/cpu_moe.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "cpu_moe/internal/forward-inl.h"
#include "hwy/highway.h"

#if HWY_ONCE
namespace moe::cpu_moe {

HWY_EXPORT(ForwardImpl);

namespace {

using common::WeightFormat;

size_t RowBytesOf(WeightFormat f, size_t cols) {
  switch (f) {
    case WeightFormat::kBf16:
      return cols * 2;
    case WeightFormat::kFp8Block:
      return cols;
    case WeightFormat::kQ4_0:
      return cols / common::kQ4_0Block * sizeof(common::BlockQ4_0);
    case WeightFormat::kMxfp4:
      return cols / 2 + cols / common::kMxfp4Block;
    case WeightFormat::kNvfp4:
      return cols / 2 + cols / common::kNvfp4Block;
  }
  return 0;
}

size_t MatrixBytes(WeightFormat f, size_t rows, size_t cols) {
  size_t b = rows * RowBytesOf(f, cols);
  if (f == WeightFormat::kFp8Block) {
    const size_t bs = common::kFp8BlockSize;
    b += ((rows + bs - 1) / bs) * ((cols + bs - 1) / bs) * sizeof(float);
  }
  if (f == WeightFormat::kNvfp4) b += sizeof(float);
  return b;
}

// The Highway targets compiled into this translation unit and supported by the CPU. Detected
// once: hwy::SupportedTargets() runs CPUID every time, which in a virtual machine traps to the
// hypervisor (about 60 us per Forward call on a 2-vCPU virtual machine). CPU features do not change
// while the process runs; the env and Options switches are still read on every call.
int64_t CompiledSupported() {
  static const int64_t supported = hwy::SupportedTargets() & HWY_TARGETS;
  return supported;
}

// The dispatch-table index of the best target in `targets` (HWY_TARGETS bit format).
size_t TableIndex(int64_t targets) {
  return hwy::Num0BitsBelowLS1Bit_Nonzero64(static_cast<uint64_t>(
      (HWY_CHOSEN_TARGET_SHIFT(targets) | HWY_CHOSEN_TARGET_MASK_SCALAR) &
      HWY_CHOSEN_TARGET_MASK_TARGETS));
}

int64_t BestTarget(int64_t targets) { return targets & -targets; }

// AMX-TILE and AMX-BF16, and Linux's permission for the tile data state (arch_prctl
// ARCH_REQ_XCOMP_PERM, process-wide, requested once: without it the first tile instruction
// faults). Like the other CPU features, it does not change while the process runs.
bool AmxAvailable() {
#if defined(__x86_64__) && defined(__linux__)
  static const bool ok = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// AVX512_BF16 (vdpbf16ps), which Highway's AVX3_DL target does not require (Ice Lake has AVX3_DL
// without it). Detected once, like CompiledSupported: CPU features do not change while the
// process runs.
bool CpuHasAvx512Bf16() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

// AVX512-FP16 (vfmadd231ph; fp8 banks, Options::fp8_fp16) and GFNI (its e4m3 decode; every
// CPU with AVX512-FP16 has it), likewise detected once.
bool CpuHasAvx512Fp16() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = __builtin_cpu_supports("avx512fp16") && __builtin_cpu_supports("gfni");
  return has;
#else
  return false;
#endif
}

absl::StatusOr<int64_t> ChooseTarget(const std::string& cap) {
  int64_t allowed = CompiledSupported();
  if (!cap.empty()) {
    int64_t cap_bit = 0;
    for (int i = 0; i < 63; ++i) {
      if (cap == hwy::TargetName(int64_t{1} << i)) cap_bit = int64_t{1} << i;
    }
    if (cap_bit == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown Highway target '", cap, "' (MOE_CPU_MAX_TARGET / max_target); "
                       "available here: ", absl::StrJoin(AvailableTargets(), ", ")));
    }
    // Lower bits are better targets: keep the cap and everything below it.
    allowed &= ~(cap_bit - 1);
  }
  if (allowed == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("no compiled target at or below '", cap, "' is supported by this CPU"));
  }
  return BestTarget(allowed);
}

absl::Status ValidateBank(const ExpertBank& b) {
  if (b.num_experts <= 0 || b.hidden <= 0 || b.intermediate <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("expert bank shape E=", b.num_experts, " H=",
                                                   b.hidden, " I=", b.intermediate,
                                                   " must be positive"));
  }
  if (b.hidden % 32 != 0 || b.intermediate % 32 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("H=", b.hidden, " and I=", b.intermediate,
                                                   " must be multiples of 32"));
  }
  if (b.hidden > 16384 || b.intermediate > 16384) {
    return absl::InvalidArgumentError("H and I must be at most 16384");
  }
  if (b.gate_up_weights == nullptr || b.down_weights == nullptr) {
    return absl::InvalidArgumentError("expert bank has null weights");
  }
  const bool four_bit = b.format == WeightFormat::kQ4_0 || b.format == WeightFormat::kMxfp4 ||
                        b.format == WeightFormat::kNvfp4;
  if (b.layout == Layout::kPanels && !four_bit) {
    return absl::InvalidArgumentError(
        absl::StrCat("Layout::kPanels is for q4_0, mxfp4 and nvfp4 banks, not ",
                     std::string(common::WeightFormatName(b.format))));
  }
  if (b.layout != Layout::kRowMajor && b.layout != Layout::kPanels) {
    return absl::InvalidArgumentError("unknown bank layout");
  }
  // Panel banks hold their scales inside the weights.
  const bool needs_scales =
      b.format == WeightFormat::kFp8Block ||
      (b.layout == Layout::kRowMajor &&
       (b.format == WeightFormat::kMxfp4 || b.format == WeightFormat::kNvfp4));
  if (needs_scales && (b.gate_up_scales == nullptr || b.down_scales == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(common::WeightFormatName(b.format)), " bank needs scales"));
  }
  if (b.format == WeightFormat::kNvfp4 &&
      (b.gate_up_global_scales == nullptr || b.down_global_scales == nullptr)) {
    return absl::InvalidArgumentError("nvfp4 bank needs per-expert global scales");
  }
  if (b.global_scale_stride < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("global_scale_stride ", b.global_scale_stride, " must be >= 1"));
  }
  return absl::OkStatus();
}

// The oneDNN part of one Forward call (bf16 experts with many routes; onednn_experts.h).
struct OnednnPart {
  int experts = 0;
  int routes = 0;
  // [T, H] fp32: the oneDNN experts' sum, then the GEMV kernels add theirs.
  common::AlignedBuffer<float> y;
  std::vector<int> token_route_begin;  // all routes' (before the split)
  void* user_y = nullptr;
  DType user_y_dtype = DType::kF32;
  Options gemv_options;
};

// Runs the experts of `plan` with >= options.onednn_min_tokens_per_expert routes through oneDNN
// into part->y and leaves the other routes in `plan`, redirected to accumulate into part->y.
// Does nothing (part->experts == 0) when no expert qualifies.
// The pool is parked meanwhile (OnednnConfig::park_pool): oneDNN computes on its own OpenMP
// threads, and the pool's workers, still spinning after the caller's last ParallelFor, would
// take cores from them.
absl::Status RunOnednnPart(const ExpertBank& bank, const Options& options,
                           internal::ForwardPlan& plan, OnednnExperts* onednn,
                           common::ThreadPool& pool, OnednnPart* part) {
  const int min_tokens = options.onednn_min_tokens_per_expert;
  if (onednn == nullptr || bank.format != WeightFormat::kBf16 || min_tokens <= 0 ||
      plan.route_token.empty()) {
    return absl::OkStatus();
  }
  const int E = bank.num_experts;
  std::vector<int> count(E + 1, 0);
  for (int e : plan.route_expert) ++count[e + 1];
  std::vector<int> experts, group_begin = {0};
  for (int e = 0; e < E; ++e) {
    if (count[e + 1] >= min_tokens) {
      experts.push_back(e);
      group_begin.push_back(group_begin.back() + count[e + 1]);
    }
  }
  const int min_experts =
      options.onednn_min_experts >= 0 ? options.onednn_min_experts : 2 * onednn->threads();
  if (experts.empty() || static_cast<int>(experts.size()) < min_experts) return absl::OkStatus();
  std::vector<int> slot(E, -1), pos(experts.size());
  for (size_t g = 0; g < experts.size(); ++g) {
    slot[experts[g]] = static_cast<int>(g);
    pos[g] = group_begin[g];
  }
  const int n = group_begin.back();
  std::vector<int> route_token(n);
  std::vector<float> route_weight(n);
  internal::ForwardPlan rest = plan;  // keeps the scalars; the route vectors are rebuilt
  rest.route_token.clear();
  rest.route_expert.clear();
  rest.route_weight.clear();
  for (int t = 0; t < plan.num_tokens; ++t) {
    for (int r = plan.token_route_begin[t]; r < plan.token_route_begin[t + 1]; ++r) {
      const int g = slot[plan.route_expert[r]];
      if (g >= 0) {
        route_token[pos[g]] = plan.route_token[r];
        route_weight[pos[g]++] = plan.route_weight[r];
      } else {
        rest.route_token.push_back(plan.route_token[r]);
        rest.route_expert.push_back(plan.route_expert[r]);
        rest.route_weight.push_back(plan.route_weight[r]);
      }
    }
    rest.token_route_begin[t + 1] = static_cast<int>(rest.route_token.size());
  }
  {
    const size_t n = static_cast<size_t>(plan.num_tokens) * bank.hidden;
    absl::StatusOr<common::AlignedBuffer<float>> y = common::AlignedBuffer<float>::Allocate(n);
    if (!y.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "cpu_moe: cannot allocate the oneDNN part's output for ", plan.num_tokens,
          " tokens: ", y.status().message()));
    }
    part->y = std::move(*y);
    std::fill(part->y.begin(), part->y.end(), 0.0f);
  }
  OnednnExpertsWork w;
  w.hidden = bank.hidden;
  w.intermediate = bank.intermediate;
  w.gate_up = static_cast<const uint16_t*>(bank.gate_up_weights);
  w.down = static_cast<const uint16_t*>(bank.down_weights);
  w.x = plan.x;
  w.x_bf16 = plan.x_dtype == DType::kBf16;
  w.swiglu_oai = options.activation == Activation::kSwiGluOai;
  w.swiglu_alpha = options.swiglu_alpha;
  w.swiglu_limit = options.swiglu_limit;
  w.experts = experts;
  w.group_begin = group_begin;
  w.route_token = route_token;
  w.route_weight = route_weight;
  w.y = part->y.data();
  {
    common::ThreadPool::Parking parking(onednn->config().park_pool ? &pool : nullptr);
    RETURN_IF_ERROR(onednn->Run(w));
  }

  part->experts = static_cast<int>(experts.size());
  part->routes = n;
  part->token_route_begin = std::move(plan.token_route_begin);
  part->user_y = plan.y;
  part->user_y_dtype = plan.y_dtype;
  part->gemv_options = options;
  part->gemv_options.accumulate = true;
  plan = std::move(rest);
  plan.options = &part->gemv_options;
  plan.y = part->y.data();
  plan.y_dtype = DType::kF32;
  return absl::OkStatus();
}

// y[t] = (accumulate ? y[t] : 0) + part.y[t] for every token with a route: each row once.
void FinishOnednnPart(const OnednnPart& part, int num_tokens, int H, bool accumulate,
                      common::ThreadPool& pool) {
  constexpr int kRowsPerTask = 8;
  pool.ParallelFor((num_tokens + kRowsPerTask - 1) / kRowsPerTask, [&](uint64_t task, int) {
    const int t1 = std::min(num_tokens, static_cast<int>(task + 1) * kRowsPerTask);
    for (int t = static_cast<int>(task) * kRowsPerTask; t < t1; ++t) {
      if (part.token_route_begin[t + 1] == part.token_route_begin[t]) continue;
      const float* src = part.y.data() + static_cast<size_t>(t) * H;
      if (part.user_y_dtype == DType::kF32) {
        float* yr = static_cast<float*>(part.user_y) + static_cast<size_t>(t) * H;
        for (int j = 0; j < H; ++j) yr[j] = (accumulate ? yr[j] : 0.0f) + src[j];
      } else {
        uint16_t* yr = static_cast<uint16_t*>(part.user_y) + static_cast<size_t>(t) * H;
        for (int j = 0; j < H; ++j) {
          yr[j] = common::FloatToBf16((accumulate ? common::Bf16ToFloat(yr[j]) : 0.0f) + src[j]);
        }
      }
    }
  });
}

bool EnvFlag(const char* name, bool* value) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return false;
  *value = !(std::strcmp(v, "0") == 0 || std::strcmp(v, "false") == 0 ||
             std::strcmp(v, "off") == 0);
  return true;
}

// Sets *value from the variable when it is set and non-empty; a value that is not an integer
// becomes INT_MIN (out of every tuning option's range, so Forward reports it).
void EnvInt(const char* name, int* value) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return;
  int n;
  *value = absl::SimpleAtoi(v, &n) ? n : std::numeric_limits<int>::min();
}

// `tuning` with every kAuto value replaced by the format's own. The values were chosen by sweeps
// and side-by-side runs on the GPU machine's host (cpu_moe/README.md, "Tuning defaults").
// fp8_fp16: fp8's fp16 kernels will run (ForwardPlan::fp8_fp16).
internal::Tuning ResolveTuning(const internal::Tuning& tuning, WeightFormat format, Layout layout,
                               bool fp8_fp16) {
  using internal::Tuning;
  Tuning o = tuning;
  const bool four_bit = format == WeightFormat::kQ4_0 || format == WeightFormat::kNvfp4 ||
                        format == WeightFormat::kMxfp4;
  const bool bf16 = format == WeightFormat::kBf16;
  const bool panels = layout == Layout::kPanels;
  // AMX pays for its tile staging only from a few routes per expert: fp8 (whose vdpbf16ps
  // kernel is the slower) sooner than bf16.
  if (o.amx_min_routes == Tuning::kAuto) o.amx_min_routes = bf16 ? 12 : 5;
  if (o.prefetch_bytes == Tuning::kAuto) {
    o.prefetch_bytes = four_bit ? (panels ? 2048 : 1024) : bf16 ? 4096 : 2048;
  }
  // The L2 stream helps bf16 and panel banks; fp8 gained nothing and the row-major int8 kernels
  // take none.
  if (o.prefetch_l2_bytes == Tuning::kAuto) {
    o.prefetch_l2_bytes = bf16 || (four_bit && panels) ? 8192 : 0;
  }
  // fp8's fp16 kernels prepare each route's activations per item and 128-row block: longer
  // items amortise that.
  if (o.pass1_rows == Tuning::kAuto) {
    o.pass1_rows = four_bit ? (panels ? 256 : 128) : fp8_fp16 ? 128 : 64;
  }
  // The 4-bit formats' rows are short: longer pass-2 items keep their streams going.
  if (o.pass2_rows == Tuning::kAuto) o.pass2_rows = four_bit ? 256 : 128;
  return o;
}

// A prefetch distance: 0 (off) or a multiple of 64 in [64, max].
absl::Status ValidatePrefetch(int bytes, int max, const char* name) {
  if (bytes < 0 || bytes > max || bytes % 64 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, " = ", bytes, " must be 0 (off) or a multiple of 64 in [64, ", max, "]"));
  }
  return absl::OkStatus();
}

// Panel banks: scale bytes per 32-column block of a 16-row panel (see Layout::kPanels).
size_t PanelScaleBytes(WeightFormat f) { return f == WeightFormat::kMxfp4 ? 16 : 32; }

// One matrix [rows, cols] of one expert, row-major -> panels (see Layout::kPanels). Each row's
// block is unpacked to its 32 codes first, then written as the panel's 16 bytes of that row.
void PackMatrixPanels(WeightFormat f, const void* weights, const void* scales, size_t rows,
                      size_t cols, uint8_t* out) {
  const size_t nb = cols / 32, sb = PanelScaleBytes(f);
  const size_t group = 64 / sb;  // blocks per group of codes and their line of scales
  const auto* q4 = static_cast<const common::BlockQ4_0*>(weights);
  const auto* packed = static_cast<const uint8_t*>(weights);
  const auto* sc = static_cast<const uint8_t*>(scales);
  // Offsets of block b's codes and scales within a panel.
  auto codes_at = [&](size_t b) { return b * 256 + (b / group) * group * sb; };
  auto scales_at = [&](size_t b) {
    const size_t g0 = b / group * group, n = std::min(group, nb - g0);
    return codes_at(g0) + n * 256 + (b - g0) * sb;
  };
  for (size_t p = 0; p < rows / 16; ++p) {
    uint8_t* const panel = out + p * nb * (256 + sb);
    for (size_t j = 0; j < 16; ++j) {
      const size_t r = 16 * p + j;
      for (size_t b = 0; b < nb; ++b) {
        uint8_t code[32];
        if (f == WeightFormat::kQ4_0) {
          // q4_0 keeps column c < 16 in the low nibble of qs[c], c >= 16 in the high nibble of
          // qs[c - 16].
          const common::BlockQ4_0& blk = q4[r * nb + b];
          for (size_t i = 0; i < 16; ++i) {
            code[i] = blk.qs[i] & 15;
            code[16 + i] = blk.qs[i] >> 4;
          }
        } else {
          // fp4: column 2i in the low nibble of byte i, 2i + 1 in the high nibble.
          const uint8_t* src = packed + r * (cols / 2) + 16 * b;
          for (size_t i = 0; i < 16; ++i) {
            code[2 * i] = src[i] & 15;
            code[2 * i + 1] = src[i] >> 4;
          }
        }
        uint8_t* dst = panel + codes_at(b) + 4 * j;
        for (size_t v = 0; v < 4; ++v) {
          for (size_t i = 0; i < 4; ++i) {
            dst[64 * v + i] = static_cast<uint8_t>(code[8 * v + i] | (code[8 * v + 4 + i] << 4));
          }
        }
        uint8_t* s = panel + scales_at(b);
        if (f == WeightFormat::kQ4_0) {
          std::memcpy(s + 2 * j, &q4[r * nb + b].d, 2);
        } else if (f == WeightFormat::kMxfp4) {
          s[j] = sc[r * nb + b];
        } else {
          s[j] = sc[r * (cols / 16) + 2 * b];
          s[16 + j] = sc[r * (cols / 16) + 2 * b + 1];
        }
      }
    }
  }
}

absl::Status ValidateTuning(const internal::Tuning& o) {
  using internal::Tuning;
  RETURN_IF_ERROR(ValidatePrefetch(o.prefetch_bytes, Tuning::kMaxPrefetchBytes,
                                   "prefetch_bytes (MOE_CPU_PREFETCH_BYTES)"));
  RETURN_IF_ERROR(ValidatePrefetch(o.prefetch_l2_bytes, Tuning::kMaxPrefetchL2Bytes,
                                   "prefetch_l2_bytes (MOE_CPU_PREFETCH_L2_BYTES)"));
  if (o.pass1_rows < 1 || o.pass1_rows > Tuning::kMaxRowsPerItem) {
    return absl::InvalidArgumentError(absl::StrCat("pass1_rows (MOE_CPU_PASS1_ROWS) = ",
                                                   o.pass1_rows, " must be in [1, ",
                                                   Tuning::kMaxRowsPerItem, "]"));
  }
  if (o.pass2_rows < 2 || o.pass2_rows > Tuning::kMaxRowsPerItem || o.pass2_rows % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("pass2_rows (MOE_CPU_PASS2_ROWS) = ",
                                                   o.pass2_rows, " must be even in [2, ",
                                                   Tuning::kMaxRowsPerItem, "]"));
  }
  if (o.amx_min_routes < 0) {
    return absl::InvalidArgumentError(absl::StrCat("amx_min_routes (MOE_CPU_AMX_MIN_ROUTES) = ",
                                                   o.amx_min_routes,
                                                   " must be >= 0 (0: no expert through AMX) "
                                                   "or -1 (auto)"));
  }
  if (o.row_streams != Tuning::kAuto && o.row_streams != 2 && o.row_streams != 4) {
    return absl::InvalidArgumentError(absl::StrCat("row_streams (MOE_CPU_ROW_STREAMS) = ",
                                                   o.row_streams, " must be 2, 4 or -1 (auto)"));
  }
  return absl::OkStatus();
}

}  // namespace

size_t ExpertBank::GateUpBytesPerExpert() const {
  return MatrixBytes(format, 2 * static_cast<size_t>(intermediate), hidden);
}
size_t ExpertBank::DownBytesPerExpert() const {
  return MatrixBytes(format, hidden, intermediate);
}

absl::StatusOr<ExpertBank> BankFromView(const common::ExpertLayerView& v) {
  ExpertBank b;
  b.format = v.format;
  b.num_experts = v.num_experts;
  b.hidden = v.hidden;
  b.intermediate = v.intermediate;
  b.layout = v.layout == common::ExpertLayout::kPanels ? Layout::kPanels : Layout::kRowMajor;
  if (v.hidden <= 0 || v.intermediate <= 0 || v.num_experts <= 0) RETURN_IF_ERROR(ValidateBank(b));
  const WeightFormat f = v.format;
  const size_t H = v.hidden, I = v.intermediate;
  const bool split_scales = b.layout == Layout::kRowMajor &&
                            (f == WeightFormat::kMxfp4 || f == WeightFormat::kNvfp4);
  // Bytes per expert of a matrix's codes (scales included where they live inside) and of its
  // separate scales.
  auto codes = [&](size_t rows, size_t cols) {
    return split_scales ? rows * cols / 2 : rows * RowBytesOf(f, cols);
  };
  auto scales = [&](size_t rows, size_t cols) -> size_t {
    if (f == WeightFormat::kFp8Block) {
      const size_t bs = common::kFp8BlockSize;
      return ((rows + bs - 1) / bs) * ((cols + bs - 1) / bs) * sizeof(float);
    }
    if (split_scales) {
      return rows * cols / (f == WeightFormat::kMxfp4 ? common::kMxfp4Block : common::kNvfp4Block);
    }
    return 0;
  };
  // cpu_moe reads codes and scales of consecutive experts back to back: their arrays must be
  // dense. Global scales may have any pitch that holds whole floats.
  auto dense = [&](const common::ExpertArray& a, size_t bytes, const char* name,
                   const void** out) -> absl::Status {
    if (bytes == 0) return absl::OkStatus();
    if (a.data != nullptr && a.pitch != bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "expert view: ", name, " has a pitch of ", a.pitch, " bytes; cpu_moe reads it in place "
          "only when dense (", bytes, " bytes per expert)"));
    }
    *out = a.data;
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(dense(v.gate_up, codes(2 * I, H), "gate_up", &b.gate_up_weights));
  RETURN_IF_ERROR(dense(v.down, codes(H, I), "down", &b.down_weights));
  RETURN_IF_ERROR(dense(v.gate_up_scales, scales(2 * I, H), "gate_up_scales", &b.gate_up_scales));
  RETURN_IF_ERROR(dense(v.down_scales, scales(H, I), "down_scales", &b.down_scales));
  if (f == WeightFormat::kNvfp4) {
    const common::ExpertArray& g = v.gate_up_global_scale;
    const common::ExpertArray& d = v.down_global_scale;
    if (g.pitch != d.pitch || g.pitch == 0 || g.pitch % sizeof(float) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "expert view: nvfp4 global scales need one equal pitch, a multiple of 4 bytes (got ",
          g.pitch, " and ", d.pitch, ")"));
    }
    b.gate_up_global_scales = static_cast<const float*>(g.data);
    b.down_global_scales = static_cast<const float*>(d.data);
    b.global_scale_stride = static_cast<int>(g.pitch / sizeof(float));
    const common::ExpertArray& u = v.up_global_scale;
    if (u.data != nullptr) {
      if (u.pitch != g.pitch) {
        return absl::InvalidArgumentError(absl::StrCat(
            "expert view: nvfp4 up_global_scale has a pitch of ", u.pitch,
            " bytes, the other global scales ", g.pitch));
      }
      b.up_global_scales = static_cast<const float*>(u.data);
    }
  }
  RETURN_IF_ERROR(ValidateBank(b));
  return b;
}

absl::StatusOr<std::unique_ptr<PanelBank>> PackPanels(const ExpertBank& row_major,
                                                      common::ThreadPool* pool) {
  RETURN_IF_ERROR(ValidateBank(row_major));
  const WeightFormat f = row_major.format;
  if (f != WeightFormat::kQ4_0 && f != WeightFormat::kMxfp4 && f != WeightFormat::kNvfp4) {
    return absl::InvalidArgumentError(
        absl::StrCat("PackPanels takes q4_0, mxfp4 and nvfp4 banks, not ",
                     std::string(common::WeightFormatName(f))));
  }
  if (row_major.layout != Layout::kRowMajor) {
    return absl::InvalidArgumentError("PackPanels: the bank is already in panels");
  }
  const size_t E = row_major.num_experts, H = row_major.hidden, I = row_major.intermediate;
  // Bytes per expert without nvfp4's global scale (kept apart).
  const size_t gu_bytes = 2 * I * RowBytesOf(f, H), down_bytes = H * RowBytesOf(f, I);
  auto out = std::make_unique<PanelBank>();
  ASSIGN_OR_RETURN(out->gate_up, common::AlignedBuffer<uint8_t>::AllocateHugePages(E * gu_bytes));
  ASSIGN_OR_RETURN(out->down, common::AlignedBuffer<uint8_t>::AllocateHugePages(E * down_bytes));
  // Row-major strides per expert: packed codes (q4_0: its blocks) and scale bytes.
  const size_t scale_block = f == WeightFormat::kMxfp4 ? common::kMxfp4Block : common::kNvfp4Block;
  const size_t gu_codes = 2 * I * (f == WeightFormat::kQ4_0 ? RowBytesOf(f, H) : H / 2);
  const size_t down_codes = H * (f == WeightFormat::kQ4_0 ? RowBytesOf(f, I) : I / 2);
  const size_t gu_scales = 2 * I * (H / scale_block), down_scales = H * (I / scale_block);
  auto pack_expert = [&](size_t e) {
    const bool q4 = f == WeightFormat::kQ4_0;
    PackMatrixPanels(
        f, static_cast<const uint8_t*>(row_major.gate_up_weights) + e * gu_codes,
        q4 ? nullptr : static_cast<const uint8_t*>(row_major.gate_up_scales) + e * gu_scales,
        2 * I, H, out->gate_up.data() + e * gu_bytes);
    PackMatrixPanels(
        f, static_cast<const uint8_t*>(row_major.down_weights) + e * down_codes,
        q4 ? nullptr : static_cast<const uint8_t*>(row_major.down_scales) + e * down_scales, H, I,
        out->down.data() + e * down_bytes);
  };
  if (pool != nullptr) {
    pool->ParallelFor(E, [&](uint64_t e, int) { pack_expert(e); });
  } else {
    for (size_t e = 0; e < E; ++e) pack_expert(e);
  }
  ExpertBank& b = out->bank;
  b = row_major;
  b.layout = Layout::kPanels;
  b.gate_up_weights = out->gate_up.data();
  b.down_weights = out->down.data();
  b.gate_up_scales = nullptr;
  b.down_scales = nullptr;
  if (f == WeightFormat::kNvfp4) {
    const size_t stride = static_cast<size_t>(row_major.global_scale_stride);
    for (size_t e = 0; e < static_cast<size_t>(E); ++e) {
      out->gate_up_global_scales.push_back(row_major.gate_up_global_scales[e * stride]);
      out->down_global_scales.push_back(row_major.down_global_scales[e * stride]);
      if (row_major.up_global_scales != nullptr) {
        out->up_global_scales.push_back(row_major.up_global_scales[e * stride]);
      }
    }
    b.gate_up_global_scales = out->gate_up_global_scales.data();
    b.down_global_scales = out->down_global_scales.data();
    b.up_global_scales =
        row_major.up_global_scales != nullptr ? out->up_global_scales.data() : nullptr;
    b.global_scale_stride = 1;
  }
  return out;
}

Options Options::FromEnv() {
  Options o;
  EnvFlag("MOE_CPU_DEDUP", &o.dedup);
  EnvFlag("MOE_CPU_DEBUG", &o.debug);
  EnvFlag("MOE_CPU_BF16_DOT", &o.bf16_dot_product);
  if (const char* t = std::getenv("MOE_CPU_MAX_TARGET"); t != nullptr) o.max_target = t;
  if (const char* v = std::getenv("MOE_CPU_ONEDNN_MIN_TOKENS"); v != nullptr && *v != '\0') {
    o.onednn_min_tokens_per_expert = std::max(0, std::atoi(v));
  }
  return o;
}

internal::Tuning internal::Tuning::FromEnv() {
  Tuning o;
  EnvFlag("MOE_CPU_OVERLAP", &o.overlap_passes);
  EnvFlag("MOE_CPU_BLOCK_LANE", &o.block_lane);
  EnvFlag("MOE_CPU_AMX", &o.amx);
  EnvInt("MOE_CPU_AMX_MIN_ROUTES", &o.amx_min_routes);
  EnvFlag("MOE_CPU_FP8_FP16", &o.fp8_fp16);
  EnvInt("MOE_CPU_PREFETCH_BYTES", &o.prefetch_bytes);
  EnvInt("MOE_CPU_PREFETCH_L2_BYTES", &o.prefetch_l2_bytes);
  EnvInt("MOE_CPU_PASS1_ROWS", &o.pass1_rows);
  EnvInt("MOE_CPU_PASS2_ROWS", &o.pass2_rows);
  EnvInt("MOE_CPU_ROW_STREAMS", &o.row_streams);
  return o;
}

std::vector<std::string> AvailableTargets() {
  std::vector<std::string> names;
  for (int64_t t = CompiledSupported(); t != 0; t &= t - 1) {
    names.emplace_back(hwy::TargetName(BestTarget(t)));
  }
  return names;
}

absl::Status internal::Forward(const ExpertBank& bank, int num_tokens, int top_k,
                               absl::Span<const int32_t> expert_ids,
                               absl::Span<const float> weights, const void* x, DType x_dtype,
                               void* y, DType y_dtype, const Options& options,
                               const Tuning& tuning, common::ThreadPool& pool,
                               ForwardStats* stats, OnednnExperts* onednn_experts) {
  RETURN_IF_ERROR(ValidateBank(bank));
  ASSIGN_OR_RETURN(const int64_t target, ChooseTarget(options.max_target));
  const bool bf16_dot_cpu = options.bf16_dot_product && target == HWY_AVX3_DL && CpuHasAvx512Bf16();
  const bool amx = bf16_dot_cpu && tuning.amx && AmxAvailable() &&
                   (bank.format == WeightFormat::kFp8Block || bank.format == WeightFormat::kBf16);
  const bool fp8_fp16 = bf16_dot_cpu && bank.format == WeightFormat::kFp8Block &&
                        tuning.fp8_fp16 && CpuHasAvx512Fp16();
  const internal::Tuning resolved = ResolveTuning(tuning, bank.format, bank.layout, fp8_fp16);
  RETURN_IF_ERROR(ValidateTuning(resolved));
  if (num_tokens < 0 || top_k <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens=", num_tokens, " top_k=", top_k, " out of range"));
  }
  const size_t routes_total = static_cast<size_t>(num_tokens) * top_k;
  if (expert_ids.size() != routes_total || weights.size() != routes_total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert_ids (", expert_ids.size(), ") and weights (", weights.size(),
        ") must have num_tokens * top_k = ", routes_total, " entries"));
  }
  if (num_tokens > 0 && (x == nullptr || y == nullptr)) {
    return absl::InvalidArgumentError("x and y must not be null");
  }

  internal::ForwardPlan plan;
  plan.bank = &bank;
  plan.options = &options;
  plan.tuning = &resolved;
  plan.pool = &pool;
  plan.num_tokens = num_tokens;
  plan.top_k = top_k;
  plan.x = x;
  plan.x_dtype = x_dtype;
  plan.y = y;
  plan.y_dtype = y_dtype;
  plan.bf16_dot_product = bf16_dot_cpu && (bank.format == WeightFormat::kBf16 ||
                                           bank.format == WeightFormat::kFp8Block);
  plan.amx = amx && resolved.amx_min_routes > 0;
  plan.fp8_fp16 = fp8_fp16;
  plan.amx_min_routes = resolved.amx_min_routes;
  // fp8's fp16 kernels, with both prefetch distances left at kAuto: experts with one or two
  // routes read 4096 bytes ahead into L1 and 8192 into L2 (bf16's distances), the others 2048 and
  // none: an expert with few routes has little dot-product work per byte to hide its reads
  // behind (README, "Tuning defaults").
  if (fp8_fp16 && tuning.prefetch_bytes == internal::Tuning::kAuto &&
      tuning.prefetch_l2_bytes == internal::Tuning::kAuto) {
    plan.few_routes_max = 2;
    plan.few_routes_prefetch_l1 = 4096;
    plan.few_routes_prefetch_l2 = 8192;
  }
  plan.token_route_begin.assign(num_tokens + 1, 0);
  plan.route_token.reserve(routes_total);
  plan.route_expert.reserve(routes_total);
  plan.route_weight.reserve(routes_total);
  for (int t = 0; t < num_tokens; ++t) {
    for (int j = 0; j < top_k; ++j) {
      const int32_t e = expert_ids[t * top_k + j];
      if (e < 0) continue;  // padding
      if (e >= bank.num_experts) {
        return absl::InvalidArgumentError(absl::StrCat("expert id ", e, " at [", t, ", ", j,
                                                       "] is >= num_experts ", bank.num_experts));
      }
      plan.route_token.push_back(t);
      plan.route_expert.push_back(e);
      plan.route_weight.push_back(weights[t * top_k + j]);
    }
    plan.token_route_begin[t + 1] = static_cast<int>(plan.route_token.size());
  }
  // Prefill: experts with many routes go through oneDNN first; the rest stay in `plan`.
  OnednnPart onednn;
  RETURN_IF_ERROR(RunOnednnPart(bank, options, plan, onednn_experts, pool, &onednn));
  const int num_routes = static_cast<int>(plan.route_token.size());

  // Counting sort of routes by expert (stable: token order within an expert).
  std::vector<int> count(bank.num_experts + 1, 0);
  for (int e : plan.route_expert) ++count[e + 1];
  int unique = 0;
  for (int e = 0; e < bank.num_experts; ++e) unique += count[e + 1] > 0;
  // Dedup is inert when nothing is shared: the plain split is used as is.
  const bool dedup = options.dedup && unique < num_routes;
  if (dedup) {
    for (int e = 0; e < bank.num_experts; ++e) count[e + 1] += count[e];
    plan.group_routes.resize(num_routes);
    plan.groups.reserve(unique);
    for (int e = 0; e < bank.num_experts; ++e) {
      if (count[e + 1] > count[e]) plan.groups.push_back({e, count[e], count[e + 1]});
    }
    // count[e] becomes the next free position of expert e's routes.
    for (int r = 0; r < num_routes; ++r) plan.group_routes[count[plan.route_expert[r]]++] = r;
  } else {
    plan.group_routes.resize(num_routes);
    plan.groups.reserve(num_routes);
    for (int r = 0; r < num_routes; ++r) {
      plan.group_routes[r] = r;
      plan.groups.push_back({plan.route_expert[r], r, r + 1});
    }
  }

  const char* target_name = hwy::TargetName(target);
  const int all_routes = num_routes + onednn.routes;
  const int all_unique = unique + onednn.experts;
  const bool bf16_dot_ran = plan.bf16_dot_product && num_routes > 0;
  bool amx_ran = false;
  bool fp16_ran = false;
  for (const internal::ExpertGroup& g : plan.groups) {
    amx_ran |= plan.UsesAmx(g.end - g.begin);
    fp16_ran |= plan.fp8_fp16 && !plan.UsesAmx(g.end - g.begin);
  }
  if (stats != nullptr) {
    stats->routes = all_routes;
    stats->unique_experts = all_unique;
    stats->reuse = all_unique > 0 ? static_cast<double>(all_routes) / all_unique : 0.0;
    stats->target = target_name;
    stats->onednn_experts = onednn.experts;
    stats->bf16_dot_product = bf16_dot_ran;
    stats->amx = amx_ran;
    stats->fp8_fp16 = fp16_ran;
  }
  if (options.debug) {
    std::fprintf(stderr,
                 "cpu_moe: T=%d routes=%d unique_experts=%d reuse=%.3f dedup=%d target=%s "
                 "bf16_dot=%d amx=%d fp8_fp16=%d onednn_experts=%d onednn_routes=%d\n",
                 num_tokens, all_routes, all_unique,
                 all_unique > 0 ? static_cast<double>(all_routes) / all_unique : 0.0,
                 dedup ? 1 : 0, target_name, bf16_dot_ran ? 1 : 0, amx_ran ? 1 : 0,
                 fp16_ran ? 1 : 0, onednn.experts,
                 onednn.routes);
  }

  // One dispatch per call, at the chosen (possibly capped) target.
  if (num_routes > 0) HWY_DISPATCH_TABLE(ForwardImpl)[TableIndex(target)](plan);
  if (plan.scratch_bytes_missing > 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cpu_moe: cannot allocate ", plan.scratch_bytes_missing,
                     " bytes of scratch for ", num_tokens, " tokens (", num_routes, " routes)"));
  }
  if (stats != nullptr) {
    stats->prep_x_seconds = plan.phase_seconds[0];
    stats->pass1_seconds = plan.phase_seconds[1];
    stats->prep_h_seconds = plan.phase_seconds[2];
    stats->pass2_seconds = plan.phase_seconds[3];
  }
  if (onednn.experts > 0) {
    FinishOnednnPart(onednn, num_tokens, bank.hidden, options.accumulate, pool);
  }
  return absl::OkStatus();
}

absl::Status internal::Forward(const ExpertBank& bank, int num_tokens, int top_k,
                               absl::Span<const int32_t> expert_ids,
                               absl::Span<const float> weights, absl::Span<const float> x,
                               absl::Span<float> y, const Options& options, const Tuning& tuning,
                               common::ThreadPool& pool, ForwardStats* stats,
                               OnednnExperts* onednn) {
  const size_t n = static_cast<size_t>(std::max(0, num_tokens)) * std::max(0, bank.hidden);
  if (x.size() != n || y.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("x (", x.size(), ") and y (", y.size(),
                                                   ") must have num_tokens * H = ", n,
                                                   " floats"));
  }
  return Forward(bank, num_tokens, top_k, expert_ids, weights, x.data(), DType::kF32, y.data(),
                 DType::kF32, options, tuning, pool, stats, onednn);
}

absl::Status Forward(const ExpertBank& bank, int num_tokens, int top_k,
                     absl::Span<const int32_t> expert_ids, absl::Span<const float> weights,
                     const void* x, DType x_dtype, void* y, DType y_dtype, const Options& options,
                     common::ThreadPool& pool, ForwardStats* stats, OnednnExperts* onednn) {
  return internal::Forward(bank, num_tokens, top_k, expert_ids, weights, x, x_dtype, y, y_dtype,
                           options, internal::Tuning(), pool, stats, onednn);
}

absl::Status Forward(const ExpertBank& bank, int num_tokens, int top_k,
                     absl::Span<const int32_t> expert_ids, absl::Span<const float> weights,
                     absl::Span<const float> x, absl::Span<float> y, const Options& options,
                     common::ThreadPool& pool, ForwardStats* stats, OnednnExperts* onednn) {
  return internal::Forward(bank, num_tokens, top_k, expert_ids, weights, x, y, options,
                           internal::Tuning(), pool, stats, onednn);
}

}  // namespace moe::cpu_moe
#endif  // HWY_ONCE
