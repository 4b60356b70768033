#include "engine/random_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace moe::engine {
namespace {

using common::WeightFormat;

// Uniform in [-a, a], from a small fast generator (the values only need to be varied).
class Fill {
 public:
  explicit Fill(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  bool fast = false;  // dense tensors repeat a tile of random values (see MakeTensor)
  float Next(float a) {
    state_ ^= state_ << 13;
    state_ ^= state_ >> 7;
    state_ ^= state_ << 17;
    return (static_cast<float>(state_ >> 40) / 16777216.0f * 2.0f - 1.0f) * a;
  }

 private:
  uint64_t state_;
};

// With fast_fill, a period of kTile random values repeats over the tensor (the values only need
// to look random to the kernels, and a full-size model has billions of them).
constexpr size_t kTile = (1 << 16) + 7;

Tensor MakeTensor(DType dtype, int64_t rows, int64_t cols, Fill& fill, float a, float center) {
  Tensor t;
  t.dtype = dtype;
  t.rows = rows;
  t.cols = cols;
  const size_t n = static_cast<size_t>(rows * cols);
  const size_t elem = dtype == DType::kF32 ? 4 : 2;
  t.data = common::AlignedBuffer<uint8_t>(n * elem);
  const size_t first = fill.fast ? std::min(n, kTile) : n;
  for (size_t i = 0; i < first; ++i) {
    const float v = center + fill.Next(a);
    if (dtype == DType::kF32) {
      t.mutable_f32()[i] = v;
    } else {
      t.mutable_bf16()[i] = common::FloatToBf16(v);
    }
  }
  // fast: the first tile, copied over the rest.
  for (size_t i = first; i < n; i += first) {
    std::memcpy(t.data.data() + i * elem, t.data.data(), std::min(first, n - i) * elem);
  }
  return t;
}

float InvSqrt(int64_t n) { return 1.0f / std::sqrt(static_cast<float>(n)); }

// The Gated DeltaNet's weights of one linear-attention layer (shapes: LayerWeights).
void MakeLinearAttention(const ModelConfig& c, DType dd, Fill& fill, LayerWeights& lw) {
  const LinearAttentionConfig& la = c.linear;
  const int H = c.hidden_size, C = la.conv_dim(), Vd = la.value_dim(), nv = la.num_value_heads;
  const float in_h = InvSqrt(H);
  lw.in_proj_qkv = MakeTensor(dd, C, H, fill, in_h, 0.0f);
  lw.in_proj_z = MakeTensor(dd, Vd, H, fill, in_h, 0.0f);
  lw.in_proj_b = MakeTensor(dd, nv, H, fill, in_h, 0.0f);
  lw.in_proj_a = MakeTensor(dd, nv, H, fill, in_h, 0.0f);
  // Tap-major [kernel, channels], as the loader holds it.
  lw.conv1d = MakeTensor(DType::kF32, la.conv_kernel, C, fill, InvSqrt(la.conv_kernel), 0.0f);
  lw.dt_bias = MakeTensor(DType::kF32, 1, nv, fill, 0.5f, 0.0f);
  // A = exp(A_log) in [1, 16] (transformers draws A uniformly in (0, 16)): decays
  // exp(-A softplus(a + dt_bias)) between fast and moderate.
  lw.a_log = MakeTensor(DType::kF32, 1, nv, fill, 7.5f, 8.5f);
  for (int h = 0; h < nv; ++h) lw.a_log.mutable_f32()[h] = std::log(lw.a_log.f32()[h]);
  lw.linear_norm = MakeTensor(DType::kF32, 1, la.value_head_dim, fill, 0.2f, 1.0f);
  lw.out_proj = MakeTensor(dd, H, Vd, fill, InvSqrt(Vd), 0.0f);
}

// Experts e >= distinct become copies of expert e % distinct (`per_expert` elements each).
template <typename T>
void Replicate(T* data, size_t per_expert, int num_experts, int distinct,
               common::ThreadPool* pool) {
  auto body = [&](uint64_t e, int) {
    if (static_cast<int>(e) < distinct) return;
    std::memcpy(data + e * per_expert, data + (e % distinct) * per_expert,
                per_expert * sizeof(T));
  };
  if (pool != nullptr) {
    pool->ParallelFor(num_experts, body);
  } else {
    for (int e = 0; e < num_experts; ++e) body(e, 0);
  }
}

// One MoE layer's experts: the distinct experts' float draws (gate_up [d, 2I, H], down
// [d, H, I]) in, the bank and its values (when wanted) out.
struct ExpertDraws {
  int num_experts, distinct, hidden, intermediate;
  const std::vector<float>& gu;
  const std::vector<float>& dn;
  bool want_values;
  common::ThreadPool* pool;
  size_t gu_n() const { return static_cast<size_t>(2) * intermediate * hidden; }
  size_t dn_n() const { return static_cast<size_t>(hidden) * intermediate; }
};

cpu_moe::ExpertBank BankShape(WeightFormat f, const ExpertDraws& d, int num_experts) {
  cpu_moe::ExpertBank bank;
  bank.format = f;
  bank.num_experts = num_experts;
  bank.hidden = d.hidden;
  bank.intermediate = d.intermediate;
  return bank;
}

absl::Status AddBf16Layer(const ExpertDraws& d, RandomModel& m, std::vector<float>& gu_vals,
                          std::vector<float>& dn_vals) {
  const int E = d.num_experts;
  // Huge pages: a full-size bank is gigabytes, and 4 KiB page faults would dominate making it.
  ASSIGN_OR_RETURN(auto gub, common::AlignedBuffer<uint16_t>::AllocateHugePages(E * d.gu_n()));
  ASSIGN_OR_RETURN(auto dnb, common::AlignedBuffer<uint16_t>::AllocateHugePages(E * d.dn_n()));
  for (size_t i = 0; i < d.distinct * d.gu_n(); ++i) gub.data()[i] = common::FloatToBf16(d.gu[i]);
  for (size_t i = 0; i < d.distinct * d.dn_n(); ++i) dnb.data()[i] = common::FloatToBf16(d.dn[i]);
  Replicate(gub.data(), d.gu_n(), E, d.distinct, d.pool);
  Replicate(dnb.data(), d.dn_n(), E, d.distinct, d.pool);
  if (d.want_values) {
    for (size_t i = 0; i < gu_vals.size(); ++i) gu_vals[i] = common::Bf16ToFloat(gub.data()[i]);
    for (size_t i = 0; i < dn_vals.size(); ++i) dn_vals[i] = common::Bf16ToFloat(dnb.data()[i]);
  }
  cpu_moe::ExpertBank bank = BankShape(WeightFormat::kBf16, d, E);
  bank.gate_up_weights = gub.data();
  bank.down_weights = dnb.data();
  m.gate_up_bf16.push_back(std::move(gub));
  m.down_bf16.push_back(std::move(dnb));
  m.banks.push_back(bank);
  return absl::OkStatus();
}

// fp8_block as the loader makes it from a non-FP8 checkpoint: each expert's stacked [gate; up]
// and its down quantized with 128x128 block scales (common::QuantizeFp8Block), row-major.
absl::Status AddFp8Layer(const ExpertDraws& d, RandomModel& m, std::vector<float>& gu_vals,
                         std::vector<float>& dn_vals) {
  const int E = d.num_experts, H = d.hidden, I = d.intermediate;
  const int64_t bs = common::kFp8BlockSize;
  const size_t gu_s = ((2 * I + bs - 1) / bs) * ((H + bs - 1) / bs);
  const size_t dn_s = ((H + bs - 1) / bs) * ((I + bs - 1) / bs);
  ASSIGN_OR_RETURN(auto gub, common::AlignedBuffer<uint8_t>::AllocateHugePages(E * d.gu_n()));
  ASSIGN_OR_RETURN(auto dnb, common::AlignedBuffer<uint8_t>::AllocateHugePages(E * d.dn_n()));
  ASSIGN_OR_RETURN(auto gus, common::AlignedBuffer<float>::Allocate(E * gu_s));
  ASSIGN_OR_RETURN(auto dns, common::AlignedBuffer<float>::Allocate(E * dn_s));
  for (int e = 0; e < d.distinct; ++e) {
    common::QuantizeFp8Block(d.gu.data() + e * d.gu_n(), 2 * I, H, gub.data() + e * d.gu_n(),
                             gus.data() + e * gu_s);
    common::QuantizeFp8Block(d.dn.data() + e * d.dn_n(), H, I, dnb.data() + e * d.dn_n(),
                             dns.data() + e * dn_s);
  }
  Replicate(gub.data(), d.gu_n(), E, d.distinct, d.pool);
  Replicate(dnb.data(), d.dn_n(), E, d.distinct, d.pool);
  Replicate(gus.data(), gu_s, E, d.distinct, d.pool);
  Replicate(dns.data(), dn_s, E, d.distinct, d.pool);
  if (d.want_values) {
    for (int e = 0; e < E; ++e) {
      common::DequantizeFp8Block(gub.data() + e * d.gu_n(), gus.data() + e * gu_s, 2 * I, H,
                                 gu_vals.data() + e * d.gu_n());
      common::DequantizeFp8Block(dnb.data() + e * d.dn_n(), dns.data() + e * dn_s, H, I,
                                 dn_vals.data() + e * d.dn_n());
    }
  }
  cpu_moe::ExpertBank bank = BankShape(WeightFormat::kFp8Block, d, E);
  bank.gate_up_weights = gub.data();
  bank.gate_up_scales = gus.data();
  bank.down_weights = dnb.data();
  bank.down_scales = dns.data();
  m.gate_up_fp8.push_back(std::move(gub));
  m.down_fp8.push_back(std::move(dnb));
  m.gate_up_fp8_scales.push_back(std::move(gus));
  m.down_fp8_scales.push_back(std::move(dns));
  m.banks.push_back(bank);
  return absl::OkStatus();
}

// Bytes of one row of `cols` weights in a packed 4-bit format (scales included).
size_t FourBitRowBytes(WeightFormat f, size_t cols) {
  switch (f) {
    case WeightFormat::kQ4_0:
      return cols / common::kQ4_0Block * sizeof(common::BlockQ4_0);
    case WeightFormat::kMxfp4:
      return cols / 2 + cols / common::kMxfp4Block;
    default:  // kNvfp4
      return cols / 2 + cols / common::kNvfp4Block;
  }
}

// One [rows, cols] matrix of row-major 4-bit codes: q4_0 blocks in `codes` (no scales); mxfp4
// and nvfp4 packed codes in `codes`, scales in `scales`.
void QuantizeMatrix(WeightFormat f, const float* x, size_t rows, size_t cols, float global,
                    uint8_t* codes, uint8_t* scales) {
  for (size_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols;
    switch (f) {
      case WeightFormat::kQ4_0:
        common::QuantizeRowQ4_0(
            row, cols,
            reinterpret_cast<common::BlockQ4_0*>(codes + r * FourBitRowBytes(f, cols)));
        break;
      case WeightFormat::kMxfp4:
        common::QuantizeRowMxfp4(row, cols, codes + r * cols / 2,
                                 scales + r * cols / common::kMxfp4Block);
        break;
      default:
        common::QuantizeRowNvfp4(row, cols, global, codes + r * cols / 2,
                                 scales + r * cols / common::kNvfp4Block);
    }
  }
}

void DequantizeMatrix(WeightFormat f, const uint8_t* codes, const uint8_t* scales, size_t rows,
                      size_t cols, float global, float* out) {
  switch (f) {
    case WeightFormat::kQ4_0:
      common::DequantizeRowQ4_0(reinterpret_cast<const common::BlockQ4_0*>(codes),
                                static_cast<int64_t>(rows * cols), out);
      return;
    case WeightFormat::kMxfp4:
      common::DequantizeRowMxfp4(codes, scales, static_cast<int64_t>(rows * cols), out);
      return;
    default:
      common::DequantizeRowNvfp4(codes, scales, global, static_cast<int64_t>(rows * cols), out);
  }
}

// q4_0, mxfp4 and nvfp4 in panels, as the loader stores them. nvfp4: gate, up and down each
// with its own per-tensor scale (amax / (6 * 448)), as in NVIDIA's checkpoints. The distinct
// experts are quantized and packed, then their panels copied over the rest.
absl::Status AddFourBitLayer(WeightFormat f, const ExpertDraws& d, RandomModel& m,
                             std::vector<float>& gu_vals, std::vector<float>& dn_vals) {
  const int E = d.num_experts, D = d.distinct;
  const size_t H = d.hidden, I = d.intermediate;
  const bool q4 = f == WeightFormat::kQ4_0, nvfp4 = f == WeightFormat::kNvfp4;
  const size_t block = f == WeightFormat::kMxfp4 ? common::kMxfp4Block : common::kNvfp4Block;
  // Row-major per expert: codes (q4_0: whole blocks) and separate scale bytes.
  const size_t gu_codes = q4 ? 2 * I * FourBitRowBytes(f, H) : 2 * I * H / 2;
  const size_t dn_codes = q4 ? H * FourBitRowBytes(f, I) : H * I / 2;
  const size_t gu_scales = q4 ? 0 : 2 * I * H / block, dn_scales = q4 ? 0 : H * I / block;
  std::vector<uint8_t> guc(D * gu_codes), dnc(D * dn_codes), gusc(D * gu_scales),
      dnsc(D * dn_scales);
  std::vector<float> gate_global(D, 1.0f), up_global(D, 1.0f), down_global(D, 1.0f);
  for (int e = 0; e < D; ++e) {
    const float* gate = d.gu.data() + e * d.gu_n();
    const float* up = gate + I * H;
    const float* down = d.dn.data() + e * d.dn_n();
    if (nvfp4) {
      gate_global[e] = common::Nvfp4GlobalScale(gate, I * H);
      up_global[e] = common::Nvfp4GlobalScale(up, I * H);
      down_global[e] = common::Nvfp4GlobalScale(down, H * I);
    }
    uint8_t* c = guc.data() + e * gu_codes;
    uint8_t* s = gusc.data() + e * gu_scales;
    QuantizeMatrix(f, gate, I, H, gate_global[e], c, s);
    QuantizeMatrix(f, up, I, H, up_global[e], c + gu_codes / 2, s + gu_scales / 2);
    QuantizeMatrix(f, down, H, I, down_global[e], dnc.data() + e * dn_codes,
                   dnsc.data() + e * dn_scales);
  }
  if (d.want_values) {
    // Without fast_fill every expert is distinct.
    for (int e = 0; e < E; ++e) {
      const uint8_t* c = guc.data() + e * gu_codes;
      const uint8_t* s = gusc.data() + e * gu_scales;
      float* out = gu_vals.data() + e * d.gu_n();
      DequantizeMatrix(f, c, s, I, H, gate_global[e], out);
      DequantizeMatrix(f, c + gu_codes / 2, s + gu_scales / 2, I, H, up_global[e], out + I * H);
      DequantizeMatrix(f, dnc.data() + e * dn_codes, dnsc.data() + e * dn_scales, H, I,
                       down_global[e], dn_vals.data() + e * d.dn_n());
    }
  }
  cpu_moe::ExpertBank src = BankShape(f, d, D);
  src.gate_up_weights = guc.data();
  src.down_weights = dnc.data();
  if (!q4) {
    src.gate_up_scales = gusc.data();
    src.down_scales = dnsc.data();
  }
  if (nvfp4) {
    src.gate_up_global_scales = gate_global.data();
    src.up_global_scales = up_global.data();
    src.down_global_scales = down_global.data();
  }
  ASSIGN_OR_RETURN(std::unique_ptr<cpu_moe::PanelBank> packed, cpu_moe::PackPanels(src, d.pool));
  if (D < E) {
    // The same bytes per expert in panels as row-major (cpu_moe.h), experts contiguous.
    const size_t gu_bytes = 2 * I * FourBitRowBytes(f, H), dn_bytes = H * FourBitRowBytes(f, I);
    auto full = std::make_unique<cpu_moe::PanelBank>();
    ASSIGN_OR_RETURN(full->gate_up, common::AlignedBuffer<uint8_t>::AllocateHugePages(E * gu_bytes));
    ASSIGN_OR_RETURN(full->down, common::AlignedBuffer<uint8_t>::AllocateHugePages(E * dn_bytes));
    std::memcpy(full->gate_up.data(), packed->gate_up.data(), D * gu_bytes);
    std::memcpy(full->down.data(), packed->down.data(), D * dn_bytes);
    Replicate(full->gate_up.data(), gu_bytes, E, D, d.pool);
    Replicate(full->down.data(), dn_bytes, E, D, d.pool);
    full->bank = packed->bank;
    full->bank.num_experts = E;
    full->bank.gate_up_weights = full->gate_up.data();
    full->bank.down_weights = full->down.data();
    if (nvfp4) {
      for (int e = 0; e < E; ++e) {
        full->gate_up_global_scales.push_back(gate_global[e % D]);
        full->up_global_scales.push_back(up_global[e % D]);
        full->down_global_scales.push_back(down_global[e % D]);
      }
      full->bank.gate_up_global_scales = full->gate_up_global_scales.data();
      full->bank.up_global_scales = full->up_global_scales.data();
      full->bank.down_global_scales = full->down_global_scales.data();
    }
    packed = std::move(full);
  }
  m.banks.push_back(packed->bank);
  m.panels.push_back(std::move(packed));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<RandomModel> MakeRandomModel(const ModelConfig& c,
                                            const RandomModelOptions& options) {
  const int H = c.hidden_size, I = c.moe_intermediate_size, E = c.num_experts;
  const int hd = c.head_dim, nh = c.num_attention_heads, nkv = c.num_key_value_heads;
  if (H % 32 != 0 || (E > 0 && I % 32 != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden ", H, " and moe_intermediate_size ", I, " must be multiples of 32"));
  }
  const WeightFormat ef = options.expert_format;
  if (c.NumLinearAttentionLayers() > 0) {
    const LinearAttentionConfig& la = c.linear;
    if (la.num_key_heads <= 0 || la.num_value_heads <= 0 || la.key_head_dim <= 0 ||
        la.value_head_dim <= 0 || la.conv_kernel <= 0 ||
        la.num_value_heads % la.num_key_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "linear attention: key heads ", la.num_key_heads, ", value heads ", la.num_value_heads,
          ", key dim ", la.key_head_dim, ", value dim ", la.value_head_dim, ", conv kernel ",
          la.conv_kernel, " must be positive, value heads a multiple of key heads"));
    }
  }
  RandomModel m;
  m.weights = std::make_unique<ModelWeights>();
  ModelWeights& w = *m.weights;
  w.config = c;
  w.expert_format = ef;
  Fill fill(options.seed);
  fill.fast = options.fast_fill;
  const DType dd = options.dense_dtype;
  const float in_h = InvSqrt(H);
  w.embed_tokens = MakeTensor(dd, c.vocab_size, H, fill, 1.0f, 0.0f);
  w.final_norm = MakeTensor(DType::kF32, 1, H, fill, 0.2f, 1.0f);
  if (!c.tie_word_embeddings) w.lm_head = MakeTensor(dd, c.vocab_size, H, fill, in_h, 0.0f);
  w.layers.resize(c.num_hidden_layers);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    LayerWeights& lw = w.layers[l];
    lw.input_layernorm = MakeTensor(DType::kF32, 1, H, fill, 0.2f, 1.0f);
    lw.post_attention_layernorm = MakeTensor(DType::kF32, 1, H, fill, 0.2f, 1.0f);
    if (c.IsLinearAttentionLayer(l)) {
      MakeLinearAttention(c, dd, fill, lw);
    } else {
      // With the output gate, q_proj holds per head its query rows, then its gate rows.
      const int q_rows = (c.attn_output_gate ? 2 : 1) * nh * hd;
      lw.q_proj = MakeTensor(dd, q_rows, H, fill, in_h, 0.0f);
      lw.k_proj = MakeTensor(dd, nkv * hd, H, fill, in_h, 0.0f);
      lw.v_proj = MakeTensor(dd, nkv * hd, H, fill, in_h, 0.0f);
      lw.o_proj = MakeTensor(dd, H, nh * hd, fill, InvSqrt(nh * hd), 0.0f);
      if (c.attention_bias) {
        lw.q_bias = MakeTensor(DType::kF32, 1, nh * hd, fill, 0.2f, 0.0f);
        lw.k_bias = MakeTensor(DType::kF32, 1, nkv * hd, fill, 0.2f, 0.0f);
        lw.v_bias = MakeTensor(DType::kF32, 1, nkv * hd, fill, 0.2f, 0.0f);
      }
      if (c.qk_norm) {
        lw.q_norm = MakeTensor(DType::kF32, 1, hd, fill, 0.2f, 1.0f);
        lw.k_norm = MakeTensor(DType::kF32, 1, hd, fill, 0.2f, 1.0f);
      }
    }
    lw.is_moe = c.IsMoeLayer(l);
    lw.moe_index = c.MoeLayerIndex(l);
    if (lw.is_moe) {
      lw.router = MakeTensor(dd, E, H, fill, 2.0f * in_h, 0.0f);
      if (c.shared_expert_intermediate_size > 0) {
        const int S = c.shared_expert_intermediate_size;
        lw.shared_gate_proj = MakeTensor(dd, S, H, fill, in_h, 0.0f);
        lw.shared_up_proj = MakeTensor(dd, S, H, fill, in_h, 0.0f);
        lw.shared_down_proj = MakeTensor(dd, H, S, fill, InvSqrt(S), 0.0f);
        lw.shared_expert_gate = MakeTensor(dd, 1, H, fill, in_h, 0.0f);
      }
    } else {
      const int D = c.intermediate_size;
      lw.mlp_gate_proj = MakeTensor(dd, D, H, fill, in_h, 0.0f);
      lw.mlp_up_proj = MakeTensor(dd, D, H, fill, in_h, 0.0f);
      lw.mlp_down_proj = MakeTensor(dd, H, D, fill, InvSqrt(D), 0.0f);
    }
  }

