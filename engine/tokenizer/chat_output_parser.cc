#include "engine/tokenizer/chat_output_parser.h"

#include <algorithm>
#include <utility>

#include "nlohmann/json.hpp"

namespace moe::tokenizer {
namespace {

constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";
constexpr std::string_view kToolOpen = "<tool_call>";
constexpr std::string_view kToolClose = "</tool_call>";

// Length of the longest suffix of `text` that is a proper prefix of `tag`: text that may turn
// into the tag once more arrives, and so cannot be released yet.
size_t PartialTagSuffix(std::string_view text, std::string_view tag) {
  for (size_t n = std::min(text.size(), tag.size() - 1); n > 0; --n) {
    if (text.substr(text.size() - n) == tag.substr(0, n)) return n;
  }
  return 0;
}

std::string_view TrimWhitespace(std::string_view s) {
  const auto is_space = [](char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; };
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

// One <tool_call> block's inside: {"name": ..., "arguments": {...}} (Hermes / Qwen format).
ToolCall ParseToolCall(std::string_view block, int index) {
  ToolCall call;
  call.index = index;
  const std::string_view body = TrimWhitespace(block);
  const nlohmann::ordered_json j =
      nlohmann::ordered_json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  auto fail = [&](const char* why) {
    call.error = why;
    call.raw = std::string(block);
    return call;
  };
  if (j.is_discarded()) return fail("malformed JSON in <tool_call>");
  if (!j.is_object()) return fail("<tool_call> is not a JSON object");
  auto name = j.find("name");
  if (name == j.end() || !name->is_string() || name->get_ref<const std::string&>().empty()) {
    return fail("<tool_call> has no \"name\"");
  }
  call.name = name->get<std::string>();
  auto args = j.find("arguments");
  if (args == j.end()) args = j.find("parameters");  // some fine-tunes use this key
  if (args == j.end() || args->is_null()) {
    call.arguments_json = "{}";
  } else if (args->is_string()) {
    // Arguments already serialised by the model: keep its text when it is JSON.
    const std::string& s = args->get_ref<const std::string&>();
    if (nlohmann::ordered_json::parse(s, nullptr, false).is_discarded()) {
      call.name.clear();
      return fail("\"arguments\" is a string that is not JSON");
    }
    call.arguments_json = s;
  } else {
    call.arguments_json = args->dump();
  }
  return call;
}

}  // namespace

ChatOutputParser::ChatOutputParser(bool starts_in_reasoning, bool parse_tool_calls)
    : state_(starts_in_reasoning ? State::kReasoning : State::kContent),
      parse_tool_calls_(parse_tool_calls) {}

ChatDelta ChatOutputParser::Feed(std::string_view text) {
  pending_.append(text);
  return Drain(/*final=*/false);
}

ChatDelta ChatOutputParser::Finish() { return Drain(/*final=*/true); }

ChatDelta ChatOutputParser::Drain(bool final) {
  ChatDelta delta;
  while (!pending_.empty()) {
    const std::string_view p = pending_;
    if (state_ == State::kToolCall) {
      const size_t end = p.find(kToolClose);
      if (end == std::string_view::npos) {
        if (final) {
          // The stream ended inside the block: report it, never drop it silently.
          ToolCall call;
          call.index = next_index_++;
          call.error = "unterminated <tool_call>";
          call.raw = pending_;
          delta.tool_calls.push_back(std::move(call));
          pending_.clear();
        }
        break;
      }
      delta.tool_calls.push_back(ParseToolCall(p.substr(0, end), next_index_++));
      pending_.erase(0, end + kToolClose.size());
      state_ = State::kContent;
      continue;
    }
    // Content or reasoning: find the earliest tag that changes state.
    std::string* sink = state_ == State::kReasoning ? &delta.reasoning : &delta.content;
    std::vector<std::string_view> tags;
    if (state_ == State::kReasoning) {
      tags = {kThinkClose};
    } else {
      tags = {kThinkOpen};
      if (parse_tool_calls_) tags.push_back(kToolOpen);
    }
    size_t best = std::string_view::npos;
    std::string_view best_tag;
    for (std::string_view tag : tags) {
      const size_t k = p.find(tag);
      if (k < best) {
        best = k;
        best_tag = tag;
      }
    }
    if (best == std::string_view::npos) {
      size_t hold = 0;
      if (!final) {
        for (std::string_view tag : tags) hold = std::max(hold, PartialTagSuffix(p, tag));
      }
      sink->append(p.substr(0, p.size() - hold));
      pending_.erase(0, p.size() - hold);
      break;
    }
    sink->append(p.substr(0, best));
    pending_.erase(0, best + best_tag.size());
    if (best_tag == kThinkOpen) state_ = State::kReasoning;
    if (best_tag == kThinkClose) state_ = State::kContent;
    if (best_tag == kToolOpen) state_ = State::kToolCall;
  }
  return delta;
}

}  // namespace moe::tokenizer
