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

}  // namespace

absl::StatusOr<RandomModel> MakeRandomModel(const ModelConfig& c,
                                            const RandomModelOptions& options) {
  const int H = c.hidden_size, I = c.moe_intermediate_size, E = c.num_experts;
  const int hd = c.head_dim, nh = c.num_attention_heads, nkv = c.num_key_value_heads;
  if (H % 32 != 0 || (E > 0 && I % 32 != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden ", H, " and moe_intermediate_size ", I, " must be multiples of 32"));
  }
  if (options.expert_format != common::WeightFormat::kBf16 &&
      options.expert_format != common::WeightFormat::kQ4_0) {
    return absl::InvalidArgumentError("random models hold bf16 or q4_0 experts");
  }
  RandomModel m;
  m.weights = std::make_unique<ModelWeights>();
  ModelWeights& w = *m.weights;
  w.config = c;
  w.expert_format = options.expert_format;
  Fill fill(options.seed);
  fill.fast = options.fast_fill;
  const DType dd = options.dense_dtype;
  const float in_h = 1.0f / std::sqrt(static_cast<float>(H));
  w.embed_tokens = MakeTensor(dd, c.vocab_size, H, fill, 1.0f, 0.0f);
  w.final_norm = MakeTensor(DType::kF32, 1, H, fill, 0.2f, 1.0f);
  if (!c.tie_word_embeddings) w.lm_head = MakeTensor(dd, c.vocab_size, H, fill, in_h, 0.0f);
  w.layers.resize(c.num_hidden_layers);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    LayerWeights& lw = w.layers[l];
    lw.input_layernorm = MakeTensor(DType::kF32, 1, H, fill, 0.2f, 1.0f);
    lw.post_attention_layernorm = MakeTensor(DType::kF32, 1, H, fill, 0.2f, 1.0f);
    lw.q_proj = MakeTensor(dd, nh * hd, H, fill, in_h, 0.0f);
    lw.k_proj = MakeTensor(dd, nkv * hd, H, fill, in_h, 0.0f);
    lw.v_proj = MakeTensor(dd, nkv * hd, H, fill, in_h, 0.0f);
    lw.o_proj =
        MakeTensor(dd, H, nh * hd, fill, 1.0f / std::sqrt(static_cast<float>(nh * hd)), 0.0f);
    if (c.attention_bias) {
      lw.q_bias = MakeTensor(DType::kF32, 1, nh * hd, fill, 0.2f, 0.0f);
      lw.k_bias = MakeTensor(DType::kF32, 1, nkv * hd, fill, 0.2f, 0.0f);
      lw.v_bias = MakeTensor(DType::kF32, 1, nkv * hd, fill, 0.2f, 0.0f);
    }
    if (c.qk_norm) {
      lw.q_norm = MakeTensor(DType::kF32, 1, hd, fill, 0.2f, 1.0f);
      lw.k_norm = MakeTensor(DType::kF32, 1, hd, fill, 0.2f, 1.0f);
    }
    lw.is_moe = c.IsMoeLayer(l);
    lw.moe_index = c.MoeLayerIndex(l);
    if (lw.is_moe) {
      lw.router = MakeTensor(dd, E, H, fill, 2.0f * in_h, 0.0f);
      if (c.shared_expert_intermediate_size > 0) {
        const int S = c.shared_expert_intermediate_size;
        lw.shared_gate_proj = MakeTensor(dd, S, H, fill, in_h, 0.0f);
        lw.shared_up_proj = MakeTensor(dd, S, H, fill, in_h, 0.0f);
        lw.shared_down_proj =
            MakeTensor(dd, H, S, fill, 1.0f / std::sqrt(static_cast<float>(S)), 0.0f);
        lw.shared_expert_gate = MakeTensor(dd, 1, H, fill, in_h, 0.0f);
      }
    } else {
      const int D = c.intermediate_size;
      lw.mlp_gate_proj = MakeTensor(dd, D, H, fill, in_h, 0.0f);
      lw.mlp_up_proj = MakeTensor(dd, D, H, fill, in_h, 0.0f);
      lw.mlp_down_proj = MakeTensor(dd, H, D, fill, 1.0f / std::sqrt(static_cast<float>(D)), 0.0f);
    }
  }

  // Routed experts, one bank per MoE layer.
  const int moe_layers = c.NumMoeLayers();
  const size_t gu_n = static_cast<size_t>(2) * I * H, dn_n = static_cast<size_t>(H) * I;
  const int distinct = options.fast_fill ? std::min(E, std::max(1, options.distinct_experts)) : E;
  const float a_gu = in_h, a_dn = 1.0f / std::sqrt(static_cast<float>(I));
  const bool q4 = options.expert_format == common::WeightFormat::kQ4_0;
  for (int ml = 0; ml < moe_layers; ++ml) {
    std::vector<float> gu(distinct * gu_n), dn(distinct * dn_n);
    for (float& x : gu) x = fill.Next(a_gu);
    for (float& x : dn) x = fill.Next(a_dn);
    cpu_moe::ExpertBank bank;
    bank.format = options.expert_format;
    bank.num_experts = E;
    bank.hidden = H;
    bank.intermediate = I;
    // The bank's values, as floats, for references.
    std::vector<float> gu_vals(options.fast_fill ? 0 : E * gu_n),
        dn_vals(options.fast_fill ? 0 : E * dn_n);
    auto copy_experts = [&](auto* dst, size_t per_expert) {
      // Expert e is a copy of distinct expert e % distinct.
      auto body = [&](uint64_t e, int) {
        if (static_cast<int>(e) < distinct) return;
        std::memcpy(dst + e * per_expert, dst + (e % distinct) * per_expert,
                    per_expert * sizeof(*dst));
      };
      if (options.pool != nullptr) {
        options.pool->ParallelFor(E, body);
      } else {
        for (int e = 0; e < E; ++e) body(e, 0);
      }
    };
    if (!q4) {
      // Huge pages: a full-size bank is gigabytes, and 4 KiB page faults would dominate making it.
      ASSIGN_OR_RETURN(auto gub, common::AlignedBuffer<uint16_t>::AllocateHugePages(E * gu_n));
      ASSIGN_OR_RETURN(auto dnb, common::AlignedBuffer<uint16_t>::AllocateHugePages(E * dn_n));
      for (size_t i = 0; i < distinct * gu_n; ++i) gub.data()[i] = common::FloatToBf16(gu[i]);
      for (size_t i = 0; i < distinct * dn_n; ++i) dnb.data()[i] = common::FloatToBf16(dn[i]);
      copy_experts(gub.data(), gu_n);
      copy_experts(dnb.data(), dn_n);
      if (!options.fast_fill) {
        for (size_t i = 0; i < gu_vals.size(); ++i) gu_vals[i] = common::Bf16ToFloat(gub.data()[i]);
        for (size_t i = 0; i < dn_vals.size(); ++i) dn_vals[i] = common::Bf16ToFloat(dnb.data()[i]);
      }
      bank.gate_up_weights = gub.data();
      bank.down_weights = dnb.data();
      m.gate_up_bf16.push_back(std::move(gub));
      m.down_bf16.push_back(std::move(dnb));
      m.banks.push_back(bank);
    } else {
      const size_t gu_blocks = gu_n / common::kQ4_0Block, dn_blocks = dn_n / common::kQ4_0Block;
      ASSIGN_OR_RETURN(auto gub,
                       common::AlignedBuffer<common::BlockQ4_0>::AllocateHugePages(E * gu_blocks));
      ASSIGN_OR_RETURN(auto dnb,
                       common::AlignedBuffer<common::BlockQ4_0>::AllocateHugePages(E * dn_blocks));
      for (int e = 0; e < distinct; ++e) {
        for (int r = 0; r < 2 * I; ++r) {
          common::QuantizeRowQ4_0(gu.data() + e * gu_n + static_cast<size_t>(r) * H, H,
                                  gub.data() + e * gu_blocks + static_cast<size_t>(r) * H / 32);
        }
        for (int r = 0; r < H; ++r) {
          common::QuantizeRowQ4_0(dn.data() + e * dn_n + static_cast<size_t>(r) * I, I,
                                  dnb.data() + e * dn_blocks + static_cast<size_t>(r) * I / 32);
        }
      }
      copy_experts(gub.data(), gu_blocks);
      copy_experts(dnb.data(), dn_blocks);
      if (!options.fast_fill) {
        common::DequantizeRowQ4_0(gub.data(), static_cast<int64_t>(E * gu_n), gu_vals.data());
        common::DequantizeRowQ4_0(dnb.data(), static_cast<int64_t>(E * dn_n), dn_vals.data());
      }
      bank.gate_up_weights = gub.data();
      bank.down_weights = dnb.data();
      ASSIGN_OR_RETURN(std::unique_ptr<cpu_moe::PanelBank> panels,
                       cpu_moe::PackPanels(bank, options.pool));
      m.banks.push_back(panels->bank);
      m.panels.push_back(std::move(panels));
    }
    m.gate_up.push_back(std::move(gu_vals));
    m.down.push_back(std::move(dn_vals));
  }
  return m;
}

}  // namespace moe::engine
