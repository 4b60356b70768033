#include "common/aligned_buffer.h"

#include <cstdint>
#include <utility>

#include "gtest/gtest.h"

namespace moe::common {
namespace {

bool IsAligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

TEST(AlignedBufferTest, DefaultIsEmpty) {
  AlignedBuffer<float> b;
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(b.size(), 0u);
  EXPECT_EQ(b.bytes(), 0u);
  EXPECT_TRUE(b.span().empty());
}

TEST(AlignedBufferTest, ZeroSizeIsEmpty) {
  AlignedBuffer<double> b(0);
  EXPECT_EQ(b.size(), 0u);
  EXPECT_TRUE(b.empty());
}

TEST(AlignedBufferTest, DefaultAlignmentIs64AndMemoryIsUsable) {
  for (size_t n : {1u, 3u, 17u, 1000u, 4097u}) {
    AlignedBuffer<uint8_t> b(n);
    ASSERT_EQ(b.size(), n);
    EXPECT_EQ(b.bytes(), n);
    EXPECT_TRUE(IsAligned(b.data(), 64)) << n;
    for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(i);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(b.span()[i], static_cast<uint8_t>(i));
  }
}

TEST(AlignedBufferTest, GivenAlignment) {
  for (size_t a : {4u, 8u, 128u, 4096u, 1u << 21}) {
    AlignedBuffer<float> b(5, a);
    EXPECT_TRUE(IsAligned(b.data(), a)) << a;
    EXPECT_EQ(b.bytes(), 5 * sizeof(float));
  }
}

TEST(AlignedBufferTest, BadAlignmentIsInvalidArgument) {
  for (size_t a : {0u, 3u, 48u, 2u /* below alignof(float) */}) {
    auto b = AlignedBuffer<float>::Allocate(10, a);
    ASSERT_FALSE(b.ok()) << a;
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  }
  auto huge = AlignedBuffer<double>::Allocate(~size_t{0} / 4);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(AlignedBufferTest, MovesTransferOwnership) {
  AlignedBuffer<int> a(100);
  int* p = a.data();
  a[7] = 42;
  AlignedBuffer<int> b(std::move(a));
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(b.size(), 100u);
  EXPECT_EQ(b[7], 42);
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(a.size(), 0u);

  AlignedBuffer<int> c(3);
  c = std::move(b);  // frees c's old block (ASan would flag a leak)
  EXPECT_EQ(c.data(), p);
  EXPECT_EQ(c.size(), 100u);
  EXPECT_EQ(b.size(), 0u);
  c = std::move(c);  // self-move keeps the buffer
  EXPECT_EQ(c.data(), p);
  static_assert(!std::is_copy_constructible_v<AlignedBuffer<int>>);
  static_assert(std::is_nothrow_move_constructible_v<AlignedBuffer<int>>);
}

TEST(AlignedBufferTest, HugePageBuffersAreAlignedAndUsable) {
  // 3 MiB + 1 element: not a multiple of the huge page size.
  const size_t n = (size_t{3} << 20) / sizeof(uint32_t) + 1;
  auto b = AlignedBuffer<uint32_t>::AllocateHugePages(n);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->size(), n);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % (size_t{2} << 20), 0u);
  for (size_t i = 0; i < n; ++i) (*b)[i] = static_cast<uint32_t>(i * 2654435761u);
  for (size_t i = 0; i < n; i += 4099) EXPECT_EQ((*b)[i], static_cast<uint32_t>(i * 2654435761u));
  EXPECT_EQ((*b)[n - 1], static_cast<uint32_t>((n - 1) * 2654435761u));
  auto empty = AlignedBuffer<uint32_t>::AllocateHugePages(0);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
}

}  // namespace
}  // namespace moe::common
