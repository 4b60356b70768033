#include "serving/openai.h"

#include <cmath>
#include <limits>
#include <utility>

#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"

namespace moe::serving {
namespace {

absl::Status Bad(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

const char* TypeName(const Json& v) { return v.type_name(); }

absl::StatusOr<double> GetNumber(const Json& v, absl::string_view field) {
  if (!v.is_number()) return Bad(field, absl::StrCat("must be a number, not ", TypeName(v)));
  const double d = v.get<double>();
  if (!std::isfinite(d)) return Bad(field, "must be finite");
  return d;
}

absl::StatusOr<int64_t> GetInteger(const Json& v, absl::string_view field) {
  if (v.is_number_integer()) {
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Bad(field, "is out of range");
      }
      return static_cast<int64_t>(u);
    }
    return v.get<int64_t>();
  }
  // 3.0 is accepted as 3 (some clients serialise every number as a float).
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) {
      return static_cast<int64_t>(d);
    }
  }
  return Bad(field, absl::StrCat("must be an integer, not ", TypeName(v)));
}

absl::StatusOr<bool> GetBool(const Json& v, absl::string_view field) {
  if (!v.is_boolean()) return Bad(field, absl::StrCat("must be a boolean, not ", TypeName(v)));
  return v.get<bool>();
}

