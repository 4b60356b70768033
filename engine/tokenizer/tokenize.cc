// tokenize: shows how a model's tokenizer splits text, or a conversation rendered through its
// chat template.
//
//   tokenize --tokenizer MODEL_DIR "Hello world"
//   tokenize --tokenizer MODEL_DIR --chat conversation.json
//   tokenize --tokenizer MODEL_DIR --file big.txt --count_only
//
// MODEL_DIR holds tokenizer.json (and tokenizer_config.json for --chat). conversation.json is
// either a list of messages or {"messages": [...], "tools": [...], "add_generation_prompt": bool,
// "chat_template_kwargs": {...}}. Prints the rendered prompt (with --chat), then one line per
// token: id, the vocabulary entry and the text it decodes to (JSON-quoted).
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, tokenizer, "", "model directory with tokenizer.json");
ABSL_FLAG(std::string, chat, "", "conversation JSON file to render through the chat template");
ABSL_FLAG(bool, add_special_tokens, false, "apply the post-processor's special tokens");
ABSL_FLAG(std::string, file, "", "read the text from this file (appended after TEXT)");
ABSL_FLAG(bool, count_only, false, "print only the number of tokens");

namespace {

int Fail(const std::string& message) {
  std::cerr << "tokenize: " << message << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("tokenize --tokenizer MODEL_DIR [--chat FILE.json] [TEXT]");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  const std::string dir = absl::GetFlag(FLAGS_tokenizer);
  if (dir.empty()) return Fail("--tokenizer is required");
  auto tokenizer = moe::tokenizer::Tokenizer::FromDirectory(dir);
  if (!tokenizer.ok()) return Fail(std::string(tokenizer.status().message()));

  std::string text;
  for (size_t i = 1; i < args.size(); ++i) {
    if (i > 1) text += ' ';
    text += args[i];
  }
  if (const std::string file = absl::GetFlag(FLAGS_file); !file.empty()) {
    std::ifstream in(file, std::ios::binary);
    if (!in) return Fail("cannot open " + file);
    std::stringstream ss;
    ss << in.rdbuf();
    text += ss.str();
  }
  if (const std::string chat = absl::GetFlag(FLAGS_chat); !chat.empty()) {
    std::ifstream in(chat, std::ios::binary);
    if (!in) return Fail("cannot open " + chat);
    std::stringstream ss;
    ss << in.rdbuf();
    const nlohmann::ordered_json j = nlohmann::ordered_json::parse(ss.str(), nullptr, false);
    if (j.is_discarded()) return Fail(chat + ": not valid JSON");
    moe::tokenizer::ChatTemplateInputs inputs;
    if (j.is_array()) {
      inputs.messages = j;
    } else if (j.is_object() && j.contains("messages") && j["messages"].is_array()) {
      inputs.messages = j["messages"];
      if (j.contains("tools")) inputs.tools = j["tools"];
      if (j.contains("add_generation_prompt") && j["add_generation_prompt"].is_boolean()) {
        inputs.add_generation_prompt = j["add_generation_prompt"].get<bool>();
      }
      if (j.contains("chat_template_kwargs") && j["chat_template_kwargs"].is_object()) {
        inputs.kwargs = j["chat_template_kwargs"];
      }
    } else {
      return Fail(chat + ": expected a list of messages or an object with \"messages\"");
    }
    auto tmpl = moe::tokenizer::ChatTemplate::FromDirectory(dir);
    if (!tmpl.ok()) return Fail(std::string(tmpl.status().message()));
    auto rendered = (*tmpl)->Render(inputs);
    if (!rendered.ok()) return Fail(std::string(rendered.status().message()));
    std::cout << *rendered << "\n----\n";
    text = *rendered + text;
  }
  const std::vector<int32_t> ids =
      (*tokenizer)->Encode(text, absl::GetFlag(FLAGS_add_special_tokens));
  std::cout << ids.size() << " tokens\n";
  if (absl::GetFlag(FLAGS_count_only)) return 0;
  for (int32_t id : ids) {
    const int32_t one[] = {id};
    std::cout << id << "\t" << (*tokenizer)->IdToToken(id) << "\t"
              << nlohmann::json((*tokenizer)->Decode(one))
                     .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
              << "\n";
  }
  return 0;
}