  // Routed experts, one bank per MoE layer.
  const int moe_layers = c.NumMoeLayers();
  const int distinct = options.fast_fill ? std::min(E, std::max(1, options.distinct_experts)) : E;
  const float a_gu = in_h, a_dn = InvSqrt(I);
  for (int ml = 0; ml < moe_layers; ++ml) {
    std::vector<float> gu(static_cast<size_t>(distinct) * 2 * I * H),
        dn(static_cast<size_t>(distinct) * H * I);
    for (float& x : gu) x = fill.Next(a_gu);
    for (float& x : dn) x = fill.Next(a_dn);
    const ExpertDraws d{E, distinct, H, I, gu, dn, !options.fast_fill, options.pool};
    // The bank's values, as floats, for references.
    std::vector<float> gu_vals(d.want_values ? E * d.gu_n() : 0),
        dn_vals(d.want_values ? E * d.dn_n() : 0);
    switch (ef) {
      case WeightFormat::kBf16:
        RETURN_IF_ERROR(AddBf16Layer(d, m, gu_vals, dn_vals));
        break;
      case WeightFormat::kFp8Block:
        RETURN_IF_ERROR(AddFp8Layer(d, m, gu_vals, dn_vals));
        break;
      default:
        RETURN_IF_ERROR(AddFourBitLayer(ef, d, m, gu_vals, dn_vals));
    }
    m.gate_up.push_back(std::move(gu_vals));
    m.down.push_back(std::move(dn_vals));
  }
  return m;
}

}  // namespace moe::engine
