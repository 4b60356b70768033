// generate: runs a prompt through the model engine on the CPU and prints the continuation with
// prefill and decode speed; or, with --input_ids/--dump_logits, writes teacher-forced logits for
// comparisons with other implementations.
//
//   generate [--model DIR] --prompt "Once upon a time" [--max-tokens 64] [--temperature 0.8]
//   generate [--model DIR] --input-ids ids.npy --dump-logits logits.npy [--dense-f32]
//
// Without --model it runs the embedded default model.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/formats.h"
#include "common/npy.h"
#include "common/status.h"
#include "common/thread_pool.h"
#include "engine/cpu_expert_backend.h"
#include "engine/engine_flags.h"
#include "engine/kv_cache.h"
#include "engine/linear_attention_state.h"
#include "engine/loader.h"
#include "engine/model.h"
#include "engine/model_engine.h"
#include "engine/tokenizer/chat_template.h"

ABSL_FLAG(std::string, prompt, "", "prompt text (encoded without special tokens)");
ABSL_FLAG(bool, chat, false, "wrap the prompt as one user message in the model's chat template");
ABSL_FLAG(int, max_tokens, 64, "tokens to generate");
ABSL_FLAG(float, temperature, 0.0f, "0: greedy");
ABSL_FLAG(int, top_k, 0, "0: off");
ABSL_FLAG(float, top_p, 1.0f, "nucleus sampling mass");
ABSL_FLAG(float, min_p, 0.0f, "min-p filter");
ABSL_FLAG(float, repetition_penalty, 1.0f, "1: off");
ABSL_FLAG(int64_t, seed, -1, "sampling seed; -1: none");
ABSL_FLAG(bool, ignore_eos, false, "keep generating past EOS");
ABSL_FLAG(bool, dense_f32, false, "dense weights in f32 (reference comparisons)");
ABSL_FLAG(std::string, input_ids, "", ".npy int32/int64 [batch, tokens]: teacher-forced input");
ABSL_FLAG(std::string, dump_logits, "", ".npy float32 [batch, tokens, vocab] output");

