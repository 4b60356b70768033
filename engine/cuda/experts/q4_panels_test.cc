// The lane addressing of q4_panels.h, on the CPU: rebuilding gate_up and down matrices from
// PackPanels' bytes lane by lane and step by step gives exactly common::DequantizeRowQ4_0's
// values (q4_0) and common::DequantizeRowNvfp4's (nvfp4, codes through
// E2m1PairAsHalf2Bits as the kernel decodes them), and every weight is read by exactly one
// (step, lane).
#include "engine/cuda/experts/q4_panels.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "common/formats.h"
#include "cpu_moe/cpu_moe.h"
#include "gtest/gtest.h"

namespace moe::engine::gpu {
namespace {

std::vector<uint8_t> QuantizeRows(std::mt19937& rng, int rows, int cols,
                                  std::vector<float>* values) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(cols);
  const int row_bytes = cols / 32 * static_cast<int>(sizeof(common::BlockQ4_0));
  std::vector<uint8_t> blocks(static_cast<size_t>(rows) * row_bytes);
  values->resize(static_cast<size_t>(rows) * cols);
  for (int r = 0; r < rows; ++r) {
    for (float& v : x) v = u(rng);
    auto* b = reinterpret_cast<common::BlockQ4_0*>(blocks.data() + r * row_bytes);
    common::QuantizeRowQ4_0(x.data(), cols, b);
    common::DequantizeRowQ4_0(b, cols, values->data() + static_cast<size_t>(r) * cols);
  }
  return blocks;
}

// Rebuilds a [rows, cols] matrix from its panels the way the kernels' lanes read it.
void ExpectLanesRebuild(const uint8_t* panels, int rows, int cols,
                        const std::vector<float>& want) {
  std::vector<int> reads(static_cast<size_t>(rows) * cols, 0);
  for (int p = 0; p < rows / q4_panels::kRows; ++p) {
    const uint8_t* panel = panels + p * q4_panels::PanelBytes(cols);
    for (int s = 0; s < q4_panels::Steps(cols); ++s) {
      for (int lane = 0; lane < 32; ++lane) {
        if (q4_panels::Block(s, lane) >= cols / 32) continue;
        uint32_t words[4];
        uint16_t scales[4];
        std::memcpy(words, panel + q4_panels::CodesOffset(s, lane), 16);
        std::memcpy(scales, panel + q4_panels::ScalesOffset(cols, s, lane), 8);
        for (int r = 0; r < 4; ++r) {
          const int row = p * q4_panels::kRows + q4_panels::FirstRow(lane) + r;
          const float d = common::Fp16ToFloat(scales[r]);
          for (int i = 0; i < 4; ++i) {
            const uint32_t byte = (words[r] >> (8 * i)) & 0xff;
            const int c_lo = q4_panels::FirstColumn(s, lane) + i, c_hi = c_lo + 4;
            const size_t lo = static_cast<size_t>(row) * cols + c_lo;
            const size_t hi = static_cast<size_t>(row) * cols + c_hi;
            ASSERT_EQ(d * (static_cast<float>(byte & 15) - 8.0f), want[lo])
                << "row " << row << " col " << c_lo;
            ASSERT_EQ(d * (static_cast<float>(byte >> 4) - 8.0f), want[hi])
                << "row " << row << " col " << c_hi;
            ++reads[lo];
            ++reads[hi];
          }
        }
      }
    }
  }
  for (size_t i = 0; i < reads.size(); ++i) {
    ASSERT_EQ(reads[i], 1) << "weight " << i << " read " << reads[i] << " times";
  }
}

// nvfp4 rows (global scale 1): codes, e4m3 scales and their values (e2m1 * e4m3).
struct Nvfp4Rows {
  std::vector<uint8_t> codes, scales;
  std::vector<float> values;
};
Nvfp4Rows QuantizeNvfp4(std::mt19937& rng, int rows, int cols) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(rows) * cols);
  for (float& v : x) v = u(rng);
  const float g = common::Nvfp4GlobalScale(x.data(), static_cast<int64_t>(x.size()));
  Nvfp4Rows out;
  out.codes.resize(x.size() / 2);
  out.scales.resize(x.size() / 16);
  out.values.resize(x.size());
  for (int r = 0; r < rows; ++r) {
    uint8_t* c = out.codes.data() + static_cast<size_t>(r) * cols / 2;
    uint8_t* sc = out.scales.data() + static_cast<size_t>(r) * cols / 16;
    common::QuantizeRowNvfp4(x.data() + static_cast<size_t>(r) * cols, cols, g, c, sc);
    common::DequantizeRowNvfp4(c, sc, 1.0f, cols,
                               out.values.data() + static_cast<size_t>(r) * cols);
  }
  return out;
}

