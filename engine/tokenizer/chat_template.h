// ChatTemplate: renders a model's Jinja chat template (tokenizer_config.json's `chat_template`)
// the way transformers' apply_chat_template does: trim_blocks, lstrip_blocks, loop controls,
// `tojson` keeping key order and non-ASCII text, `raise_exception` defined.
//
// A construct the interpreter does not support is an InvalidArgument naming it and its template
// line, never a silent wrong render. Immutable after construction: Render is thread-safe.
#ifndef MOE_ENGINE_TOKENIZER_CHAT_TEMPLATE_H_
#define MOE_ENGINE_TOKENIZER_CHAT_TEMPLATE_H_

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace moe::tokenizer {

struct ChatTemplateInputs {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  // Tool definitions (OpenAI shape); null when the request has none: the template then sees
  // `tools` defined and none, exactly as transformers passes tools=None.
  nlohmann::ordered_json tools;
  bool add_generation_prompt = true;
  // Extra template variables (chat_template_kwargs, e.g. {"enable_thinking": false}).
  nlohmann::ordered_json kwargs = nlohmann::ordered_json::object();
};

class ChatTemplate {
 public:
  // From template source text and the special tokens the template may reference.
  static absl::StatusOr<std::unique_ptr<ChatTemplate>> FromSource(std::string_view source,
                                                                  std::string bos_token = "",
                                                                  std::string eos_token = "");
  // Reads DIR/tokenizer_config.json (its chat_template, bos_token, eos_token). NotFound when the
  // file or the template is absent.
  static absl::StatusOr<std::unique_ptr<ChatTemplate>> FromDirectory(const std::string& dir);

  virtual ~ChatTemplate() = default;
  virtual absl::StatusOr<std::string> Render(const ChatTemplateInputs& inputs) const = 0;
};

}  // namespace moe::tokenizer

#endif  // MOE_ENGINE_TOKENIZER_CHAT_TEMPLATE_H_
