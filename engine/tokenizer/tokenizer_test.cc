// Tokenizer on the vendored Qwen3 tokenizer.json (accessors, streaming decode, threads) and on
// malformed or unsupported tokenizer.json files (errors, never aborts).
#include "engine/tokenizer/tokenizer.h"

#include <string>
#include <thread>
#include <vector>

#include "engine/tokenizer/internal/utf8.h"
#include "gtest/gtest.h"

namespace moe::tokenizer {
namespace {

const Tokenizer& Qwen3() {
  static const Tokenizer* const t = [] {
    auto r = Tokenizer::FromDirectory("third_party/qwen3_tokenizer");
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->release() : nullptr;
  }();
  return *t;
}

TEST(TokenizerTest, Qwen3Accessors) {
  const Tokenizer& t = Qwen3();
  EXPECT_EQ(t.vocab_size(), 151669);
  EXPECT_EQ(t.TokenToId("<|im_end|>"), 151645);
  EXPECT_EQ(t.TokenToId("<think>"), 151667);
  EXPECT_EQ(t.TokenToId("Hello"), 9707);
  EXPECT_FALSE(t.TokenToId("no such token").has_value());
  EXPECT_EQ(t.IdToToken(151644), "<|im_start|>");
  EXPECT_EQ(t.IdToToken(1879), "Ġworld");
  EXPECT_EQ(t.IdToToken(-1), "");
  EXPECT_EQ(t.IdToToken(10000000), "");
  EXPECT_TRUE(t.IsSpecial(151645));
  EXPECT_FALSE(t.IsSpecial(151667));  // <think> is an added token but not special
  EXPECT_FALSE(t.IsSpecial(9707));
}

TEST(TokenizerTest, SpecialTokensAreMatchedBeforeBpeAndSkippedOnRequest) {
  const Tokenizer& t = Qwen3();
  const std::vector<int32_t> ids = t.Encode("<|im_start|>user\nHi<|im_end|>");
  ASSERT_GE(ids.size(), 4u);
  EXPECT_EQ(ids.front(), 151644);
  EXPECT_EQ(ids.back(), 151645);
  EXPECT_EQ(t.Decode(ids), "<|im_start|>user\nHi<|im_end|>");
  EXPECT_EQ(t.Decode(ids, /*skip_special_tokens=*/true), "user\nHi");
  // Ids outside the vocabulary are skipped, not fatal.
  const std::vector<int32_t> odd = {9707, -5, 999999999, 1879};
  EXPECT_EQ(t.Decode(odd), "Hello world");
}

TEST(TokenizerTest, InvalidUtf8IsReplacedLikePython) {
  const Tokenizer& t = Qwen3();
  // b'a\xe2\x82b\xff'.decode('utf-8', 'replace') == 'a\ufffdb\ufffd'
  EXPECT_EQ(t.Encode("a\xE2\x82"
                     "b\xFF"),
            t.Encode("a\xEF\xBF\xBD"
                     "b\xEF\xBF\xBD"));
  EXPECT_EQ(internal::ReplaceInvalidUtf8("\xF0\x9F\x98"), "\xEF\xBF\xBD");
  EXPECT_EQ(internal::ReplaceInvalidUtf8("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(internal::ReplaceInvalidUtf8("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(TokenizerTest, IncrementalDecoderNeverSplitsUtf8) {
  const Tokenizer& t = Qwen3();
  const std::string text = "Emoji 👨‍👩‍👧 and 中文 and 🏳️‍🌈 done";
  const std::vector<int32_t> ids = t.Encode(text);
  IncrementalDecoder d(t);
  std::string all;
  int pieces_held = 0;
  for (int32_t id : ids) {
    const std::string piece = d.Add(id);
    if (piece.empty()) ++pieces_held;
    EXPECT_TRUE(internal::IsValidUtf8(piece));
    EXPECT_EQ(piece.find("\xEF\xBF\xBD"), std::string::npos) << "a U+FFFD leaked mid-character";
    all += piece;
  }
  all += d.Flush();
  EXPECT_EQ(all, text);
  EXPECT_GT(pieces_held, 0) << "the emoji should span byte-level tokens";
}

TEST(TokenizerTest, IncrementalDecoderFlushesAnIncompleteTail) {
  const Tokenizer& t = Qwen3();
  // The first byte-level token of a 4-byte emoji alone: incomplete at the end of the stream.
  const std::vector<int32_t> ids = t.Encode("𠀀");  // 3 byte-level tokens
  ASSERT_GE(ids.size(), 2u);
  IncrementalDecoder d(t);
  EXPECT_EQ(d.Add(ids[0]), "");
  EXPECT_EQ(d.Flush(), t.Decode({ids[0]}));
  EXPECT_EQ(d.Flush(), "");
}

TEST(TokenizerTest, ConcurrentEncodesAgree) {
  const Tokenizer& t = Qwen3();
  std::vector<std::string> texts;
  for (int i = 0; i < 200; ++i)
    texts.push_back("word" + std::to_string(i * 7919) + " and more text " + std::to_string(i));
  std::vector<std::vector<int32_t>> want;
  for (const std::string& s : texts) want.push_back(t.Encode(s));
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (int rep = 0; rep < 5; ++rep) {
        for (size_t i = 0; i < texts.size(); ++i) mismatches[k] += t.Encode(texts[i]) != want[i];
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int m : mismatches) EXPECT_EQ(m, 0);
}

TEST(TokenizerTest, MalformedFilesAreInvalidArgument) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"not json", "not valid JSON"},
      {"[]", "not a JSON object"},
      {"{}", "no model"},
      {R"({"model": {"type": "WordPiece", "vocab": {}}})", "WordPiece"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}})", "merges[0]"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["ab"]}})", "merges[0]"},
      {R"({"model": {"type": "BPE", "vocab": {"a": "zero"}, "merges": []}})", "vocab"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [], "dropout": 0.1}})", "dropout"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "normalizer": {"type": "BertNormalizer"}})",
       "normalizer"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "pre_tokenizer": {"type": "Metaspace"}})",
       "pre_tokenizer"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(unclosed"}, "behavior": "Isolated"}})",
       "regex"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "decoder": {"type": "CTC"}})", "decoder"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "added_tokens": [{"content": "x"}]})",
       "added_tokens[0]"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0}, "byte_fallback": "yes"}})", "byte_fallback"},
  };
  for (const auto& [json, needle] : cases) {
    auto t = Tokenizer::FromJson(json);
    ASSERT_FALSE(t.ok()) << json;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << json;
    EXPECT_NE(t.status().message().find(needle), std::string::npos) << t.status();
  }
  EXPECT_EQ(Tokenizer::FromFile("/nonexistent/tokenizer.json").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace moe::tokenizer
