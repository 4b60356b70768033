// The CPU computes cache misses straight from the expert store: for every weight format, the
// experts are written into a moe_cache::ExpertStore (pinned and mapped where a GPU is visible,
// pageable otherwise) in the bytes the GPU cache copies (4-bit formats in cpu_moe's panels), the
// store hands a layer out as a common::ExpertLayerView, and cpu_moe::Forward reads it in place
// (cpu_moe::BankFromView: no copy of the weights). The two components meet only in //common.
//
// Checked: the result equals, bit for bit, Forward on the same bytes held contiguously by
// cpu_moe itself (the store's padded rows and nvfp4's 16-byte global-scale pitch change nothing),
// and matches the float64 reference (cpu_moe/test_bank.h) within the kernels' activation
// rounding: relative Frobenius error <= 1.5% (two int8 activation stages of about 0.4% RMS each
// for the quantized formats, bf16 rounding of x and h, about 0.3%, for bf16 and fp8).
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/expert_view.h"
#include "common/formats.h"
#include "common/thread_pool.h"
#include "cpu_moe/cpu_moe.h"
#include "cpu_moe/internal/tuning.h"
#include "cpu_moe/test_bank.h"
#include "gtest/gtest.h"
#include "moe_cache/gpu/bank_layout.h"
#include "moe_cache/gpu/expert_store.h"

