// Bounded fuzzing of the loader's input parsing: random mutations of a valid safetensors file
// (bytes of the header, JSON tokens, the length prefix, truncation) and of a model folder's
// header and config.json. Every input must give a Status or a model, never a crash or a read
// outside the file (run under --config=asan to check the latter). About 3 seconds in all.
#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/loader.h"
#include "engine/loader_test_util.h"
#include "engine/safetensors.h"
#include "gtest/gtest.h"

namespace moe::engine {
namespace {

using Clock = std::chrono::steady_clock;

// Reads every byte of every tensor, so that ASan sees any pointer outside the data.
uint64_t Touch(const std::vector<StTensor>& tensors) {
  uint64_t sum = 0;
  for (const StTensor& t : tensors) {
    for (uint64_t i = 0; i < t.bytes; ++i) sum += t.data[i];
  }
  return sum;
}

std::string ValidFile() {
  SafetensorsWriter w;
  std::vector<uint8_t> bytes(4096);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 31);
  auto span = [&](size_t n) { return absl::MakeConstSpan(bytes.data(), n); };
  EXPECT_TRUE(w.Add("model.layers.0.mlp.gate.weight", StDtype::kBf16, {8, 16}, span(256)).ok());
  EXPECT_TRUE(w.Add("model.norm.weight", StDtype::kF32, {16}, span(64)).ok());
  EXPECT_TRUE(w.Add("q.weight", StDtype::kF8E4M3, {16, 32}, span(512)).ok());
  EXPECT_TRUE(w.Add("q.weight_scale_inv", StDtype::kF32, {1, 1}, span(4)).ok());
  EXPECT_TRUE(w.Add("empty", StDtype::kF16, {0, 3}, span(0)).ok());
  w.SetMetadata("format", "pt");
  return w.Serialize();
}

std::string Mutate(std::string s, std::mt19937_64& rng) {
  static const char* kTokens[] = {"-1",
                                  "0",
                                  "1e30",
                                  "[]",
                                  "{}",
                                  "null",
                                  "\"F8_E4M3\"",
                                  "\"I64\"",
                                  "18446744073709551615",
                                  "9223372036854775807",
                                  "[0,0]",
                                  "\"shape\"",
                                  "\"data_offsets\"",
                                  "\"dtype\"",
                                  ",",
                                  ":",
                                  "\"",
                                  "[4294967296,4294967296]",
                                  "1.5",
                                  "true"};
  uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = (header << 8) | static_cast<uint8_t>(s[i]);
  const size_t hend = std::min<size_t>(s.size(), 8 + header);
  const int rounds = 1 + static_cast<int>(rng() % 4);
  for (int r = 0; r < rounds && !s.empty(); ++r) {
    const size_t pos = rng() % s.size();
    const size_t hpos = 8 + rng() % std::max<size_t>(1, hend - 8);
    switch (rng() % 8) {
      case 0:  // flip a byte anywhere
        s[pos] = static_cast<char>(s[pos] ^ (1 << (rng() % 8)));
        break;
      case 1:  // a digit of the header becomes another digit
        for (size_t i = hpos; i < hend; ++i) {
          if (s[i] >= '0' && s[i] <= '9') {
            s[i] = static_cast<char>('0' + rng() % 10);
            break;
          }
        }
        break;
      case 2: {  // a JSON token replaces a stretch of the header
        const std::string tok = kTokens[rng() % (sizeof(kTokens) / sizeof(kTokens[0]))];
        if (hpos < s.size()) s.replace(hpos, std::min<size_t>(rng() % 6, s.size() - hpos), tok);
        break;
      }
      case 3:  // truncate
        s.resize(rng() % (s.size() + 1));
        break;
      case 4:  // rewrite the length prefix
        if (s.size() >= 8) {
          const uint64_t n = rng() % 3 == 0 ? rng() : header + (rng() % 17) - 8;
          for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
        }
        break;
      case 5:  // delete a byte of the header
        if (hpos < s.size()) s.erase(hpos, 1);
        break;
      case 6:  // duplicate a stretch of the header
        if (hpos + 8 < s.size()) s.insert(hpos, s.substr(hpos, 8));
        break;
      default:  // a random byte in the header
        if (hpos < s.size()) s[hpos] = static_cast<char>(rng());
    }
  }
  return s;
}

TEST(LoaderFuzzTest, SafetensorsHeaders) {
  const std::string valid = ValidFile();
  ASSERT_TRUE(SafetensorsFile::FromBytes(valid, "valid").ok());
  std::mt19937_64 rng(12345);
  const auto deadline = Clock::now() + std::chrono::milliseconds(1000);
  int runs = 0, accepted = 0;
  uint64_t sink = 0;
  while (Clock::now() < deadline) {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
        SafetensorsFile::FromBytes(Mutate(valid, rng), "fuzz");
    ++runs;
    if (f.ok()) {
      ++accepted;
      sink += Touch((*f)->tensors());
    } else {
      EXPECT_FALSE(f.status().message().empty());
    }
  }
  std::printf("%d mutated files, %d accepted (checksum %llu)\n", runs, accepted,
              static_cast<unsigned long long>(sink));
  EXPECT_GT(runs, 100);
  EXPECT_LT(accepted, runs);  // the mutations do reach the checks
}

TEST(LoaderFuzzTest, ModelFolders) {
  absl::StatusOr<std::string> dir =
      testing::MakeTinyModel("fuzz_model",
                             "--family qwen2_moe --layers 1 --experts 4 --vocab 32 --hidden 32 "
                             "--moe_intermediate 32 --intermediate 32 --shared_intermediate 32");
  ASSERT_TRUE(dir.ok()) << dir.status();
  const std::string st = *dir + "/model.safetensors", cfg = *dir + "/config.json";
  const std::string st_bytes = testing::ReadFile(st), cfg_bytes = testing::ReadFile(cfg);
  LoadOptions o;
  o.threads = 1;
  o.progress = false;
  o.expert_format = common::WeightFormat::kQ4_0;
  ASSERT_TRUE(LoadModel(*dir, o).ok());
  std::mt19937_64 rng(777);
  const auto deadline = Clock::now() + std::chrono::milliseconds(1000);
  int runs = 0, loaded = 0;
  while (Clock::now() < deadline) {
    const bool mutate_config = rng() % 4 == 0;
    if (mutate_config) {
      std::string c = cfg_bytes;
      for (int r = 0; r < 1 + static_cast<int>(rng() % 3); ++r) {
        const size_t pos = rng() % c.size();
        if (c[pos] >= '0' && c[pos] <= '9' && rng() % 2 == 0) {
          c[pos] = static_cast<char>('0' + rng() % 10);
        } else {
          c[pos] = static_cast<char>(rng());
        }
      }
      testing::WriteFile(cfg, c);
      testing::WriteFile(st, st_bytes);
    } else {
      testing::WriteFile(cfg, cfg_bytes);
      testing::WriteFile(st, Mutate(st_bytes, rng));
    }
    absl::StatusOr<std::unique_ptr<ModelWeights>> w = LoadModel(*dir, o);
    ++runs;
    if (w.ok()) ++loaded;
  }
  std::printf("%d mutated model folders, %d loaded\n", runs, loaded);
  EXPECT_GT(runs, 20);
}

TEST(LoaderFuzzTest, ShardIndexes) {
  absl::StatusOr<std::string> dir =
      testing::MakeTinyModel("fuzz_index",
                             "--family qwen3_moe --layers 1 --experts 4 --vocab 32 --hidden 32 "
                             "--moe_intermediate 32 --heads 2 --head_dim 16 --shards 3");
  ASSERT_TRUE(dir.ok()) << dir.status();
  const std::string path = *dir + "/model.safetensors.index.json";
  const std::string valid = testing::ReadFile(path);
  LoadOptions o;
  o.threads = 1;
  o.progress = false;
  ASSERT_TRUE(LoadModel(*dir, o).ok());
  static const char* kNames[] = {"\"model-00001-of-00003.safetensors\"",
                                 "\"../config.json\"",
                                 "\"\"",
                                 "\"config.json\"",
                                 "null",
                                 "3",
                                 "{}",
                                 "\"/etc/hosts\""};
  std::mt19937_64 rng(99);
  const auto deadline = Clock::now() + std::chrono::milliseconds(700);
  int runs = 0;
  while (Clock::now() < deadline) {
    std::string s = valid;
    for (int r = 0; r < 1 + static_cast<int>(rng() % 3); ++r) {
      const size_t pos = rng() % s.size();
      if (rng() % 2 == 0) {
        // Point a weight_map entry elsewhere: at another shard, out of the folder, at a non-file.
        const size_t q = s.find("\"model-0000", pos);
        if (q != std::string::npos) {
          s.replace(q, 34, kNames[rng() % (sizeof(kNames) / sizeof(kNames[0]))]);
        }
      } else {
        s[pos] = static_cast<char>(rng());
      }
    }
    testing::WriteFile(path, s);
    absl::StatusOr<std::unique_ptr<ModelWeights>> w = LoadModel(*dir, o);
    ++runs;
  }
  std::printf("%d mutated indexes\n", runs);
  EXPECT_GT(runs, 10);
}

}  // namespace
}  // namespace moe::engine
