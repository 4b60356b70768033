// Bounded random testing of the Qwen3 tokenizer (about 2 s): random strings built from pieces
// that stress the pipeline (all Unicode planes, combining marks, ZWJ emoji, whitespace runs,
// digits, tag-like text, raw bytes). For every input: no crash; streaming decode pieces are valid
// UTF-8 and concatenate to Decode(); for valid UTF-8 without added-token text, Decode(Encode(x))
// equals the NFC form of x (computed by ICU directly; NFC is the file's normalizer).
#include <unicode/normalizer2.h>
#include <unicode/unistr.h>

#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "engine/tokenizer/internal/utf8.h"
#include "engine/tokenizer/tokenizer.h"
#include "gtest/gtest.h"

namespace moe::tokenizer {
namespace {

std::string Nfc(const std::string& s) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(status);
  std::string out;
  icu::StringByteSink<std::string> sink(&out);
  nfc->normalizeUTF8(0, s, sink, nullptr, status);
  EXPECT_TRUE(U_SUCCESS(status));
  return out;
}

TEST(TokenizerFuzzTest, RoundTripAndStreaming) {
  auto tok = Tokenizer::FromDirectory("third_party/qwen3_tokenizer");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const Tokenizer& t = **tok;
  std::mt19937 rng(12345);
  auto rnd = [&](uint32_t n) { return rng() % n; };
  const std::vector<std::string> fragments = {" ",
                                              "  ",
                                              "\t",
                                              "\n",
                                              "\r\n",
                                              "\u00a0",
                                              "\u3000",
                                              "'s",
                                              "'LL",
                                              "a",
                                              "Z",
                                              "hello",
                                              "0",
                                              "123",
                                              "½",
                                              "٣",
                                              "é",
                                              "e\u0301",
                                              "\u0915\u094d",
                                              "中",
                                              "語",
                                              "한",
                                              "🙂",
                                              "👍🏽",
                                              "\u200d",
                                              "🏳\ufe0f",
                                              "\U0001F1FA\U0001F1F8",
                                              "<",
                                              "|",
                                              ">",
                                              "<|im",
                                              "_end|>",
                                              "<think",
                                              "</",
                                              "{",
                                              "\"",
                                              "\\",
                                              "\xe2\x82",
                                              "\xff",
                                              "\xc0",
                                              "\xed\xa0\x80",
                                              "\xf0\x9f"};
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(2000);
  int cases = 0, round_trips = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    std::string s;
    const int n = 1 + rnd(24);
    for (int i = 0; i < n; ++i) {
      if (rnd(4) == 0) {
        // Any code point, from any plane (surrogates excluded: not encodable in UTF-8).
        char32_t c = rnd(3) == 0 ? rnd(0x80) : rnd(0x110000);
        if (c >= 0xD800 && c <= 0xDFFF) c = 'x';
        internal::AppendUtf8(c, &s);
      } else {
        s += fragments[rnd(fragments.size())];
      }
    }
    ++cases;
    const std::vector<int32_t> ids = t.Encode(s);
    const std::string decoded = t.Decode(ids);
    ASSERT_TRUE(internal::IsValidUtf8(decoded));
    IncrementalDecoder stream(t);
    std::string streamed;
    for (int32_t id : ids) {
      const std::string piece = stream.Add(id);
      ASSERT_TRUE(internal::IsValidUtf8(piece)) << "piece of " << s;
      streamed += piece;
    }
    streamed += stream.Flush();
    ASSERT_EQ(streamed, decoded);
    const bool has_added = s.find("<|") != std::string::npos ||
                           s.find("<think") != std::string::npos ||
                           s.find("</") != std::string::npos;
    if (internal::IsValidUtf8(s) && !has_added) {
      ASSERT_EQ(decoded, Nfc(s));
      ++round_trips;
    }
  }
  std::printf("%d random inputs, %d checked for an exact round trip\n", cases, round_trips);
  EXPECT_GT(round_trips, 100);
}

}  // namespace
}  // namespace moe::tokenizer
