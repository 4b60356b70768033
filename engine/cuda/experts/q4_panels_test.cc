// The lane addressing of q4_panels.h, on the CPU: rebuilding gate_up and down matrices from
// PackPanels' bytes lane by lane and step by step gives exactly common::DequantizeRowQ4_0's
// values, and every weight is read by exactly one (step, lane).
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
