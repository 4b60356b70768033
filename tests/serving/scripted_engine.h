// ScriptedEngine: an Engine (engine/engine.h) whose "model" replays scripted output, for tests of
// the serving layer. Everything around the sampling is real: the tokenizer and chat template it
// is given, continuous batching with chunked prefill over a bounded batch, a KV block pool with
// preemption of the newest sequence, stop strings, forced output tokens, cancellation, events
// with incremental text. What the model would sample is replaced by:
//   - the first script entry whose `match` occurs in the prompt's text: its `output`, tokenized,
//     then EOS (finish "stop");
//   - otherwise a pseudo-random sequence of ordinary tokens determined by the prompt ids (and the
//     seed when temperature > 0), until max_tokens (finish "length").
// So a stream's tokens never depend on what else is in the batch, like the real engine in its
// deterministic mode.
//
// Thread-safety: the Engine contract's (Submit/Cancel/HasWork/Stats from any thread, Step from
// one). Owns its tokenizer and template.
#ifndef MOE_TESTS_SERVING_SCRIPTED_ENGINE_H_
#define MOE_TESTS_SERVING_SCRIPTED_ENGINE_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/engine.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"

namespace moe::serving::testing {

struct ScriptEntry {
  std::string match;   // substring of the prompt text
  std::string output;  // what the "model" writes
};

struct ScriptedEngineOptions {
  int max_batch = 64;
  int max_context = 2048;
  int prefill_chunk = 64;
  int kv_block_size = 16;
  int kv_blocks = 0;  // 0: unbounded
  absl::Duration step_time = absl::Milliseconds(2);  // each Step sleeps this long
  std::vector<ScriptEntry> script;
  std::unique_ptr<tokenizer::Tokenizer> tokenizer;  // required
  std::unique_ptr<tokenizer::ChatTemplate> chat_template;  // optional
  std::string name = "scripted";
};

class ScriptedEngine final : public engine::Engine {
 public:
  explicit ScriptedEngine(ScriptedEngineOptions options);

  const engine::ModelInfo& model_info() const override { return info_; }
  const tokenizer::Tokenizer* tokenizer() const override { return options_.tokenizer.get(); }
  const tokenizer::ChatTemplate* chat_template() const override {
    return options_.chat_template.get();
  }
  absl::StatusOr<uint64_t> Submit(engine::GenerationRequest request) override;
  void Cancel(uint64_t request_id) override;
  absl::Status Step() override;
  bool HasWork() const override;
  engine::EngineStats Stats() const override;

 private:
  struct Sequence {
    uint64_t id = 0;
    engine::GenerationRequest request;
    std::vector<int32_t> prompt;
    std::vector<int32_t> script;  // scripted output ids (then EOS); empty: pseudo-random
    bool scripted = false;
    std::vector<int32_t> output;
    int prefilled = 0;  // tokens of prompt + output in the KV cache
    int blocks = 0;
    bool cancelled = false;
    std::string text;  // output text so far (for stop strings)
    std::unique_ptr<tokenizer::IncrementalDecoder> decoder;
  };

  int32_t NextToken(const Sequence& s) const;
  int BlocksFor(int tokens) const;

  ScriptedEngineOptions options_;
  engine::ModelInfo info_;
  int32_t eos_ = 0;

  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::deque<std::unique_ptr<Sequence>> waiting_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Sequence>> running_ ABSL_GUARDED_BY(mu_);  // admission order
  int blocks_used_ ABSL_GUARDED_BY(mu_) = 0;
  engine::EngineStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe::serving::testing

#endif  // MOE_TESTS_SERVING_SCRIPTED_ENGINE_H_
