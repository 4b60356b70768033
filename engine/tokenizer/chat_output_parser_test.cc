#include "engine/tokenizer/chat_output_parser.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moe::tokenizer {
namespace {

struct Collected {
  std::string content, reasoning;
  std::vector<ToolCall> calls;
  void Add(const ChatDelta& d) {
    content += d.content;
    reasoning += d.reasoning;
    calls.insert(calls.end(), d.tool_calls.begin(), d.tool_calls.end());
  }
};

Collected Parse(const std::vector<std::string>& pieces, bool starts_in_reasoning = false,
                bool parse_tool_calls = true) {
  ChatOutputParser parser(starts_in_reasoning, parse_tool_calls);
  Collected c;
  for (const std::string& p : pieces) c.Add(parser.Feed(p));
  c.Add(parser.Finish());
  return c;
}

const char kFull[] =
    "<think>\nI should call the tool.\n</think>\n\nLet me check."
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n"
    "</tool_call>\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"<think> 中文\"}}\n"
    "</tool_call>";

void ExpectFull(const Collected& c, const std::string& where) {
  EXPECT_EQ(c.reasoning, "\nI should call the tool.\n") << where;
  EXPECT_EQ(c.content, "\n\nLet me check.\n") << where;
  ASSERT_EQ(c.calls.size(), 2u) << where;
  EXPECT_EQ(c.calls[0].index, 0);
  EXPECT_EQ(c.calls[0].name, "get_weather");
  EXPECT_EQ(nlohmann::json::parse(c.calls[0].arguments_json),
            nlohmann::json::parse(R"({"city": "Paris", "days": 3})"));
  EXPECT_TRUE(c.calls[0].error.empty());
  EXPECT_EQ(c.calls[1].index, 1);
  EXPECT_EQ(c.calls[1].name, "search");
  EXPECT_EQ(nlohmann::json::parse(c.calls[1].arguments_json)["q"], "<think> 中文") << where;
}

TEST(ChatOutputParserTest, WholeText) { ExpectFull(Parse({kFull}), "whole"); }

TEST(ChatOutputParserTest, EverySplitPointInTwoPieces) {
  const std::string full = kFull;
  for (size_t i = 0; i <= full.size(); ++i) {
    ExpectFull(Parse({full.substr(0, i), full.substr(i)}), "split at " + std::to_string(i));
  }
}

TEST(ChatOutputParserTest, EverySplitPointPairInThreePieces) {
  const std::string full = kFull;
  for (size_t i = 0; i <= full.size(); i += 3) {
    for (size_t j = i; j <= full.size(); j += 2) {
      ExpectFull(Parse({full.substr(0, i), full.substr(i, j - i), full.substr(j)}),
                 "split at " + std::to_string(i) + "," + std::to_string(j));
    }
  }
}

TEST(ChatOutputParserTest, ByteAtATimeNeverEmitsTagText) {
  ChatOutputParser parser;
  Collected c;
  for (char ch : std::string(kFull)) {
    const ChatDelta d = parser.Feed(std::string(1, ch));
    // A piece of a tag is never released as text.
    EXPECT_EQ(d.content.find('<'), std::string::npos);
    EXPECT_EQ(d.reasoning.find('<'), std::string::npos);
    c.Add(d);
  }
  c.Add(parser.Finish());
  ExpectFull(c, "byte at a time");
}

TEST(ChatOutputParserTest, StartsInReasoning) {
  const Collected c = Parse({"thinking...", "</thi", "nk>answer"}, /*starts_in_reasoning=*/true);
  EXPECT_EQ(c.reasoning, "thinking...");
  EXPECT_EQ(c.content, "answer");
}

TEST(ChatOutputParserTest, MalformedJsonBecomesAnErrorCall) {
  const Collected c =
      Parse({"a<tool_call>{\"name\": \"f\", \"arguments\": {oops}</tool_call>b",
             "<tool_call>[1, 2]</tool_call><tool_call>{\"arguments\": {}}</tool_call>",
             "<tool_call>{\"name\": \"g\", \"arguments\": \"not json\"}</tool_call>",
             "<tool_call>{\"name\": \"h\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call>"});
  EXPECT_EQ(c.content, "ab");
  ASSERT_EQ(c.calls.size(), 5u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_FALSE(c.calls[i].error.empty()) << i;
    EXPECT_FALSE(c.calls[i].raw.empty()) << i;
    EXPECT_TRUE(c.calls[i].name.empty()) << i;
    EXPECT_EQ(c.calls[i].index, i);
  }
  EXPECT_EQ(c.calls[0].raw, "{\"name\": \"f\", \"arguments\": {oops}");
  EXPECT_TRUE(c.calls[4].error.empty());
  EXPECT_EQ(c.calls[4].name, "h");
  EXPECT_EQ(c.calls[4].arguments_json, "{\"x\": 1}");
}

TEST(ChatOutputParserTest, UnterminatedBlocks) {
  Collected c = Parse({"hi <tool_call>{\"name\": \"f\", \"argum"});
  EXPECT_EQ(c.content, "hi ");
  ASSERT_EQ(c.calls.size(), 1u);
  EXPECT_EQ(c.calls[0].error, "unterminated <tool_call>");
  EXPECT_EQ(c.calls[0].raw, "{\"name\": \"f\", \"argum");

  c = Parse({"<think>never closed"});
  EXPECT_EQ(c.reasoning, "never closed");
  EXPECT_EQ(c.content, "");

  // A partial tag at the end of the stream is plain text.
  c = Parse({"text <tool_ca"});
  EXPECT_EQ(c.content, "text <tool_ca");
  c = Parse({"<think>r</thi"});
  EXPECT_EQ(c.reasoning, "r</thi");
}

TEST(ChatOutputParserTest, ToolCallParsingOff) {
  const Collected c =
      Parse({"<tool_call>{\"name\": \"f\"}</tool_call>"}, false, /*parse_tool_calls=*/false);
  EXPECT_EQ(c.content, "<tool_call>{\"name\": \"f\"}</tool_call>");
  EXPECT_TRUE(c.calls.empty());
}

TEST(ChatOutputParserTest, TagsInsideReasoningAreText) {
  const Collected c = Parse({"<think>maybe <tool_call>{}</tool_call> later</think>done"});
  EXPECT_EQ(c.reasoning, "maybe <tool_call>{}</tool_call> later");
  EXPECT_EQ(c.content, "done");
  EXPECT_TRUE(c.calls.empty());
}

TEST(ChatOutputParserTest, NoArgumentsMeansEmptyObject) {
  const Collected c = Parse({"<tool_call>{\"name\": \"ping\"}</tool_call>"});
  ASSERT_EQ(c.calls.size(), 1u);
  EXPECT_EQ(c.calls[0].name, "ping");
  EXPECT_EQ(c.calls[0].arguments_json, "{}");
}

}  // namespace
}  // namespace moe::tokenizer
