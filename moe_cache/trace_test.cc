#include "moe_cache/trace.h"

#include <cstdio>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace moe {
namespace moe_cache {
namespace {

Trace Small(int32_t big = 5) {
  Trace t;
  t.tokens = 2;
  t.layers = 3;
  t.k = 2;
  t.ids = {0, 1, 2, -1, 4, big, 1, 0, -1, -1, 7, 3};
  return t;
}

std::string Header(const std::string& dict) {
  std::string h = dict;
  size_t total = 10 + h.size() + 1;
  h.append((64 - total % 64) % 64, ' ');
  h.push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(static_cast<char>(h.size() & 0xff));
  out.push_back(static_cast<char>(h.size() >> 8));
  return out + h;
}

TEST(TraceTest, NpyRoundTripInt16AndInt32) {
  for (int32_t big : {5, 40000}) {
    Trace t = Small(big);
    const std::string bytes = SerializeNpyTrace(t);
    EXPECT_NE(bytes.find(big > 32767 ? "<i4" : "<i2"), std::string::npos);
    EXPECT_EQ((bytes.find('\n') + 1) % 64, 0u);
    auto back = ParseNpyTrace(bytes);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->tokens, 2);
    EXPECT_EQ(back->layers, 3);
    EXPECT_EQ(back->k, 2);
    EXPECT_EQ(back->ids, t.ids);
    EXPECT_EQ(back->Row(1, 2)[0], 7);
  }
}

TEST(TraceTest, FileRoundTrip) {
  const std::string path = std::string(getenv("TEST_TMPDIR") ? getenv("TEST_TMPDIR") : "/tmp") +
                           "/trace_test.npy";
  ASSERT_TRUE(WriteNpyTrace(Small(), path).ok());
  auto back = ReadNpyTrace(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->ids, Small().ids);
  EXPECT_EQ(ReadNpyTrace(path + ".missing").status().code(), absl::StatusCode::kNotFound);
}

TEST(TraceTest, ParsesInt64AndNegativePaddingBecomesMinusOne) {
  std::string b = Header("{'descr': '<i8', 'fortran_order': False, 'shape': (1, 1, 2), }");
  const int64_t vals[2] = {-5, 3};
  b.append(reinterpret_cast<const char*>(vals), sizeof(vals));
  auto t = ParseNpyTrace(b);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->ids, (std::vector<int32_t>{-1, 3}));
}

TEST(TraceTest, BadFilesGiveClearErrors) {
  auto expect_error = [](const std::string& bytes, const std::string& what) {
    auto t = ParseNpyTrace(bytes);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find(what), absl::string_view::npos) << t.status();
  };
  expect_error("hello world, not numpy", "magic");
  expect_error(Header("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1, 1), }") +
                   std::string(4, '\0'),
               "dtype float32");
  expect_error(Header("{'descr': '>i2', 'fortran_order': False, 'shape': (1, 1, 1), }") +
                   std::string(2, '\0'),
               "'>i2' is not supported");
  expect_error(Header("{'descr': '<i2', 'fortran_order': True, 'shape': (1, 1, 1), }") +
                   std::string(2, '\0'),
               "Fortran-order");
  expect_error(Header("{'descr': '<i2', 'fortran_order': False, 'shape': (4, 2), }") +
                   std::string(16, '\0'),
               "not 3-D");
  expect_error(Header("{'descr': '<i2', 'fortran_order': False, 'shape': (2, 2, 2), }") +
                   std::string(10, '\0'),
               "the file has 10");
  expect_error(Header("{'descr': '<i2', 'shape': (1, 1, 1), }") + std::string(2, '\0'),
               "fortran_order");
  std::string truncated = SerializeNpyTrace(Small());
  expect_error(truncated.substr(0, 20), "runs past the end");
}

TEST(TraceTest, RecorderFlattensBatchedStepsAndPadsMissingLayers) {
  TraceRecorder rec(/*layers=*/2, /*k=*/2);
  ASSERT_TRUE(rec.Append(0, std::vector<int32_t>{1, 2, 3, 4}, 2).ok());
  ASSERT_TRUE(rec.Append(1, std::vector<int32_t>{5, -7, 6, 7}, 2).ok());
  ASSERT_TRUE(rec.EndStep().ok());
  ASSERT_TRUE(rec.Append(1, std::vector<int32_t>{0, 1}, 1).ok());
  ASSERT_TRUE(rec.EndStep().ok());
  EXPECT_FALSE(rec.EndStep().ok());
  EXPECT_FALSE(rec.Append(2, std::vector<int32_t>{0, 1}, 1).ok());
  EXPECT_FALSE(rec.Append(0, std::vector<int32_t>{0, 1, 2}, 1).ok());
  ASSERT_TRUE(rec.Append(0, std::vector<int32_t>{0, 1}, 1).ok());
  EXPECT_FALSE(rec.Append(1, std::vector<int32_t>{0, 1, 2, 3}, 2).ok());
  Trace t = rec.Take();
  EXPECT_EQ(t.tokens, 3);
  EXPECT_EQ(t.ids, (std::vector<int32_t>{1, 2, 5, -1, 3, 4, 6, 7, -1, -1, 0, 1}));
}

}  // namespace
}  // namespace moe_cache
}  // namespace moe
