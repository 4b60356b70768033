// OpenAI API request parsing and response assembly for the HTTP front: /v1/completions and
// /v1/chat/completions bodies in, engine requests out; engine events in, OpenAI-shaped JSON
// (whole responses and server-sent-event chunks) out. No I/O and no engine calls besides the
// tokenizer and chat template, so every function here can be fuzzed on its own.
//
// Parse errors are InvalidArgument naming the field ("max_tokens: ...").
#ifndef MOE_SERVING_OPENAI_H_
#define MOE_SERVING_OPENAI_H_

#include <cstdint>
#include <memory>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "engine/tokenizer/chat_output_parser.h"
#include "nlohmann/json.hpp"

namespace moe::serving {

using Json = nlohmann::ordered_json;

struct RequestLimits {
  int max_n = 8;           // choices per request
  int max_context = 4096;  // the engine's; bounds max_tokens
  int max_stop = 16;       // stop strings per request
  int default_completion_tokens = 16;  // /v1/completions without max_tokens (OpenAI's default)
};

enum class ToolChoice { kAuto, kNone, kRequired, kNamed };

struct OpenAiRequest {
  bool chat = false;
  std::string model;
  // /v1/completions: text or token ids.
  std::string prompt_text;
  std::vector<int32_t> prompt_ids;
  // /v1/chat/completions.
  Json messages;
  Json tools;  // null without tools
  ToolChoice tool_choice = ToolChoice::kAuto;
  std::string tool_name;  // with kNamed
  Json template_kwargs = Json::object();
  engine::SamplingParams sampling;
  bool max_tokens_given = false;
  int n = 1;
  bool stream = false;
  bool include_usage = false;
  bool logprobs = false;
  int top_logprobs = 0;
  bool echo = false;  // completions only
};

// Parses and checks a request body. `served_model` is the one name `model` may have (empty or
// absent is accepted too).
absl::StatusOr<OpenAiRequest> ParseOpenAiRequest(absl::string_view body, bool chat,
                                                 absl::string_view served_model,
                                                 const RequestLimits& limits);

// The prompt as the engine gets it.
struct PreparedPrompt {
  std::vector<int32_t> prompt_ids;  // empty when only text could be given (no tokenizer)
  std::string prompt_text;
  std::vector<int32_t> forced_output_ids;  // the tool-call prefix for `required` / a named tool
  bool starts_in_reasoning = false;        // the rendered prompt opened a <think> block
  bool parse_tool_calls = false;
};

// Renders chat messages through the model's chat template and tokenizes; applies tool_choice;
// resolves max_tokens (chat without one: the rest of the context); refuses prompt + max_tokens
// over the context naming both numbers.
absl::StatusOr<PreparedPrompt> PreparePrompt(OpenAiRequest& request, const engine::Engine& engine,
                                             const RequestLimits& limits);

// One choice's output as it streams: text, reasoning, tool calls, logprobs, finish reason.
// Not thread-safe (one per choice); the tokenizer (may be null) must outlive it.
class ChoiceBuilder {
 public:
  ChoiceBuilder(const OpenAiRequest& request, const PreparedPrompt& prompt,
                const tokenizer::Tokenizer* tokenizer);

  // What one event adds, as a stream chunk's choice object ({"index", "delta" or "text",
  // "logprobs", "finish_reason"}); null when the event adds nothing worth a chunk.
  Json Add(int index, const engine::GenerationEvent& event);
  // The whole choice for a non-streaming response.
  Json Final(int index) const;

  bool finished() const { return !finish_reason_.empty(); }
  // Set when the request ended with kError or kCancelled (the front reports it).
  const absl::Status& error() const { return error_; }
  int prompt_tokens() const { return prompt_tokens_; }
  int completion_tokens() const { return completion_tokens_; }

 private:
  Json LogprobEntries(const engine::GenerationEvent& event) const;
  Json ToolCallJson(const tokenizer::ToolCall& call, bool with_index) const;

  const OpenAiRequest& request_;
  const tokenizer::Tokenizer* tokenizer_;
  std::unique_ptr<tokenizer::ChatOutputParser> parser_;  // chat only
  std::string text_;       // completions: all text; chat: the answer content
  std::string reasoning_;
  std::vector<tokenizer::ToolCall> tool_calls_;
  Json logprobs_ = Json::array();
  std::string finish_reason_;
  absl::Status error_;
  int prompt_tokens_ = 0;
  int completion_tokens_ = 0;
  size_t text_offset_ = 0;  // completions logprobs' text_offset
  std::string call_id_prefix_;
};

// A random "cmpl-..." / "chatcmpl-..." id.
std::string NewResponseId(bool chat);

// {"prompt_tokens", "completion_tokens", "total_tokens"}.
Json UsageJson(int prompt_tokens, int completion_tokens);

}  // namespace moe::serving

#endif  // MOE_SERVING_OPENAI_H_