// A present, non-null field.
const Json* Field(const Json& obj, const char* name) {
  auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::Status ParseSampling(const Json& body, const RequestLimits& limits, OpenAiRequest& r) {
  engine::SamplingParams& s = r.sampling;
  if (const Json* v = Field(body, "temperature")) {
    ASSIGN_OR_RETURN(double t, GetNumber(*v, "temperature"));
    if (t < 0 || t > 100) return Bad("temperature", absl::StrCat(t, " must be in [0, 100]"));
    s.temperature = static_cast<float>(t);
  }
  if (const Json* v = Field(body, "top_p")) {
    ASSIGN_OR_RETURN(double p, GetNumber(*v, "top_p"));
    if (!(p > 0 && p <= 1)) return Bad("top_p", absl::StrCat(p, " must be in (0, 1]"));
    s.top_p = static_cast<float>(p);
  }
  if (const Json* v = Field(body, "top_k")) {
    ASSIGN_OR_RETURN(int64_t k, GetInteger(*v, "top_k"));
    // vLLM's -1 means off, as 0 does here.
    if (k < -1 || k > 1'000'000) return Bad("top_k", absl::StrCat(k, " must be -1, 0 or positive"));
    s.top_k = k < 0 ? 0 : static_cast<int>(k);
  }
  if (const Json* v = Field(body, "min_p")) {
    ASSIGN_OR_RETURN(double p, GetNumber(*v, "min_p"));
    if (!(p >= 0 && p <= 1)) return Bad("min_p", absl::StrCat(p, " must be in [0, 1]"));
    s.min_p = static_cast<float>(p);
  }
  if (const Json* v = Field(body, "repetition_penalty")) {
    ASSIGN_OR_RETURN(double p, GetNumber(*v, "repetition_penalty"));
    if (!(p > 0 && p <= 100)) {
      return Bad("repetition_penalty", absl::StrCat(p, " must be in (0, 100]"));
    }
    s.repetition_penalty = static_cast<float>(p);
  }
  for (const char* name : {"presence_penalty", "frequency_penalty"}) {
    if (const Json* v = Field(body, name)) {
      ASSIGN_OR_RETURN(double p, GetNumber(*v, name));
      if (!(p >= -2 && p <= 2)) return Bad(name, absl::StrCat(p, " must be in [-2, 2]"));
      (name[0] == 'p' ? s.presence_penalty : s.frequency_penalty) = static_cast<float>(p);
    }
  }
  if (const Json* v = Field(body, "seed")) {
    ASSIGN_OR_RETURN(int64_t seed, GetInteger(*v, "seed"));
    s.has_seed = true;
    s.seed = static_cast<uint64_t>(seed);
  }
  // max_completion_tokens is the chat API's newer name; either may be given.
  for (const char* name : {"max_tokens", "max_completion_tokens"}) {
    if (const Json* v = Field(body, name)) {
      ASSIGN_OR_RETURN(int64_t m, GetInteger(*v, name));
      if (m < 1 || m > limits.max_context) {
        return Bad(name, absl::StrCat(m, " must be in [1, ", limits.max_context,
                                      "] (the context size)"));
      }
      s.max_tokens = static_cast<int>(m);
      r.max_tokens_given = true;
    }
  }
  if (const Json* v = Field(body, "stop")) {
    std::vector<std::string> stops;
    if (v->is_string()) {
      stops.push_back(v->get<std::string>());
    } else if (v->is_array()) {
      for (const Json& e : *v) {
        if (!e.is_string()) return Bad("stop", "must be a string or an array of strings");
        stops.push_back(e.get<std::string>());
      }
    } else {
      return Bad("stop", absl::StrCat("must be a string or an array of strings, not ",
                                      TypeName(*v)));
    }
    if (static_cast<int>(stops.size()) > limits.max_stop) {
      return Bad("stop", absl::StrCat("at most ", limits.max_stop, " stop strings"));
    }
    for (const std::string& stop : stops) {
      if (stop.empty()) return Bad("stop", "an empty stop string");
    }
    s.stop_strings = std::move(stops);
  }
  if (const Json* v = Field(body, "stop_token_ids")) {
    if (!v->is_array()) return Bad("stop_token_ids", "must be an array of integers");
    for (const Json& e : *v) {
      ASSIGN_OR_RETURN(int64_t id, GetInteger(e, "stop_token_ids"));
      if (id < 0 || id > std::numeric_limits<int32_t>::max()) {
        return Bad("stop_token_ids", absl::StrCat(id, " is not a token id"));
      }
      s.stop_token_ids.push_back(static_cast<int32_t>(id));
    }
  }
  if (const Json* v = Field(body, "ignore_eos")) {
    ASSIGN_OR_RETURN(s.ignore_eos, GetBool(*v, "ignore_eos"));
  }
  if (const Json* v = Field(body, "n")) {
    ASSIGN_OR_RETURN(int64_t n, GetInteger(*v, "n"));
    if (n < 1 || n > limits.max_n) {
      return Bad("n", absl::StrCat(n, " must be in [1, ", limits.max_n, "]"));
    }
    r.n = static_cast<int>(n);
  }
  if (const Json* v = Field(body, "stream")) {
    ASSIGN_OR_RETURN(r.stream, GetBool(*v, "stream"));
  }
  if (const Json* v = Field(body, "stream_options")) {
    if (!v->is_object()) return Bad("stream_options", "must be an object");
    if (const Json* u = Field(*v, "include_usage")) {
      ASSIGN_OR_RETURN(r.include_usage, GetBool(*u, "stream_options.include_usage"));
    }
  }
  if (r.chat) {
    if (const Json* v = Field(body, "logprobs")) {
      ASSIGN_OR_RETURN(r.logprobs, GetBool(*v, "logprobs"));
    }
    if (const Json* v = Field(body, "top_logprobs")) {
      ASSIGN_OR_RETURN(int64_t k, GetInteger(*v, "top_logprobs"));
      if (k < 0 || k > 20) return Bad("top_logprobs", absl::StrCat(k, " must be in [0, 20]"));
      if (!r.logprobs && k > 0) return Bad("top_logprobs", "needs \"logprobs\": true");
      r.top_logprobs = static_cast<int>(k);
    }
  } else {
    // The legacy completions API: an integer, the number of alternatives per token.
    if (const Json* v = Field(body, "logprobs")) {
      ASSIGN_OR_RETURN(int64_t k, GetInteger(*v, "logprobs"));
      if (k < 0 || k > 20) return Bad("logprobs", absl::StrCat(k, " must be in [0, 20]"));
      r.logprobs = true;
      r.top_logprobs = static_cast<int>(k);
    }
    if (const Json* v = Field(body, "echo")) {
      ASSIGN_OR_RETURN(r.echo, GetBool(*v, "echo"));
      if (r.echo) return Bad("echo", "is not supported");
    }
  }
  s.logprobs = r.logprobs;
  s.top_logprobs = r.top_logprobs;
  return absl::OkStatus();
}

// Content as the template wants it: a string (text parts joined), or null.
absl::StatusOr<Json> MessageContent(const Json& content, absl::string_view field) {
  if (content.is_null() || content.is_string()) return content;
  if (!content.is_array()) {
    return Bad(field, absl::StrCat("must be a string or an array of parts, not ",
                                   TypeName(content)));
  }
  std::string text;
  for (const Json& part : content) {
    if (!part.is_object()) return Bad(field, "every part must be an object");
    const Json* type = Field(part, "type");
    if (type == nullptr || !type->is_string() || type->get<std::string>() != "text") {
      return Bad(field, "only parts of type \"text\" are supported");
    }
    const Json* t = Field(part, "text");
    if (t == nullptr || !t->is_string()) return Bad(field, "a text part needs a string \"text\"");
    text += t->get<std::string>();
  }
  return Json(text);
}

absl::Status ParseMessages(const Json& body, OpenAiRequest& r) {
  const Json* messages = Field(body, "messages");
  if (messages == nullptr) return Bad("messages", "is required");
  if (!messages->is_array()) return Bad("messages", "must be an array");
  if (messages->empty()) return Bad("messages", "is empty");
  r.messages = Json::array();
  for (size_t i = 0; i < messages->size(); ++i) {
    const std::string field = absl::StrCat("messages[", i, "]");
    const Json& m = (*messages)[i];
    if (!m.is_object()) return Bad(field, "must be an object");
    const Json* role = Field(m, "role");
    if (role == nullptr || !role->is_string()) return Bad(field + ".role", "must be a string");
    std::string role_name = role->get<std::string>();
    // "developer" is the newer name of "system"; templates know only the latter.
    if (role_name == "developer") role_name = "system";
    if (role_name != "system" && role_name != "user" && role_name != "assistant" &&
        role_name != "tool") {
      return Bad(field + ".role", absl::StrCat("unknown role \"", role->get<std::string>(),
                                               "\" (system, developer, user, assistant, tool)"));
    }
    Json out = Json::object();
    out["role"] = role_name;
    const Json* content = Field(m, "content");
    ASSIGN_OR_RETURN(out["content"], MessageContent(content ? *content : Json(), field + ".content"));
    if (role_name != "assistant" && out["content"].is_null()) {
      return Bad(field + ".content", "is required for this role");
    }
    // An assistant turn that only called tools has null content; templates (Qwen3's) test
    // substrings of it, so it is given to them as "".
    if (out["content"].is_null()) out["content"] = "";
    if (const Json* rc = Field(m, "reasoning_content")) {
      if (!rc->is_string()) return Bad(field + ".reasoning_content", "must be a string");
      out["reasoning_content"] = *rc;
    }
    if (const Json* calls = Field(m, "tool_calls")) {
      if (role_name != "assistant") return Bad(field + ".tool_calls", "only for assistant");
      if (!calls->is_array()) return Bad(field + ".tool_calls", "must be an array");
      Json out_calls = Json::array();
      for (size_t j = 0; j < calls->size(); ++j) {
        const std::string cf = absl::StrCat(field, ".tool_calls[", j, "]");
        const Json& c = (*calls)[j];
        if (!c.is_object()) return Bad(cf, "must be an object");
        const Json* fn = Field(c, "function");
        if (fn == nullptr || !fn->is_object()) return Bad(cf + ".function", "must be an object");
        const Json* name = Field(*fn, "name");
        if (name == nullptr || !name->is_string()) {
          return Bad(cf + ".function.name", "must be a string");
        }
        Json args = Json::object();
        if (const Json* a = Field(*fn, "arguments")) {
          // The API sends arguments as JSON text; templates expect the object (as vLLM does).
          if (a->is_string()) {
            args = Json::parse(a->get<std::string>(), nullptr, false);
            if (args.is_discarded() || !args.is_object()) {
              return Bad(cf + ".function.arguments", "must be a JSON object (as text)");
            }
          } else if (a->is_object()) {
            args = *a;
          } else {
            return Bad(cf + ".function.arguments", "must be a JSON object (as text)");
          }
        }
        Json oc = c;
        oc["function"] = Json{{"name", *name}, {"arguments", std::move(args)}};
        out_calls.push_back(std::move(oc));
      }
      out["tool_calls"] = std::move(out_calls);
    }
    if (const Json* id = Field(m, "tool_call_id")) {
      if (!id->is_string()) return Bad(field + ".tool_call_id", "must be a string");
      out["tool_call_id"] = *id;
    }
    if (const Json* name = Field(m, "name")) {
      if (!name->is_string()) return Bad(field + ".name", "must be a string");
      out["name"] = *name;
    }
    r.messages.push_back(std::move(out));
  }
  return absl::OkStatus();
}

absl::Status ParseTools(const Json& body, OpenAiRequest& r) {
  if (const Json* tools = Field(body, "tools")) {
    if (!tools->is_array()) return Bad("tools", "must be an array");
    for (size_t i = 0; i < tools->size(); ++i) {
      const std::string field = absl::StrCat("tools[", i, "]");
      const Json& t = (*tools)[i];
      if (!t.is_object()) return Bad(field, "must be an object");
      const Json* type = Field(t, "type");
      if (type == nullptr || !type->is_string() || type->get<std::string>() != "function") {
        return Bad(field + ".type", "must be \"function\"");
      }
      const Json* fn = Field(t, "function");
      if (fn == nullptr || !fn->is_object()) return Bad(field + ".function", "must be an object");
      const Json* name = Field(*fn, "name");
      if (name == nullptr || !name->is_string() || name->get<std::string>().empty()) {
        return Bad(field + ".function.name", "must be a non-empty string");
      }
      if (const Json* p = Field(*fn, "parameters")) {
        if (!p->is_object()) {
          return Bad(field + ".function.parameters",
                     absl::StrCat("must be a JSON schema object, not ", TypeName(*p)));
        }
      }
      if (const Json* d = Field(*fn, "description")) {
        if (!d->is_string()) return Bad(field + ".function.description", "must be a string");
      }
    }
    if (!tools->empty()) r.tools = *tools;
  }
  if (const Json* choice = Field(body, "tool_choice")) {
    if (choice->is_string()) {
      const std::string c = choice->get<std::string>();
      if (c == "auto") {
        r.tool_choice = ToolChoice::kAuto;
      } else if (c == "none") {
        r.tool_choice = ToolChoice::kNone;
      } else if (c == "required") {
        r.tool_choice = ToolChoice::kRequired;
      } else {
        return Bad("tool_choice", "must be \"none\", \"auto\", \"required\" or a function");
      }
    } else if (choice->is_object()) {
      const Json* fn = Field(*choice, "function");
      const Json* name = fn != nullptr && fn->is_object() ? Field(*fn, "name") : nullptr;
      if (name == nullptr || !name->is_string()) {
        return Bad("tool_choice.function.name", "must be a string");
      }
      r.tool_choice = ToolChoice::kNamed;
      r.tool_name = name->get<std::string>();
    } else {
      return Bad("tool_choice", absl::StrCat("must be a string or an object, not ",
                                             TypeName(*choice)));
    }
    if (r.tool_choice == ToolChoice::kRequired || r.tool_choice == ToolChoice::kNamed) {
      if (r.tools.is_null()) return Bad("tool_choice", "needs tools");
    }
    if (r.tool_choice == ToolChoice::kNamed) {
      bool found = false;
      for (const Json& t : r.tools) found = found || t["function"]["name"] == r.tool_name;
      if (!found) {
        return Bad("tool_choice", absl::StrCat("names \"", r.tool_name, "\", which is not in tools"));
      }
    }
  }
  if (const Json* kwargs = Field(body, "chat_template_kwargs")) {
    if (!kwargs->is_object()) return Bad("chat_template_kwargs", "must be an object");
    r.template_kwargs = *kwargs;
  }
  return absl::OkStatus();
}

absl::Status ParsePrompt(const Json& body, OpenAiRequest& r) {
  const Json* p = Field(body, "prompt");
  if (p == nullptr) return Bad("prompt", "is required");
  const Json* one = p;
  // A batch of one prompt is accepted; larger batches are one request each.
  if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) {
    one = &(*p)[0];
  }
  if (one->is_string()) {
    r.prompt_text = one->get<std::string>();
    if (r.prompt_text.empty()) return Bad("prompt", "is empty");
    return absl::OkStatus();
  }
  if (one->is_array()) {
    if (one->empty()) return Bad("prompt", "is empty");
    for (const Json& e : *one) {
      if (!e.is_number_integer()) {
        return Bad("prompt", "must be a string, an array of token ids, or one of those in an array");
      }
      ASSIGN_OR_RETURN(int64_t id, GetInteger(e, "prompt"));
      if (id < 0 || id > std::numeric_limits<int32_t>::max()) {
        return Bad("prompt", absl::StrCat(id, " is not a token id"));
      }
      r.prompt_ids.push_back(static_cast<int32_t>(id));
    }
    return absl::OkStatus();
  }
  return Bad("prompt", absl::StrCat("must be a string or an array of token ids, not ",
                                    TypeName(*p)));
}

}  // namespace

