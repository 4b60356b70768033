#include "engine/safetensors.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moe::engine {
namespace {

// A file laid out by the format's specification: u64 little-endian header size, the JSON header
// (padded with spaces), then the data buffer that data_offsets index.
std::string SpecFile(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return out + header + data;
}

std::string Floats(std::vector<float> v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

absl::Status ParseStatus(const std::string& header, const std::string& data) {
  return SafetensorsFile::FromBytes(SpecFile(header, data), "t.safetensors").status();
}

void ExpectError(const std::string& header, const std::string& data, const std::string& needle) {
  const absl::Status s = ParseStatus(header, data);
  ASSERT_FALSE(s.ok()) << header;
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  const std::string msg(s.message());
  EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  EXPECT_NE(msg.find("t.safetensors"), std::string::npos) << msg;
}

TEST(SafetensorsTest, ReadsASpecFile) {
  // Two tensors, data deliberately not in header order (unsorted offsets are valid), metadata in
  // the form the reference writer emits.
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[8,24]},)"
      R"("b":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]}})";
  const uint16_t b[4] = {0x3F80, 0x4000, 0xBF80, 0x0000};
  std::string data(reinterpret_cast<const char*>(b), 8);
  data += Floats({1, 2, 3, 4});
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
      SafetensorsFile::FromBytes(SpecFile(header, data), "t.safetensors");
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ((*f)->tensors().size(), 2u);
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  const StTensor* w = (*f)->Find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->dtype, StDtype::kF32);
  EXPECT_EQ(w->shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(w->bytes, 16u);
  float wv[4];
  std::memcpy(wv, w->data, 16);
  EXPECT_EQ(wv[3], 4.0f);
  const StTensor* bt = (*f)->Find("b");
  ASSERT_NE(bt, nullptr);
  EXPECT_EQ(bt->dtype, StDtype::kBf16);
  EXPECT_EQ(std::memcmp(bt->data, b, 8), 0);
  EXPECT_EQ((*f)->Find("nope"), nullptr);
}

TEST(SafetensorsTest, WriterFollowsSpec) {
  SafetensorsWriter w;
  const std::vector<float> a = {1.5f, -2.0f, 3.0f};
  ASSERT_TRUE(w.Add("z.weight", StDtype::kF32, {3},
                    absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(a.data()), 12))
                  .ok());
  const uint8_t e[2] = {7, 9};
  ASSERT_TRUE(w.Add("a.scale", StDtype::kF8E4M3, {1, 2}, absl::MakeConstSpan(e, 2)).ok());
  w.SetMetadata("format", "pt");
  EXPECT_FALSE(w.Add("a.scale", StDtype::kU8, {2}, absl::MakeConstSpan(e, 2)).ok());
  EXPECT_FALSE(w.Add("bad", StDtype::kF32, {2}, absl::MakeConstSpan(e, 2)).ok());
  const std::string bytes = w.Serialize();
  // Decode by the specification, independently of the reader.
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  ASSERT_EQ((8 + n) % 8, 0u);  // data starts 8-aligned
  ASSERT_EQ(bytes.size(), 8 + n + 14);
  const nlohmann::json h = nlohmann::json::parse(bytes.substr(8, n));
  EXPECT_EQ(h["__metadata__"]["format"], "pt");
  EXPECT_EQ(h["z.weight"]["dtype"], "F32");
  EXPECT_EQ(h["z.weight"]["shape"], nlohmann::json({3}));
  EXPECT_EQ(h["z.weight"]["data_offsets"], nlohmann::json({0, 12}));
  EXPECT_EQ(h["a.scale"]["dtype"], "F8_E4M3");
  EXPECT_EQ(h["a.scale"]["data_offsets"], nlohmann::json({12, 14}));
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + n, a.data(), 12), 0);
  EXPECT_EQ(static_cast<uint8_t>(bytes[8 + n + 13]), 9);
}

