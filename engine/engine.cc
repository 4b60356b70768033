#include "engine/engine.h"

#include <cmath>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moe::engine {
namespace {

absl::Status Bad(const char* field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("sampling parameter ", field, ": ", why));
}

}  // namespace

absl::Status SamplingParams::Validate() const {
  if (!std::isfinite(temperature) || temperature < 0.0f) {
    return Bad("temperature", absl::StrCat(temperature, " must be finite and >= 0"));
  }
  if (top_k < 0) return Bad("top_k", absl::StrCat(top_k, " must be >= 0"));
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    return Bad("top_p", absl::StrCat(top_p, " must be in (0, 1]"));
  }
  if (!(min_p >= 0.0f && min_p <= 1.0f)) {
    return Bad("min_p", absl::StrCat(min_p, " must be in [0, 1]"));
  }
  if (!std::isfinite(repetition_penalty) || repetition_penalty <= 0.0f) {
    return Bad("repetition_penalty", absl::StrCat(repetition_penalty, " must be finite and > 0"));
  }
  // OpenAI's range for both.
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f)) {
    return Bad("presence_penalty", absl::StrCat(presence_penalty, " must be in [-2, 2]"));
  }
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f)) {
    return Bad("frequency_penalty", absl::StrCat(frequency_penalty, " must be in [-2, 2]"));
  }
  if (max_tokens < 1) return Bad("max_tokens", absl::StrCat(max_tokens, " must be >= 1"));
  for (int32_t id : stop_token_ids) {
    if (id < 0) return Bad("stop_token_ids", absl::StrCat(id, " is negative"));
  }
  for (const std::string& s : stop_strings) {
    if (s.empty()) return Bad("stop_strings", "an empty stop string");
  }
  if (top_logprobs < 0 || top_logprobs > 20) {
    return Bad("top_logprobs", absl::StrCat(top_logprobs, " must be in [0, 20]"));
  }
  return absl::OkStatus();
}

const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone:
      return "";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kError:
      return "error";
  }
  return "";
}

}  // namespace moe::engine