absl::StatusOr<OpenAiRequest> ParseOpenAiRequest(absl::string_view body, bool chat,
                                                 absl::string_view served_model,
                                                 const RequestLimits& limits) {
  Json json;
  try {
    json = Json::parse(body.begin(), body.end());
  } catch (const Json::exception& e) {  // parse errors, and numbers out of range (1e999)
    return Bad("body", absl::StrCat("is not valid JSON (", e.what(), ")"));
  }
  if (!json.is_object()) return Bad("body", "must be a JSON object");
  OpenAiRequest r;
  r.chat = chat;
  if (const Json* m = Field(json, "model")) {
    if (!m->is_string()) return Bad("model", "must be a string");
    r.model = m->get<std::string>();
    if (!r.model.empty() && r.model != served_model) {
      return Bad("model", absl::StrCat("unknown model \"", r.model, "\"; this server serves \"",
                                       served_model, "\""));
    }
  }
  r.model = std::string(served_model);
  if (chat) {
    RETURN_IF_ERROR(ParseMessages(json, r));
    RETURN_IF_ERROR(ParseTools(json, r));
  } else {
    RETURN_IF_ERROR(ParsePrompt(json, r));
  }
  RETURN_IF_ERROR(ParseSampling(json, limits, r));
  return r;
}

