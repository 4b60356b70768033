// The decode split plan and shape validation: host logic shared with the kernels, so it is
// tested everywhere (the kernels themselves are tested in paged_attention_test on a GPU).
#include <cstdint>

#include "engine/cuda/attention/paged_attention.h"
#include "gtest/gtest.h"

namespace moe::engine::gpu {
namespace {

TEST(SplitChunkTest, CoversTheSequenceWithinTheSplits) {
  for (int splits : {1, 2, 7, 132, 1024}) {
    for (int min_chunk : {16, 32, 64}) {
      for (int len = 1; len <= 70000; len += (len < 300 ? 1 : 997)) {
        const int chunk = SplitChunk(len, splits, min_chunk);
        ASSERT_EQ(chunk % 16, 0) << len << " " << splits;
        ASSERT_GE(chunk, min_chunk);
        const int active = (len + chunk - 1) / chunk;
        ASSERT_LE(active, splits) << "len " << len << " splits " << splits;
        ASSERT_GE(static_cast<int64_t>(active) * chunk, len);
      }
    }
  }
}

TEST(DecodePlanTest, FillsTheGpuAtBatchOneAndShrinksWithBatch) {
  DecodeWorkspaceConfig c;
  c.max_batch = 8;
  c.num_q_heads = 32;
  c.num_kv_heads = 4;
  c.head_dim = 128;
  c.max_context = 32768;
  auto plan = MakeDecodePlan(c, /*sm_count=*/132);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->target_blocks, 4 * 132);
  EXPECT_EQ(plan->max_splits, 1024);
  EXPECT_EQ(plan->SplitsForBatch(1), 132);  // 132 splits x 4 KV heads = 528 blocks
  EXPECT_EQ(plan->SplitsForBatch(8), 17);
  for (int b = 1; b <= c.max_batch; ++b) {
    EXPECT_GE(plan->PartialCapacity(),
              static_cast<int64_t>(b) * plan->SplitsForBatch(b) * c.num_q_heads);
    EXPECT_GE(b * plan->SplitsForBatch(b) * c.num_kv_heads, plan->target_blocks);
  }
  // A short context caps the splits: no split below min_chunk positions.
  c.max_context = 100;
  plan = MakeDecodePlan(c, 132);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->max_splits, 4);
  EXPECT_EQ(plan->SplitsForBatch(1), 4);
}

TEST(DecodePlanTest, RejectsBadShapes) {
  DecodeWorkspaceConfig c;
  c.max_batch = 1;
  c.num_q_heads = 32;
  c.num_kv_heads = 4;
  c.head_dim = 96;
  c.max_context = 1024;
  EXPECT_EQ(MakeDecodePlan(c, 132).status().code(), absl::StatusCode::kInvalidArgument);
  c.head_dim = 128;
  c.num_kv_heads = 5;
  EXPECT_EQ(MakeDecodePlan(c, 132).status().code(), absl::StatusCode::kInvalidArgument);
  c.num_kv_heads = 4;
  c.min_chunk = 24;
  EXPECT_EQ(MakeDecodePlan(c, 132).status().code(), absl::StatusCode::kInvalidArgument);
  c.min_chunk = 32;
  EXPECT_TRUE(MakeDecodePlan(c, 132).ok());
}

TEST(ValidateLayerTest, ServesTheDocumentedShapes) {
  PagedKvLayer l;
  l.num_blocks = 4;
  l.num_kv_heads = 4;
  for (int hd : {16, 32, 64, 128, 256}) {
    for (int bs : {16, 32, 1024}) {
      l.head_dim = hd;
      l.block_size = bs;
      EXPECT_TRUE(ValidateLayer(l).ok()) << hd << " " << bs;
    }
  }
  l.head_dim = 128;
  for (int bs : {8, 24, 2048}) {
    l.block_size = bs;
    EXPECT_EQ(ValidateLayer(l).code(), absl::StatusCode::kInvalidArgument) << bs;
  }
  l.block_size = 16;
  for (int hd : {8, 96, 512}) {
    l.head_dim = hd;
    EXPECT_EQ(ValidateLayer(l).code(), absl::StatusCode::kInvalidArgument) << hd;
  }
}

}  // namespace
}  // namespace moe::engine::gpu
