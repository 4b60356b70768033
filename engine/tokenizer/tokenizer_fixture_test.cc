// Checks //engine/tokenizer against Hugging Face tokenizers on a fixture it produced
// (testdata/make_tokenizer_fixture.mjs): every id, every decode (with and without special tokens)
// and the streaming decode of every case must match. The fixture path and the tokenizer.json it
// was made from are the test's two arguments (runfile paths).
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "engine/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moe::tokenizer {
namespace {

std::vector<std::string> g_args;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string Unbase64(const nlohmann::json& j) {
  std::string out;
  EXPECT_TRUE(absl::Base64Unescape(j.get<std::string>(), &out));
  return out;
}

TEST(TokenizerFixtureTest, MatchesHuggingFace) {
  ASSERT_EQ(g_args.size(), 2u) << "usage: tokenizer_fixture_test TOKENIZER_JSON FIXTURE_JSON";
  auto tok = Tokenizer::FromFile(g_args[0]);
  ASSERT_TRUE(tok.ok()) << tok.status();
  const nlohmann::json fixture = nlohmann::json::parse(ReadFile(g_args[1]));
  const nlohmann::json& cases = fixture["cases"];
  ASSERT_GT(cases.size(), 0u);
  std::map<std::string, int> per_category, failures;
  int failed = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const nlohmann::json& c = cases[i];
    const std::string cat = c["cat"];
    ++per_category[cat];
    const std::string text = Unbase64(c["text"]);
    const std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
    const std::string want_decode = c.contains("decode") ? Unbase64(c["decode"]) : text;
    const std::string want_skip = c.contains("decode_skip") ? Unbase64(c["decode_skip"]) : text;
    const std::vector<int32_t> got = (*tok)->Encode(text);
    const std::vector<int32_t> want_special =
        c.contains("ids_with_special") ? c["ids_with_special"].get<std::vector<int32_t>>() : want;
    const std::vector<int32_t> got_special = (*tok)->Encode(text, /*add_special_tokens=*/true);
    const std::string decode = (*tok)->Decode(want);
    const std::string decode_skip = (*tok)->Decode(want, /*skip_special_tokens=*/true);
    IncrementalDecoder stream(**tok);
    std::string streamed;
    for (int32_t id : want) streamed += stream.Add(id);
    streamed += stream.Flush();
    const bool ok = got == want && got_special == want_special && decode == want_decode &&
                    decode_skip == want_skip && streamed == decode;
    if (!ok) {
      ++failures[cat];
      if (++failed <= 10) {
        ADD_FAILURE() << "case " << i << " (" << cat << ") text=" << nlohmann::json(text).dump()
                      << "\n ids " << (got == want ? "ok" : "DIFFER") << ": got "
                      << nlohmann::json(got).dump() << "\n want " << nlohmann::json(want).dump()
                      << "\n with special tokens "
                      << (got_special == want_special ? "ok" : "DIFFER") << "\n decode "
                      << (decode == want_decode ? "ok" : "DIFFERS") << ", skip-special decode "
                      << (decode_skip == want_skip ? "ok" : "DIFFERS") << ", streamed "
                      << (streamed == decode ? "ok" : "DIFFERS");
      }
    }
  }
  for (const auto& [cat, n] : per_category) {
    EXPECT_EQ(failures[cat], 0) << cat << ": " << failures[cat] << " of " << n << " cases differ";
  }
  std::cout << cases.size() << " cases from " << fixture["reference"] << ", " << failed
            << " differ\n";
}

}  // namespace
}  // namespace moe::tokenizer

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) moe::tokenizer::g_args.push_back(argv[i]);
  return RUN_ALL_TESTS();
}