absl::StatusOr<PreparedPrompt> PreparePrompt(OpenAiRequest& request, const engine::Engine& engine,
                                             const RequestLimits& limits) {
  PreparedPrompt p;
  const tokenizer::Tokenizer* tok = engine.tokenizer();
  if (request.chat) {
    const tokenizer::ChatTemplate* tmpl = engine.chat_template();
    if (tmpl == nullptr || tok == nullptr) {
      return absl::FailedPreconditionError(
          "messages: this model has no chat template; use /v1/completions");
    }
    tokenizer::ChatTemplateInputs inputs;
    inputs.messages = request.messages;
    // tool_choice none: the model is not told about the tools (so it cannot call them).
    if (request.tool_choice != ToolChoice::kNone) inputs.tools = request.tools;
    inputs.kwargs = request.template_kwargs;
    absl::StatusOr<std::string> rendered = tmpl->Render(inputs);
    if (!rendered.ok()) {
      return Bad("messages", absl::StrCat("the chat template failed: ", rendered.status().message()));
    }
    absl::string_view tail = *rendered;
    while (!tail.empty() && (tail.back() == '\n' || tail.back() == ' ')) tail.remove_suffix(1);
    p.starts_in_reasoning = absl::EndsWith(tail, "<think>");
    p.parse_tool_calls = !request.tools.is_null() && request.tool_choice != ToolChoice::kNone;
    p.prompt_ids = tok->Encode(*rendered, /*add_special_tokens=*/false);
    if (request.tool_choice == ToolChoice::kRequired || request.tool_choice == ToolChoice::kNamed) {
      // Qwen's tool-call format; the model continues with the name (or the arguments).
      std::string prefix = "<tool_call>\n{\"name\": \"";
      if (request.tool_choice == ToolChoice::kNamed) {
        prefix += Json(request.tool_name).dump().substr(1);  // the name, escaped, and its quote
        prefix += ", \"arguments\": ";
      }
      p.forced_output_ids = tok->Encode(prefix, false);
      // A prompt that leaves the model inside <think> must close it first.
      p.starts_in_reasoning = false;
    }
  } else if (!request.prompt_ids.empty()) {
    p.prompt_ids = request.prompt_ids;
    const int vocab = engine.model_info().vocab_size;
    for (int32_t id : p.prompt_ids) {
      if (vocab > 0 && id >= vocab) {
        return Bad("prompt", absl::StrCat("token id ", id, " is outside the vocabulary (", vocab,
                                          " tokens)"));
      }
    }
  } else if (tok != nullptr) {
    p.prompt_ids = tok->Encode(request.prompt_text, false);
  } else {
    p.prompt_text = request.prompt_text;
  }
  if (!p.prompt_text.empty()) return p;  // the engine counts and checks
  const int prompt_len = static_cast<int>(p.prompt_ids.size());
  if (prompt_len == 0) return Bad(request.chat ? "messages" : "prompt", "gives no tokens");
  const int room = limits.max_context - prompt_len;
  if (request.sampling.max_tokens < static_cast<int>(p.forced_output_ids.size()) + 1) {
    if (request.max_tokens_given) {
      return Bad("max_tokens", absl::StrCat(request.sampling.max_tokens,
                                            " is too small for the forced tool-call prefix (",
                                            p.forced_output_ids.size(), " tokens)"));
    }
  }
  if (!request.max_tokens_given) {
    request.sampling.max_tokens =
        request.chat ? room : std::min(limits.default_completion_tokens, room);
    if (room < 1) {
      return Bad(request.chat ? "messages" : "prompt",
                 absl::StrCat("the prompt has ", prompt_len, " tokens, which leaves no room in the ",
                              limits.max_context, "-token context"));
    }
  } else if (prompt_len + request.sampling.max_tokens > limits.max_context) {
    return Bad("max_tokens", absl::StrCat("the prompt (", prompt_len, " tokens) plus max_tokens (",
                                          request.sampling.max_tokens, ") is over the context of ",
                                          limits.max_context, " tokens"));
  }
  return p;
}

