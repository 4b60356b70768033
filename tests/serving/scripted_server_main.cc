// The server binary around a ScriptedEngine (scripted_engine.h): the same flags, fronts and
// shutdown as //serving:server, with a model that replays a script. --model names a folder
// holding tokenizer.json (and tokenizer_config.json for the chat template); --max_batch,
// --max_context, --kv_blocks and --prefill_chunk size the engine as they size the real one.
#include <fstream>
#include <sstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"
#include "serving/server_cli.h"
#include "tests/serving/scripted_engine.h"

ABSL_FLAG(std::string, script_file, "",
          "JSON array of {\"match\": TEXT, \"output\": TEXT}: a prompt containing `match` gets "
          "`output` (then EOS)");
ABSL_FLAG(int, step_ms, 2, "how long each engine step takes");

namespace {

absl::StatusOr<std::unique_ptr<moe::engine::Engine>> CreateScripted(
    const moe::engine::ModelEngineOptions& o) {
  using moe::serving::testing::ScriptedEngine;
  moe::serving::testing::ScriptedEngineOptions options;
  if (o.model_dir.empty()) return absl::InvalidArgumentError("--model: a tokenizer folder is required");
  absl::StatusOr<std::unique_ptr<moe::tokenizer::Tokenizer>> tok =
      moe::tokenizer::Tokenizer::FromDirectory(o.model_dir);
  if (!tok.ok()) return tok.status();
  options.tokenizer = *std::move(tok);
  absl::StatusOr<std::unique_ptr<moe::tokenizer::ChatTemplate>> tmpl =
      moe::tokenizer::ChatTemplate::FromDirectory(o.model_dir);
  if (tmpl.ok()) options.chat_template = *std::move(tmpl);
  options.max_batch = o.max_batch;
  if (o.max_context > 0) options.max_context = o.max_context;
  options.kv_blocks = o.kv_blocks;
  options.prefill_chunk = o.prefill_chunk;
  options.step_time = absl::Milliseconds(absl::GetFlag(FLAGS_step_ms));
  const std::string script = absl::GetFlag(FLAGS_script_file);
  if (!script.empty()) {
    std::ifstream in(script);
    std::stringstream text;
    text << in.rdbuf();
    nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, false);
    if (!in || j.is_discarded() || !j.is_array()) {
      return absl::InvalidArgumentError(absl::StrCat("--script_file: ", script, " is not a JSON array"));
    }
    for (const auto& e : j) {
      if (!e.is_object() || !e.contains("match") || !e.contains("output") ||
          !e["match"].is_string() || !e["output"].is_string()) {
        return absl::InvalidArgumentError("--script_file: entries need string match and output");
      }
      options.script.push_back({e["match"].get<std::string>(), e["output"].get<std::string>()});
    }
  }
  return std::unique_ptr<moe::engine::Engine>(new ScriptedEngine(std::move(options)));
}

}  // namespace

int main(int argc, char** argv) { return moe::serving::ServerMain(argc, argv, CreateScripted); }
