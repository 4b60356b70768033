#include "common/npy.h"

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace moe::common {
namespace {

// The bytes numpy.save writes for np.array([[1, 2, 3], [4, 5, 6]], dtype=np.float32): format
// 1.0, a 118-byte header (dict, 58 spaces of padding, newline) so the data starts at byte 128.
std::string NumpyFloat2x3() {
  std::string s("\x93NUMPY\x01\x00\x76\x00", 10);
  s += "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  s += std::string(58, ' ') + "\n";
  const float v[6] = {1, 2, 3, 4, 5, 6};
  s.append(reinterpret_cast<const char*>(v), sizeof(v));
  return s;
}

std::string WithHeader(const std::string& dict, const std::string& data, int major = 1) {
  std::string h = dict + "\n";
  std::string s("\x93NUMPY", 6);
  s += static_cast<char>(major);
  s += '\0';
  const size_t n = h.size();
  for (int i = 0; i < (major == 1 ? 2 : 4); ++i) s += static_cast<char>((n >> (8 * i)) & 0xFF);
  return s + h + data;
}

void ExpectBad(const std::string& bytes, const std::string& needle) {
  absl::StatusOr<NpyArray> a = ParseNpy(bytes, "x.npy");
  ASSERT_FALSE(a.ok()) << needle;
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string msg(a.status().message());
  EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  EXPECT_NE(msg.find("x.npy"), std::string::npos) << msg;
}

TEST(NpyTest, ReadsWhatNumpyWrites) {
  absl::StatusOr<NpyArray> a = ParseNpy(NumpyFloat2x3(), "x.npy");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->dtype, NpyDtype::kFloat32);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a->f32, (std::vector<float>{1, 2, 3, 4, 5, 6}));
}

TEST(NpyTest, WritesWhatNumpyWrites) {
  NpyArray a;
  a.shape = {2, 3};
  a.f32 = {1, 2, 3, 4, 5, 6};
  absl::StatusOr<std::string> s = SerializeNpy(a);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, NumpyFloat2x3());
}

TEST(NpyTest, Int32AnyRankRoundTrip) {
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/a.npy";
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{}, {5}, {2, 0, 3}, {2, 1, 3, 2}}) {
    NpyArray a;
    a.dtype = NpyDtype::kInt32;
    a.shape = shape;
    for (int64_t i = 0; i < a.numel(); ++i) a.i32.push_back(static_cast<int32_t>(i * 1000 - 7));
    ASSERT_TRUE(WriteNpy(path, a).ok());
    absl::StatusOr<NpyArray> b = ReadNpy(path);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->dtype, NpyDtype::kInt32);
    EXPECT_EQ(b->shape, shape);
    EXPECT_EQ(b->i32, a.i32);
  }
  // numpy's tuple spellings: "(5,)" and "()".
  absl::StatusOr<std::string> s =
      SerializeNpy(NpyArray{NpyDtype::kInt32, {5}, {}, {1, 2, 3, 4, 5}});
  ASSERT_TRUE(s.ok());
  EXPECT_NE(s->find("'shape': (5,), }"), std::string::npos);
  EXPECT_EQ(s->size() % 64, 20u);  // 64-aligned header, then 5 * 4 data bytes
}

TEST(NpyTest, Int64AndVersion2) {
  const int64_t v[3] = {-5, 0, 2147483647};
  absl::StatusOr<NpyArray> a =
      ParseNpy(WithHeader("{\"descr\": \"<i8\", \"fortran_order\": False, \"shape\": (3,)}",
                          std::string(reinterpret_cast<const char*>(v), 24), 2),
               "x.npy");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->i32, (std::vector<int32_t>{-5, 0, 2147483647}));
  const int64_t big = int64_t{1} << 40;
  ExpectBad(WithHeader("{'descr': '<i8', 'fortran_order': False, 'shape': (1,), }",
                       std::string(reinterpret_cast<const char*>(&big), 8)),
            "does not fit int32");
}

TEST(NpyTest, Int16AndInt8ReadAsInt32) {
  const int16_t v16[3] = {-32768, -1, 32767};
  absl::StatusOr<NpyArray> a =
      ParseNpy(WithHeader("{'descr': '<i2', 'fortran_order': False, 'shape': (3,), }",
                          std::string(reinterpret_cast<const char*>(v16), 6)),
               "x.npy");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->dtype, NpyDtype::kInt32);
  EXPECT_EQ(a->i32, (std::vector<int32_t>{-32768, -1, 32767}));
  const int8_t v8[2] = {-128, 127};
  a = ParseNpy(WithHeader("{'descr': '|i1', 'fortran_order': False, 'shape': (2,), }",
                          std::string(reinterpret_cast<const char*>(v8), 2)),
               "x.npy");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->i32, (std::vector<int32_t>{-128, 127}));
}

TEST(NpyTest, Errors) {
  ExpectBad("PK\x03\x04zipfile", "magic");
  std::string v9 = NumpyFloat2x3();
  v9[6] = 9;
  ExpectBad(v9, "version 9");
  ExpectBad(NumpyFloat2x3().substr(0, 60), "runs past the end");
  ExpectBad(NumpyFloat2x3().substr(0, 140), "needs 24 data bytes, the file has 12");
  ExpectBad(NumpyFloat2x3() + "xx", "the file has 26");
  ExpectBad(WithHeader("{'descr': '>f4', 'fortran_order': False, 'shape': (1,), }", "abcd"),
            "'>f4' is not supported");
  ExpectBad(WithHeader("{'descr': '<f8', 'fortran_order': False, 'shape': (1,), }", "abcdabcd"),
            "'<f8'");
  ExpectBad(WithHeader("{'descr': '<f4', 'fortran_order': True, 'shape': (1,), }", "abcd"),
            "Fortran");
  ExpectBad(WithHeader("{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }", "abcd"),
            "non-negative");
  ExpectBad(WithHeader("{'descr': '<f4', 'fortran_order': False, "
                       "'shape': (4294967296, 4294967296, 4294967296), }",
                       "abcd"),
            "needs more data");
  ExpectBad(WithHeader("{'descr': '<f4', 'shape': (1,), }", "abcd"), "fortran_order");
  ExpectBad(WithHeader("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'x': 1}", "abcd"),
            "unexpected header key 'x'");
  ExpectBad(WithHeader("{'descr' '<f4'}", ""), "malformed");
  EXPECT_EQ(ReadNpy("/nonexistent.npy").status().code(), absl::StatusCode::kNotFound);
  NpyArray wrong;
  wrong.shape = {2, 2};
  wrong.f32 = {1, 2, 3};
  EXPECT_FALSE(SerializeNpy(wrong).ok());
}

}  // namespace
}  // namespace moe::common