ChoiceBuilder::ChoiceBuilder(const OpenAiRequest& request, const PreparedPrompt& prompt,
                             const tokenizer::Tokenizer* tokenizer)
    : request_(request), tokenizer_(tokenizer) {
  if (request.chat) {
    parser_ = std::make_unique<tokenizer::ChatOutputParser>(prompt.starts_in_reasoning,
                                                            prompt.parse_tool_calls);
  }
  absl::BitGen gen;
  call_id_prefix_ = absl::StrFormat("call_%016x", absl::Uniform<uint64_t>(gen));
}

Json ChoiceBuilder::ToolCallJson(const tokenizer::ToolCall& call, bool with_index) const {
  Json j = Json::object();
  if (with_index) j["index"] = call.index;
  j["id"] = absl::StrCat(call_id_prefix_, "_", call.index);
  j["type"] = "function";
  j["function"] = Json{{"name", call.name}, {"arguments", call.arguments_json}};
  return j;
}

Json ChoiceBuilder::LogprobEntries(const engine::GenerationEvent& event) const {
  auto token_text = [this](int32_t id) {
    return tokenizer_ != nullptr ? tokenizer_->Decode({id}) : absl::StrCat("<", id, ">");
  };
  auto bytes = [](const std::string& s) {
    Json b = Json::array();
    for (unsigned char c : s) b.push_back(static_cast<int>(c));
    return b;
  };
  Json entries = Json::array();
  for (size_t i = 0; i < event.token_ids.size() && i < event.logprobs.size(); ++i) {
    const std::string t = token_text(event.token_ids[i]);
    Json top = Json::array();
    if (i < event.top_logprobs.size()) {
      for (const engine::TopLogprob& alt : event.top_logprobs[i]) {
        const std::string at = token_text(alt.token_id);
        top.push_back(Json{{"token", at}, {"logprob", alt.logprob}, {"bytes", bytes(at)}});
      }
    }
    entries.push_back(
        Json{{"token", t}, {"logprob", event.logprobs[i]}, {"bytes", bytes(t)}, {"top_logprobs", top}});
  }
  return entries;
}