// The nvfp4 kernel's reading of a panel: per lane and step 4 words of codes, decoded pairwise
// as fp16 bits (times 2^14), and 4 e4m3 scales.
void ExpectNvfp4LanesRebuild(const uint8_t* panels, int rows, int cols,
                             const std::vector<float>& want) {
  std::vector<int> reads(static_cast<size_t>(rows) * cols, 0);
  // (shift, column of the low half, column of the high half) as Nvfp4Format::Decode.
  const int pairs[4][3] = {{0, 0, 2}, {8, 1, 3}, {4, 4, 6}, {12, 5, 7}};
  for (int p = 0; p < rows / q4_panels::kRows; ++p) {
    const uint8_t* panel = panels + p * q4_panels::PanelBytes(cols);
    for (int s = 0; s < q4_panels::Steps(cols); ++s) {
      for (int lane = 0; lane < 32; ++lane) {
        if (q4_panels::Block(s, lane) >= cols / 32) continue;
        uint32_t words[4];
        uint8_t scales[4];
        std::memcpy(words, panel + q4_panels::CodesOffset(s, lane), 16);
        std::memcpy(scales, panel + q4_panels::Nvfp4ScalesOffset(cols, s, lane), 4);
        for (int r = 0; r < 4; ++r) {
          const int row = p * q4_panels::kRows + q4_panels::FirstRow(lane) + r;
          const float d = common::Fp8E4M3ToFloat(scales[r]);
          for (const auto& pr : pairs) {
            const uint32_t bits = q4_panels::E2m1PairAsHalf2Bits(words[r], pr[0]);
            const float halves[2] = {
                common::Fp16ToFloat(static_cast<uint16_t>(bits)) * 16384.0f,
                common::Fp16ToFloat(static_cast<uint16_t>(bits >> 16)) * 16384.0f};
            for (int k = 0; k < 2; ++k) {
              const int c = q4_panels::FirstColumn(s, lane) + pr[1 + k];
              const size_t at = static_cast<size_t>(row) * cols + c;
              ASSERT_EQ(halves[k] * d, want[at]) << "row " << row << " col " << c;
              ++reads[at];
            }
          }
        }
      }
    }
  }
  for (size_t i = 0; i < reads.size(); ++i) {
    ASSERT_EQ(reads[i], 1) << "weight " << i << " read " << reads[i] << " times";
  }
}

// Every e2m1 code, in either half and with either neighbour, decodes to its exact value.
TEST(Q4PanelsTest, E2m1PairAsHalf2BitsIsExact) {
  for (uint32_t lo = 0; lo < 16; ++lo) {
    for (uint32_t hi = 0; hi < 16; ++hi) {
      for (int shift : {0, 4, 8, 12}) {
        const uint32_t word = (lo << shift) | (hi << (shift + 16)) | (0xfu << ((shift + 4) % 16));
        const uint32_t bits = q4_panels::E2m1PairAsHalf2Bits(word, shift);
        EXPECT_EQ(common::Fp16ToFloat(static_cast<uint16_t>(bits)) * 16384.0f,
                  common::Fp4E2M1ToFloat(static_cast<uint8_t>(lo)))
            << lo << " " << shift;
        EXPECT_EQ(common::Fp16ToFloat(static_cast<uint16_t>(bits >> 16)) * 16384.0f,
                  common::Fp4E2M1ToFloat(static_cast<uint8_t>(hi)))
            << hi << " " << shift;
      }
    }
  }
}

TEST(Q4PanelsTest, Nvfp4LanesRebuildPackPanelsMatrices) {
  const int shapes[][2] = {{96, 160}, {544, 352}, {256, 128}, {2048, 768}};
  std::mt19937 rng(6);
  for (const auto& shape : shapes) {
    const int H = shape[0], I = shape[1];
    const Nvfp4Rows gu = QuantizeNvfp4(rng, 2 * I, H), dn = QuantizeNvfp4(rng, H, I);
    const float one = 1.0f;
    cpu_moe::ExpertBank bank;
    bank.format = common::WeightFormat::kNvfp4;
    bank.num_experts = 1;
    bank.hidden = H;
    bank.intermediate = I;
    bank.gate_up_weights = gu.codes.data();
    bank.gate_up_scales = gu.scales.data();
    bank.down_weights = dn.codes.data();
    bank.down_scales = dn.scales.data();
    bank.gate_up_global_scales = &one;
    bank.down_global_scales = &one;
    auto panels = cpu_moe::PackPanels(bank);
    ASSERT_TRUE(panels.ok()) << panels.status();
    ASSERT_EQ((*panels)->gate_up.bytes(), 2 * I / 16 * q4_panels::PanelBytes(H));
    ASSERT_EQ((*panels)->down.bytes(), H / 16 * q4_panels::PanelBytes(I));
    SCOPED_TRACE(testing::Message() << "nvfp4 H=" << H << " I=" << I);
    ExpectNvfp4LanesRebuild((*panels)->gate_up.data(), 2 * I, H, gu.values);
    ExpectNvfp4LanesRebuild((*panels)->down.data(), H, I, dn.values);
  }
}

TEST(Q4PanelsTest, LanesRebuildPackPanelsMatrices) {
  // (H, I): odd block counts (lone last group) and Qwen3-30B-A3B's shape.
  const int shapes[][2] = {{96, 160}, {544, 352}, {256, 128}, {2048, 768}};
  std::mt19937 rng(5);
  for (const auto& shape : shapes) {
    const int H = shape[0], I = shape[1];
    std::vector<float> gu_values, dn_values;
    std::vector<uint8_t> gu = QuantizeRows(rng, 2 * I, H, &gu_values);
    std::vector<uint8_t> dn = QuantizeRows(rng, H, I, &dn_values);
    cpu_moe::ExpertBank bank;
    bank.format = common::WeightFormat::kQ4_0;
    bank.num_experts = 1;
    bank.hidden = H;
    bank.intermediate = I;
    bank.gate_up_weights = gu.data();
    bank.down_weights = dn.data();
    auto panels = cpu_moe::PackPanels(bank);
    ASSERT_TRUE(panels.ok()) << panels.status();
    ASSERT_EQ((*panels)->gate_up.bytes(), 2 * I / 16 * q4_panels::PanelBytes(H));
    ASSERT_EQ((*panels)->down.bytes(), H / 16 * q4_panels::PanelBytes(I));
    SCOPED_TRACE(testing::Message() << "H=" << H << " I=" << I);
    ExpectLanesRebuild((*panels)->gate_up.data(), 2 * I, H, gu_values);
    ExpectLanesRebuild((*panels)->down.data(), H, I, dn_values);
  }
}

}  // namespace
}  // namespace moe::engine::gpu
