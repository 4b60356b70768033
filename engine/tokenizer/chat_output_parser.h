// ChatOutputParser: splits generated text, as it streams in, into reasoning (`<think>...</think>`),
// answer content and tool calls (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`), so a
// server can send OpenAI-style `reasoning_content`, `content` and `tool_calls` deltas. Tags split
// across pieces are handled: text that may be the start of a tag is held back until it is known.
//
// Not thread-safe (one per stream).
#ifndef MOE_ENGINE_TOKENIZER_CHAT_OUTPUT_PARSER_H_
#define MOE_ENGINE_TOKENIZER_CHAT_OUTPUT_PARSER_H_

#include <string>
#include <string_view>
#include <vector>

namespace moe::tokenizer {

struct ToolCall {
  int index = 0;               // 0, 1, ... in order of appearance
  std::string name;
  std::string arguments_json;  // the arguments object serialised as JSON text
  // Non-empty when the block did not parse (malformed JSON, no name): the raw block text is
  // then in `raw` and nothing else is set.
  std::string error;
  std::string raw;
};

struct ChatDelta {
  std::string content;
  std::string reasoning;
  std::vector<ToolCall> tool_calls;  // completed tool calls (each reported once)
  bool empty() const { return content.empty() && reasoning.empty() && tool_calls.empty(); }
};

class ChatOutputParser {
 public:
  // starts_in_reasoning: the prompt already opened a <think> block (Qwen3's template does for
  // thinking-mode generation prompts in some versions), so text is reasoning until </think>.
  explicit ChatOutputParser(bool starts_in_reasoning = false, bool parse_tool_calls = true);
  ChatDelta Feed(std::string_view text);
  // End of stream: releases held-back text; an unterminated <tool_call> becomes an error call.
  ChatDelta Finish();

 private:
  enum class State { kContent, kReasoning, kToolCall };
  ChatDelta Drain(bool final);

  State state_;
  bool parse_tool_calls_;
  std::string pending_;
  int next_index_ = 0;
};

}  // namespace moe::tokenizer

#endif  // MOE_ENGINE_TOKENIZER_CHAT_OUTPUT_PARSER_H_