Json ChoiceBuilder::Add(int index, const engine::GenerationEvent& event) {
  const bool final = event.finish_reason != engine::FinishReason::kNone;
  prompt_tokens_ = std::max(prompt_tokens_, event.prompt_tokens);
  completion_tokens_ = std::max(completion_tokens_, event.completion_tokens);
  Json lp = nullptr;
  if (request_.logprobs && !event.logprobs.empty()) {
    Json entries = LogprobEntries(event);
    if (request_.chat) {
      for (const Json& e : entries) logprobs_.push_back(e);
      lp = Json{{"content", entries}};
    } else {
      Json tokens = Json::array(), token_lps = Json::array(), tops = Json::array(),
           offsets = Json::array();
      for (const Json& e : entries) {
        tokens.push_back(e["token"]);
        token_lps.push_back(e["logprob"]);
        Json top = Json::object();
        for (const Json& a : e["top_logprobs"]) top[a["token"].get<std::string>()] = a["logprob"];
        tops.push_back(top);
        offsets.push_back(text_offset_);
        text_offset_ += e["token"].get<std::string>().size();
        logprobs_.push_back(e);
      }
      lp = Json{{"tokens", tokens}, {"token_logprobs", token_lps}, {"top_logprobs", tops},
                {"text_offset", offsets}};
    }
  }
  if (final) {
    switch (event.finish_reason) {
      case engine::FinishReason::kStop:
        finish_reason_ = "stop";
        break;
      case engine::FinishReason::kLength:
        finish_reason_ = "length";
        break;
      case engine::FinishReason::kCancelled:
        finish_reason_ = "cancelled";
        error_ = absl::CancelledError("the request was cancelled (the server is shutting down)");
        break;
      default:
        finish_reason_ = "error";
        error_ = event.error.ok() ? absl::InternalError("the engine failed") : event.error;
        break;
    }
  }
  Json choice = Json::object();
  choice["index"] = index;
  if (!request_.chat) {
    text_ += event.text;
    if (event.text.empty() && lp.is_null() && !final) return nullptr;
    choice["text"] = event.text;
    choice["logprobs"] = lp;
    choice["finish_reason"] = final ? Json(finish_reason_) : Json(nullptr);
    return choice;
  }
  tokenizer::ChatDelta d = parser_->Feed(event.text);
  if (final) {
    tokenizer::ChatDelta rest = parser_->Finish();
    d.content += rest.content;
    d.reasoning += rest.reasoning;
    for (auto& c : rest.tool_calls) d.tool_calls.push_back(std::move(c));
  }
  Json delta = Json::object();
  Json calls = Json::array();
  for (const tokenizer::ToolCall& c : d.tool_calls) {
    if (!c.error.empty()) {
      // A block that is not a valid call is shown as text, as the model wrote it.
      d.content += c.raw;
      continue;
    }
    tool_calls_.push_back(c);
    tokenizer::ToolCall numbered = c;
    numbered.index = static_cast<int>(tool_calls_.size()) - 1;
    tool_calls_.back().index = numbered.index;
    calls.push_back(ToolCallJson(numbered, /*with_index=*/true));
  }
  if (!d.reasoning.empty()) {
    reasoning_ += d.reasoning;
    delta["reasoning_content"] = d.reasoning;
  }
  if (!d.content.empty()) {
    text_ += d.content;
    delta["content"] = d.content;
  }
  if (!calls.empty()) delta["tool_calls"] = calls;
  if (final && finish_reason_ == "stop" && !tool_calls_.empty()) finish_reason_ = "tool_calls";
  if (delta.empty() && lp.is_null() && !final) return nullptr;
  choice["delta"] = delta;
  choice["logprobs"] = lp;
  choice["finish_reason"] = final ? Json(finish_reason_) : Json(nullptr);
  return choice;
}