namespace moe::engine {
namespace {

absl::Status DumpLogits(const ModelEngineOptions& options) {
  std::string dir = options.model_dir.empty() ? DefaultModelDir() : options.model_dir;
  if (dir.empty()) return absl::NotFoundError("no --model and no embedded default model");
  ASSIGN_OR_RETURN(common::NpyArray ids_npy, common::ReadNpy(absl::GetFlag(FLAGS_input_ids)));
  if (ids_npy.shape.size() != 2 || ids_npy.shape[1] == 0) {
    return absl::InvalidArgumentError("--input_ids must be [batch, tokens] with tokens > 0");
  }
  if (ids_npy.dtype != common::NpyDtype::kInt32) {
    return absl::InvalidArgumentError("--input_ids must hold int32 or int64 token ids");
  }
  const std::vector<int32_t>& ids = ids_npy.i32;
  const int batch = static_cast<int>(ids_npy.shape[0]), len = static_cast<int>(ids_npy.shape[1]);
  LoadOptions lo;
  ASSIGN_OR_RETURN(lo.expert_format, ParseExpertFormat(options.expert_format));
  lo.dense_dtype = options.dense_f32 ? DType::kF32 : DType::kBf16;
  lo.threads = options.threads;
  ASSIGN_OR_RETURN(std::unique_ptr<ModelWeights> w, LoadModel(dir, lo));
  const ModelConfig& c = w->config;
  common::ThreadPool pool(options.threads > 0 ? options.threads : common::PhysicalCoreCount());
  std::vector<cpu_moe::ExpertBank> banks;
  for (int i = 0; i < c.NumMoeLayers(); ++i) banks.push_back(w->ExpertBankFor(i));
  CpuExpertBackend backend(
      banks, CpuExpertBackend::DefaultOptions(options.deterministic, options.dense_f32), &pool);
  ASSIGN_OR_RETURN(std::unique_ptr<Model> model,
                   Model::Create(w.get(), &backend, &pool, options.deterministic, len));
  const int bs = 16;
  ASSIGN_OR_RETURN(std::unique_ptr<KvCache> kv,
                   KvCache::Create(std::max(1, c.NumKvLayers()), c.num_key_value_heads, c.head_dim,
                                   bs, batch * ((len + bs - 1) / bs)));
  std::unique_ptr<LinearAttentionState> state;
  if (c.NumLinearAttentionLayers() > 0) {
    ASSIGN_OR_RETURN(state, LinearAttentionState::Create(c, batch));
  }
  std::vector<std::vector<int32_t>> tables(batch);
  std::vector<Model::Chunk> chunks;
  for (int b = 0; b < batch; ++b) {
    kv->Allocate((len + bs - 1) / bs, &tables[b]);
    chunks.push_back({absl::MakeConstSpan(ids.data() + static_cast<size_t>(b) * len, len), 0,
                      &tables[b], Model::Logits::kAll, b});
  }
  std::vector<float> logits;
  RETURN_IF_ERROR(model->Forward(chunks, kv.get(), &logits, state.get()));
  RETURN_IF_ERROR(common::WriteNpyFloat32(absl::GetFlag(FLAGS_dump_logits),
                                          {batch, len, c.vocab_size}, logits));
  std::fprintf(stderr, "wrote [%d, %d, %d] logits to %s\n", batch, len, c.vocab_size,
               absl::GetFlag(FLAGS_dump_logits).c_str());
  return absl::OkStatus();
}

absl::Status Generate(const ModelEngineOptions& options) {
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, CreateModelEngine(options));
  GenerationRequest r;
  r.prompt_text = absl::GetFlag(FLAGS_prompt);
  if (r.prompt_text.empty()) return absl::InvalidArgumentError("--prompt is empty");
  if (absl::GetFlag(FLAGS_chat)) {
    if (engine->chat_template() == nullptr) {
      return absl::InvalidArgumentError("--chat: the model folder has no chat template");
    }
    tokenizer::ChatTemplateInputs in;
    in.messages.push_back({{"role", "user"}, {"content", r.prompt_text}});
    in.add_generation_prompt = true;
    ASSIGN_OR_RETURN(r.prompt_text, engine->chat_template()->Render(in));
  }
  SamplingParams& sp = r.sampling;
  sp.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  sp.temperature = absl::GetFlag(FLAGS_temperature);
  sp.top_k = absl::GetFlag(FLAGS_top_k);
  sp.top_p = absl::GetFlag(FLAGS_top_p);
  sp.min_p = absl::GetFlag(FLAGS_min_p);
  sp.repetition_penalty = absl::GetFlag(FLAGS_repetition_penalty);
  sp.ignore_eos = absl::GetFlag(FLAGS_ignore_eos);
  if (absl::GetFlag(FLAGS_seed) >= 0) {
    sp.has_seed = true;
    sp.seed = static_cast<uint64_t>(absl::GetFlag(FLAGS_seed));
  }
  absl::Status failure;
  std::string reason;
  r.on_event = [&](const GenerationEvent& e) {
    std::fwrite(e.text.data(), 1, e.text.size(), stdout);
    std::fflush(stdout);
    if (e.finish_reason != FinishReason::kNone) reason = FinishReasonName(e.finish_reason);
    if (e.finish_reason == FinishReason::kError) failure = e.error;
  };
  const std::string prompt = r.prompt_text;
  ASSIGN_OR_RETURN(uint64_t id, engine->Submit(std::move(r)));
  (void)id;
  std::printf("%s", prompt.c_str());
  while (engine->HasWork()) RETURN_IF_ERROR(engine->Step());
  RETURN_IF_ERROR(failure);
  const EngineStats s = engine->Stats();
  std::printf("\n");
  std::fprintf(stderr,
               "[%s, %s experts, finish: %s] prefill %llu tokens at %.1f tok/s, decode %llu "
               "tokens at %.1f tok/s\n",
               engine->model_info().name.c_str(), engine->model_info().expert_format.c_str(),
               reason.c_str(), static_cast<unsigned long long>(s.prefill_tokens),
               s.prefill_seconds > 0 ? s.prefill_tokens / s.prefill_seconds : 0.0,
               static_cast<unsigned long long>(s.decode_tokens),
               s.decode_seconds > 0 ? s.decode_tokens / s.decode_seconds : 0.0);
  return absl::OkStatus();
}

}  // namespace
}  // namespace moe::engine

int main(int argc, char** argv) {
  moe::engine::ParseCommandLine(
      argc, argv,
      "generate [--model DIR] --prompt TEXT [--max-tokens N] [--temperature T] ...\n"
      "generate [--model DIR] --input-ids IDS.npy --dump-logits OUT.npy [--dense-f32]");
  auto options = moe::engine::ModelEngineOptionsFromFlags();
  if (!options.ok()) {
    std::fprintf(stderr, "%s\n", options.status().ToString().c_str());
    return 2;
  }
  options->dense_f32 = absl::GetFlag(FLAGS_dense_f32);
  const bool dump = !absl::GetFlag(FLAGS_dump_logits).empty();
  if (dump != !absl::GetFlag(FLAGS_input_ids).empty()) {
    std::fprintf(stderr, "--input_ids and --dump_logits go together\n");
    return 2;
  }
  absl::Status s = dump ? moe::engine::DumpLogits(*options) : moe::engine::Generate(*options);
  if (!s.ok()) {
    std::fprintf(stderr, "generate: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