TEST(SafetensorsTest, OpenMapsAFile) {
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/m.safetensors";
  SafetensorsWriter w;
  std::vector<uint16_t> v(1000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint16_t>(i * 7);
  ASSERT_TRUE(w.Add("x", StDtype::kBf16, {10, 100},
                    absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(v.data()), 2000))
                  .ok());
  ASSERT_TRUE(w.WriteFile(path).ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  const StTensor* x = (*f)->Find("x");
  ASSERT_NE(x, nullptr);
  EXPECT_EQ(std::memcmp(x->data, v.data(), 2000), 0);
  EXPECT_EQ(*x->file, path);
  EXPECT_EQ(absl::StatusCode::kNotFound, SafetensorsFile::Open(path + ".missing").status().code());
}

TEST(SafetensorsTest, EmptyTensorsAndHolesAreFine) {
  EXPECT_TRUE(ParseStatus(R"({"e":{"dtype":"F32","shape":[0,5],"data_offsets":[4,4]},)"
                          R"("x":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                          std::string(12, '\0'))
                  .ok());
}

TEST(SafetensorsTest, HeaderLongerThanFile) {
  std::string file = SpecFile("{}", "");
  file[0] = 100;  // claims a 100-byte header
  const absl::Status s = SafetensorsFile::FromBytes(file, "t.safetensors").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("truncated"), std::string::npos) << s;
  EXPECT_FALSE(SafetensorsFile::FromBytes("abc", "t").ok());
}

TEST(SafetensorsTest, HugeHeaderLengthRefused) {
  std::string file = SpecFile("{}", "");
  file[7] = 0x7F;
  EXPECT_NE(std::string(SafetensorsFile::FromBytes(file, "t.safetensors").status().message())
                .find("100 MB"),
            std::string::npos);
}

TEST(SafetensorsTest, BadJson) { ExpectError("{\"a\": ", "", "not a JSON object"); }

TEST(SafetensorsTest, UnknownDtype) {
  ExpectError(R"({"a":{"dtype":"F12","shape":[1],"data_offsets":[0,4]}})", std::string(4, 0),
              "unknown safetensors dtype \"F12\"");
}

TEST(SafetensorsTest, SizeDoesNotMatchShape) {
  ExpectError(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", std::string(4, 0),
              "tensor \"a\": data_offsets [0, 4] hold 4 bytes but F32 [2] needs 8");
}

TEST(SafetensorsTest, OffsetsPastTheEnd) {
  ExpectError(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(4, 0),
              "tensor \"a\": data_offsets [0, 8] run past the end");
}

TEST(SafetensorsTest, OffsetsReversed) {
  ExpectError(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})", std::string(4, 0),
              "end before they begin");
}

TEST(SafetensorsTest, OverlappingTensors) {
  ExpectError(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
              R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
              std::string(12, 0), "overlap");
}

TEST(SafetensorsTest, ShapeOverflowRefused) {
  ExpectError(R"({"a":{"dtype":"F64","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}})",
              std::string(8, 0), "tensor \"a\"");
  ExpectError(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", std::string(4, 0),
              "non-negative");
  ExpectError(R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", std::string(4, 0),
              "non-negative");
}

TEST(SafetensorsTest, BadEntries) {
  ExpectError(R"({"a":3})", "", "entry must be an object");
  ExpectError(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", std::string(4, 0), "dtype");
  ExpectError(R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", std::string(4, 0), "shape");
  ExpectError(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", std::string(4, 0),
              "data_offsets");
  ExpectError(R"({"__metadata__":{"k":1}})", "", "__metadata__");
}

TEST(SafetensorsTest, CheckpointIndexRejectsPaths) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/idx";
  ASSERT_EQ(std::system(("mkdir -p " + dir).c_str()), 0);
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"weight_map": {"a": "../../etc/passwd"}})";
  absl::StatusOr<std::unique_ptr<Checkpoint>> c = Checkpoint::Open(dir);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(std::string(c.status().message()).find("not a file name in the folder"),
            std::string::npos)
      << c.status();
  std::ofstream(dir + "/model.safetensors.index.json") << R"({"weight_map": [})";
  c = Checkpoint::Open(dir);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(std::string(c.status().message()).find("model.safetensors.index.json"),
            std::string::npos);
}

}  // namespace
}  // namespace moe::engine
