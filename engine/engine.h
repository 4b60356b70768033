// Engine: what a server drives. Requests go in (token ids or text, sampling parameters) and come
// back as a stream of events (token ids, text pieces, logprobs, a finish reason); Step() advances
// every active sequence: new ones are prefilled in chunks, running ones decode one token, all in
// one batch of variable size. When the KV pool runs out the newest sequence is preempted (its
// blocks freed, recomputed later): nothing fails or hangs for lack of KV memory.
//
// Two implementations: the model engine (model_engine.h) and scripted engines that tests of the
// serving layer use to replay model output.
//
// Threads: Submit, Cancel, HasWork, Stats and the accessors are thread-safe. Step is called by one
// thread at a time (the scheduler's); every callback runs on that thread, inside Step.
#ifndef MOE_ENGINE_ENGINE_H_
#define MOE_ENGINE_ENGINE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moe::tokenizer {
class Tokenizer;
class ChatTemplate;
}  // namespace moe::tokenizer

namespace moe::engine {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy
  int top_k = 0;             // 0: off
  float top_p = 1.0f;        // (0, 1]
  float min_p = 0.0f;        // [0, 1]
  float repetition_penalty = 1.0f;  // > 0; 1: off (applied to prompt and output tokens)
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  // The same seed gives the same tokens whatever else is in the batch. Without one the engine
  // draws a seed.
  bool has_seed = false;
  uint64_t seed = 0;
  int max_tokens = 16;  // >= 1
  std::vector<int32_t> stop_token_ids;  // in addition to the model's EOS ids
  std::vector<std::string> stop_strings;  // the output ends before the first match
  bool ignore_eos = false;
  bool logprobs = false;  // report the sampled token's logprob
  int top_logprobs = 0;   // and the n most likely (0..20)

  // InvalidArgument naming the field for NaN, negative or out-of-range values.
  absl::Status Validate() const;
};

enum class FinishReason { kNone, kStop, kLength, kCancelled, kError };
// "stop", "length", "cancelled", "error" ("" for kNone).
const char* FinishReasonName(FinishReason reason);

struct TopLogprob {
  int32_t token_id = 0;
  float logprob = 0.0f;
};

struct GenerationEvent {
  uint64_t request_id = 0;
  // Tokens this event reports (one per decode step; empty on a final event that adds none).
  std::vector<int32_t> token_ids;
  // Their text: complete UTF-8 only (bytes of an unfinished character wait for the next event);
  // text from a matched stop string on is never sent.
  std::string text;
  // With SamplingParams::logprobs: one entry per token in token_ids.
  std::vector<float> logprobs;
  std::vector<std::vector<TopLogprob>> top_logprobs;
  // kNone while the sequence runs; the last event of a request has its reason.
  FinishReason finish_reason = FinishReason::kNone;
  absl::Status error;  // set with kError
  int prompt_tokens = 0;
  int completion_tokens = 0;
};

using EventCallback = std::function<void(const GenerationEvent&)>;

struct GenerationRequest {
  // The prompt as ids, or as text (encoded without special tokens) when prompt_ids is empty.
  std::vector<int32_t> prompt_ids;
  std::string prompt_text;
  // Tokens the output must start with (forced, not sampled; they count as output tokens). The
  // server forces a tool-call prefix with it.
  std::vector<int32_t> forced_output_ids;
  SamplingParams sampling;
  // Called on the Step() thread for every event of this request, the last one with a finish
  // reason. It must not block for long and must not call Step(); it may call Cancel().
  EventCallback on_event;
};

struct ModelInfo {
  std::string name;          // the model folder's name
  std::string family;        // "qwen3_moe", "qwen2_moe"
  int vocab_size = 0;
  int max_context = 0;       // tokens a sequence may hold (prompt + output)
  std::vector<int32_t> eos_token_ids;
  int num_layers = 0;
  int hidden_size = 0;
  int num_experts = 0;
  int experts_per_token = 0;
  std::string expert_format;  // "bf16", "q4_0", ...
  std::string backend;        // "cpu", "gpu"
};

struct EngineStats {
  uint64_t requests_submitted = 0;
  uint64_t requests_finished = 0;
  uint64_t prefill_tokens = 0;
  uint64_t decode_tokens = 0;
  double prefill_seconds = 0.0;  // time spent in steps that prefilled
  double decode_seconds = 0.0;   // time spent in steps that only decoded
  int running = 0;               // sequences holding KV blocks
  int waiting = 0;               // submitted or preempted, not yet running
  int last_batch_size = 0;       // rows of the last step
  uint64_t steps = 0;
  uint64_t preemptions = 0;
  int kv_blocks_total = 0;
  int kv_blocks_used = 0;
  // Expert cache, where one runs (zeros on the CPU backend).
  uint64_t expert_cache_hits = 0;
  uint64_t expert_cache_misses = 0;
  // Hybrid experts: misses computed on the CPU instead of fetched (distinct per layer and step).
  uint64_t expert_cpu_computed = 0;
  uint64_t expert_fetched_bytes = 0;
  uint64_t memory_bytes = 0;  // weights + KV pool + scratch
};

class Engine {
 public:
  virtual ~Engine() = default;

  virtual const ModelInfo& model_info() const = 0;
  // The model's tokenizer and chat template; either may be null (a model folder without them).
  virtual const tokenizer::Tokenizer* tokenizer() const = 0;
  virtual const tokenizer::ChatTemplate* chat_template() const = 0;

  // Queues a request and returns its id. InvalidArgument for an empty prompt, ids outside the
  // vocabulary, prompt + max_tokens over max_context (naming both numbers), or bad sampling
  // parameters. No event is delivered for a refused request.
  virtual absl::StatusOr<uint64_t> Submit(GenerationRequest request) = 0;
  // Ends the request: its blocks are freed at the next Step, which delivers its final event
  // (kCancelled). Unknown or finished ids are ignored.
  virtual void Cancel(uint64_t request_id) = 0;
  // Advances every active sequence once. An error here is the engine's own failure (a forward
  // pass out of device memory, a CUDA error); bad requests never make Step fail. The engine ends
  // the requests the failure touched with it (their final kError events arrive during this
  // Step), frees their blocks and stays usable: requests not in the failed batch, and new ones,
  // run at later steps.
  virtual absl::Status Step() = 0;
  // True while any request is queued, running or awaits its final event.
  virtual bool HasWork() const = 0;
  virtual EngineStats Stats() const = 0;
};

}  // namespace moe::engine

#endif  // MOE_ENGINE_ENGINE_H_