Json ChoiceBuilder::Final(int index) const {
  Json choice = Json::object();
  choice["index"] = index;
  if (!request_.chat) {
    choice["text"] = text_;
    if (request_.logprobs) {
      Json tokens = Json::array(), token_lps = Json::array(), tops = Json::array(),
           offsets = Json::array();
      size_t offset = 0;
      for (const Json& e : logprobs_) {
        tokens.push_back(e["token"]);
        token_lps.push_back(e["logprob"]);
        Json top = Json::object();
        for (const Json& a : e["top_logprobs"]) top[a["token"].get<std::string>()] = a["logprob"];
        tops.push_back(top);
        offsets.push_back(offset);
        offset += e["token"].get<std::string>().size();
      }
      choice["logprobs"] = Json{{"tokens", tokens}, {"token_logprobs", token_lps},
                                {"top_logprobs", tops}, {"text_offset", offsets}};
    } else {
      choice["logprobs"] = nullptr;
    }
  } else {
    Json message = Json::object();
    message["role"] = "assistant";
    message["content"] = text_.empty() && !tool_calls_.empty() ? Json(nullptr) : Json(text_);
    if (!reasoning_.empty()) message["reasoning_content"] = reasoning_;
    if (!tool_calls_.empty()) {
      Json calls = Json::array();
      for (const auto& c : tool_calls_) calls.push_back(ToolCallJson(c, /*with_index=*/false));
      message["tool_calls"] = calls;
    }
    choice["message"] = message;
    choice["logprobs"] = request_.logprobs ? Json{{"content", logprobs_}} : Json(nullptr);
  }
  choice["finish_reason"] = finish_reason_.empty() ? Json(nullptr) : Json(finish_reason_);
  return choice;
}

std::string NewResponseId(bool chat) {
  absl::BitGen gen;
  return absl::StrFormat("%s-%016x%08x", chat ? "chatcmpl" : "cmpl", absl::Uniform<uint64_t>(gen),
                         absl::Uniform<uint32_t>(gen));
}

Json UsageJson(int prompt_tokens, int completion_tokens) {
  return Json{{"prompt_tokens", prompt_tokens},
              {"completion_tokens", completion_tokens},
              {"total_tokens", prompt_tokens + completion_tokens}};
}

}  // namespace moe::serving