namespace moe {
namespace {

using common::WeightFormat;

constexpr int kLayers = 2, kExperts = 8, kHidden = 256, kInter = 256, kTopK = 4, kTokens = 5;

// Bytes per expert of one array of `bank` (codes with any inner scales, separate scales, global
// scale), and its base.
struct Array {
  std::string name;
  const uint8_t* base;
  uint64_t bytes;
};

std::vector<Array> Arrays(const cpu_moe::ExpertBank& b) {
  const uint64_t H = b.hidden, I = b.intermediate;
  std::vector<Array> out;
  auto add = [&](const char* name, const void* base, uint64_t bytes) {
    out.push_back({name, static_cast<const uint8_t*>(base), bytes});
  };
  switch (b.format) {
    case WeightFormat::kBf16:
      add("gate_up", b.gate_up_weights, 2 * I * H * 2);
      add("down", b.down_weights, H * I * 2);
      break;
    case WeightFormat::kFp8Block:
      add("gate_up", b.gate_up_weights, 2 * I * H);
      add("down", b.down_weights, H * I);
      add("gate_up_scales", b.gate_up_scales, (2 * I + 127) / 128 * ((H + 127) / 128) * 4);
      add("down_scales", b.down_scales, (H + 127) / 128 * ((I + 127) / 128) * 4);
      break;
    default: {  // 4-bit panels: 16 code bytes and the block's scales per row and 32 columns
      const uint64_t block = b.format == WeightFormat::kMxfp4 ? 17 : 18;
      add("gate_up", b.gate_up_weights, 2 * I * (H / 32) * block);
      add("down", b.down_weights, H * (I / 32) * block);
      if (b.format == WeightFormat::kNvfp4) {
        add("gate_up_global_scale", b.gate_up_global_scales, 4);
        add("down_global_scale", b.down_global_scales, 4);
      }
    }
  }
  return out;
}

class ExpertStoreCpuMoeTest : public ::testing::TestWithParam<WeightFormat> {
 protected:
  common::ThreadPool pool_{2};
};

TEST_P(ExpertStoreCpuMoeTest, MissesComputedInPlaceMatchTheReference) {
  const WeightFormat f = GetParam();
  const bool four_bit = f != WeightFormat::kBf16 && f != WeightFormat::kFp8Block;
  // One bank per layer; the 4-bit ones in panels, as the store holds them.
  std::vector<cpu_moe::testing::HostBank> host;
  std::vector<std::unique_ptr<cpu_moe::PanelBank>> panels;
  std::vector<cpu_moe::ExpertBank> source;
  for (int l = 0; l < kLayers; ++l) {
    host.push_back(cpu_moe::testing::MakeRandomBank(f, kExperts, kHidden, kInter, 11 + l));
    if (four_bit) {
      absl::StatusOr<std::unique_ptr<cpu_moe::PanelBank>> p =
          cpu_moe::PackPanels(host.back().bank);
      ASSERT_TRUE(p.ok()) << p.status();
      panels.push_back(*std::move(p));
      source.push_back(panels.back()->bank);
    } else {
      source.push_back(host.back().bank);
    }
  }
  std::vector<moe_cache::BankSpec> specs;
  for (const Array& a : Arrays(source[0])) specs.push_back({a.name, a.bytes, 0});
  absl::StatusOr<moe_cache::BankLayout> layout = moe_cache::BankLayout::Create(specs);
  ASSERT_TRUE(layout.ok()) << layout.status();
  moe_cache::ExpertStore::Options so;
  so.num_layers = kLayers;
  so.num_experts = kExperts;
  absl::StatusOr<std::unique_ptr<moe_cache::ExpertStore>> store =
      moe_cache::ExpertStore::Create(so, *layout);
  ASSERT_TRUE(store.ok()) << store.status();
  for (int l = 0; l < kLayers; ++l) {
    const std::vector<Array> arrays = Arrays(source[l]);
    for (int e = 0; e < kExperts; ++e) {
      for (size_t b = 0; b < arrays.size(); ++b) {
        const uint8_t* p = arrays[b].base + e * arrays[b].bytes;
        ASSERT_TRUE((*store)->WriteBank(l, e, static_cast<int>(b),
                                        absl::MakeConstSpan(p, arrays[b].bytes))
                        .ok());
      }
    }
  }
  RecordProperty("memory", (*store)->memory_kind() == moe_cache::HostMemoryKind::kPinnedMapped
                               ? "pinned-mapped"
                               : "pageable");

  std::mt19937_64 rng(5);
  for (int l = 0; l < kLayers; ++l) {
    const common::ExpertLayerView view = (*store)->LayerView(
        l, f, four_bit ? common::ExpertLayout::kPanels : common::ExpertLayout::kRowMajor,
        kHidden, kInter);
    absl::StatusOr<cpu_moe::ExpertBank> bank = cpu_moe::BankFromView(view);
    ASSERT_TRUE(bank.ok()) << bank.status();
    EXPECT_EQ(bank->gate_up_weights, (*store)->expert_bank(l * kExperts, 0)) << "read in place";
    // The misses of one step: routes to the experts the GPU cache does not hold (odd ids here);
    // the rest is padding for the CPU.
    cpu_moe::testing::Routing r = cpu_moe::testing::MakeRouting(kTokens, kExperts, kTopK, 0.0, rng);
    for (int32_t& id : r.ids) id = id % 2 == 1 ? id : -1;
    std::vector<float> x(kTokens * kHidden);
    std::normal_distribution<float> n01;
    for (float& v : x) v = n01(rng);
    cpu_moe::Options o;
    std::vector<float> y(x.size(), 0.0f), y_own(x.size(), 0.0f);
    cpu_moe::ForwardStats stats;
    ASSERT_TRUE(cpu_moe::Forward(*bank, kTokens, kTopK, r.ids, r.weights, x, absl::MakeSpan(y),
                                 o, pool_, &stats)
                    .ok());
    EXPECT_GT(stats.routes, 0);
    ASSERT_TRUE(cpu_moe::Forward(source[l], kTokens, kTopK, r.ids, r.weights, x,
                                 absl::MakeSpan(y_own), o, pool_)
                    .ok());
    EXPECT_EQ(std::memcmp(y.data(), y_own.data(), y.size() * sizeof(float)), 0)
        << "the store's bytes read in place give what cpu_moe's own copy gives";
    // The reference follows the kernels the run chose (fp8 through fp16 FMAs or AMX where the
    // CPU has them).
    cpu_moe::internal::Tuning tuning;
    tuning.fp8_fp16 = stats.fp8_fp16;
    tuning.amx = stats.amx;
    std::vector<double> ref, abs_scale, flip;
    cpu_moe::testing::ReferenceForward(host[l], kTokens, kTopK, r.ids, r.weights, x, o,
                                       /*emulate_act_quant=*/false, &ref, &abs_scale, &flip,
                                       tuning);
    EXPECT_LE(cpu_moe::testing::RelFrobenius(y, ref), 1.5e-2)
        << common::WeightFormatName(f) << " layer " << l;
  }
}

INSTANTIATE_TEST_SUITE_P(EveryFormat, ExpertStoreCpuMoeTest,
                         ::testing::Values(WeightFormat::kBf16, WeightFormat::kFp8Block,
                                           WeightFormat::kQ4_0, WeightFormat::kNvfp4,
                                           WeightFormat::kMxfp4),
                         [](const ::testing::TestParamInfo<WeightFormat>& i) {
                           return std::string(common::WeightFormatName(i.param));
                         });

}  // namespace
}  // namespace moe
