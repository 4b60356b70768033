#include "engine/forward_model.h"

#include <vector>

#include "gtest/gtest.h"

namespace moe::engine {
namespace {

TEST(KvBlockAllocatorTest, HandsOutLowestIdsFirstAndTakesThemBack) {
  KvBlockAllocator a(4, 16);
  EXPECT_EQ(a.num_blocks(), 4);
  EXPECT_EQ(a.block_size(), 16);
  std::vector<int32_t> t1, t2;
  ASSERT_TRUE(a.Allocate(2, &t1));
  EXPECT_EQ(t1, (std::vector<int32_t>{0, 1}));
  ASSERT_TRUE(a.Allocate(1, &t2));
  EXPECT_EQ(t2, (std::vector<int32_t>{2}));
  EXPECT_EQ(a.used_blocks(), 3);
  EXPECT_EQ(a.free_blocks(), 1);
  // Not enough: nothing is taken.
  EXPECT_FALSE(a.Allocate(2, &t2));
  EXPECT_EQ(t2.size(), 1u);
  EXPECT_EQ(a.free_blocks(), 1);
  a.Free(&t1);
  EXPECT_TRUE(t1.empty());
  EXPECT_EQ(a.free_blocks(), 3);
  ASSERT_TRUE(a.Allocate(3, &t1));
  EXPECT_EQ(t1, (std::vector<int32_t>{0, 1, 3}));
  EXPECT_EQ(a.free_blocks(), 0);
}

TEST(StateSlotAllocatorTest, HandsOutLowestSlotsAndTakesThemBack) {
  StateSlotAllocator a(2);
  EXPECT_EQ(a.num_slots(), 2);
  int s0 = -1, s1 = -1, s2 = -1;
  ASSERT_TRUE(a.Allocate(&s0));
  ASSERT_TRUE(a.Allocate(&s1));
  EXPECT_EQ(s0, 0);
  EXPECT_EQ(s1, 1);
  EXPECT_FALSE(a.Allocate(&s2));
  EXPECT_EQ(s2, -1);
  a.Free(&s0);
  EXPECT_EQ(s0, -1);
  a.Free(&s0);  // freeing nothing is a no-op
  EXPECT_EQ(a.free_slots(), 1);
  ASSERT_TRUE(a.Allocate(&s2));
  EXPECT_EQ(s2, 0);
  EXPECT_EQ(a.free_slots(), 0);
}

}  // namespace
}  // namespace moe::engine
