#include "engine/model_engine.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/formats.h"
#include "common/status.h"
#include "common/thread_pool.h"
#include "engine/cpu_expert_backend.h"
#include "engine/cuda/gpu_model.h"
#include "engine/forward_model.h"
#include "engine/kv_cache.h"
#include "engine/linear_attention_state.h"
#include "engine/loader.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"

namespace moe::engine {
namespace {

// One request from Submit to its final event. Owned by the engine; touched only by the Step
// thread once it left the incoming queue.
struct Sequence {
  uint64_t id = 0;
  GenerationRequest request;
  std::vector<int32_t> tokens;  // prompt, then output (forced first)
  int prompt_len = 0;
  int num_computed = 0;         // tokens whose keys and values are in the cache
  std::vector<int32_t> blocks;  // KV block table
  int state_slot = -1;          // linear-attention state slot while running (-1: none)
  uint64_t seed = 0;
  bool started = false;   // admitted at least once (sampler, decoder made, forced sent)
  bool finished = false;  // its final event was delivered
  std::unique_ptr<SequenceSampler> sampler;
  std::unique_ptr<tokenizer::IncrementalDecoder> decoder;
  std::string text;      // output text decoded so far
  size_t text_sent = 0;  // bytes of `text` already delivered
  int outputs() const { return static_cast<int>(tokens.size()) - prompt_len; }
};

// The CPU model over a host KV cache (and, for models with linear-attention layers, a
// LinearAttentionState of one slot per sequence of a batch), as a ForwardModel. Owns the expert
// backend, the model, the KV storage and the state; borrows the weights, banks and thread pool.
class CpuForwardModel final : public ForwardModel {
 public:
  static absl::StatusOr<std::unique_ptr<ForwardModel>> Create(const ModelEngineParts& parts,
                                                              const ModelEngineOptions& options,
                                                              common::ThreadPool* pool,
                                                              int max_context, int kv_blocks) {
    const ModelConfig& c = parts.weights->config;
    auto m = std::unique_ptr<CpuForwardModel>(new CpuForwardModel());
    m->backend_ = std::make_unique<CpuExpertBackend>(
        parts.banks,
        CpuExpertBackend::DefaultOptions(options.deterministic, parts.f32_expert_activations),
        pool);
    ASSIGN_OR_RETURN(m->model_, Model::Create(parts.weights, m->backend_.get(), pool,
                                              options.deterministic, max_context));
    // Only full-attention layers keep keys and values (at least one layer's worth, so that the
    // block tables stay meaningful for a model of linear-attention layers alone).
    ASSIGN_OR_RETURN(m->kv_,
                     KvCache::Create(std::max(1, c.NumKvLayers()), c.num_key_value_heads,
                                     c.head_dim, options.kv_block_size, kv_blocks));
    if (c.NumLinearAttentionLayers() > 0) {
      ASSIGN_OR_RETURN(m->state_, LinearAttentionState::Create(c, options.max_batch));
    }
    for (const auto& b : parts.banks) m->weight_bytes_ += b.BytesPerExpert() * b.num_experts;
    return std::unique_ptr<ForwardModel>(std::move(m));
  }

  absl::Status Forward(absl::Span<const ModelChunk> chunks, std::vector<float>* logits) override {
    return model_->Forward(chunks, kv_.get(), logits, state_.get());
  }
  const ModelConfig& config() const override { return model_->config(); }
  int max_positions() const override { return model_->max_positions(); }
  int kv_blocks() const override { return kv_->num_blocks(); }
  int kv_block_size() const override { return kv_->block_size(); }
  int state_slots() const override { return state_ != nullptr ? state_->num_slots() : 0; }
  uint64_t memory_bytes() const override {
    return weight_bytes_ + kv_->bytes() + (state_ != nullptr ? state_->bytes() : 0);
  }
  std::string backend() const override { return "cpu"; }
  void set_routing_override(RoutingOverride* routing) override {
    model_->set_routing_override(routing);
  }

 private:
  CpuForwardModel() = default;
  std::unique_ptr<CpuExpertBackend> backend_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<KvCache> kv_;
  std::unique_ptr<LinearAttentionState> state_;  // null without linear-attention layers
  uint64_t weight_bytes_ = 0;
};

class ModelEngine final : public Engine {
 public:
  ModelEngine(ModelEngineParts parts, const ModelEngineOptions& options, ModelInfo info)
      : parts_(std::move(parts)),
        options_(options),
        info_(std::move(info)),
        seed_rng_(options.seed) {}

  absl::Status Init();

  const ModelInfo& model_info() const override { return info_; }
  const tokenizer::Tokenizer* tokenizer() const override { return parts_.tokenizer.get(); }
  const tokenizer::ChatTemplate* chat_template() const override {
    return parts_.chat_template.get();
  }
  absl::StatusOr<uint64_t> Submit(GenerationRequest request) override;
  void Cancel(uint64_t request_id) override;
  absl::Status Step() override;
  bool HasWork() const override;
  EngineStats Stats() const override;

 private:
  // Delivers an event and, for a final one, counts the request finished.
  void Emit(Sequence& s, GenerationEvent event);
  void Finish(Sequence& s, FinishReason reason, std::vector<int32_t> ids = {},
              absl::Status error = absl::OkStatus());
  // Starts a newly admitted sequence: its sampler and decoder, and its forced output tokens.
  // False when it already finished (max_tokens reached by the forced tokens).
  bool Start(Sequence& s);
  // Appends one sampled token and delivers its event; finishes the sequence when it ends.
  void Append(Sequence& s, const SampleResult& r);
  // Adds the text of `id` (complete UTF-8 only) to s.text.
  void AddText(Sequence& s, int32_t id);
  // Preempts the newest running sequence (frees its blocks, back to the waiting queue).
  void PreemptNewest();
  // Gives back what a sequence holds while it runs: its KV blocks and its state slot.
  void Release(Sequence& s);
  // Running and waiting sequences and KV blocks in use, into stats_ (on the Step thread).
  void UpdateOccupancy() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  ModelEngineParts parts_;
  ModelEngineOptions options_;
  ModelInfo info_;
  std::unique_ptr<common::ThreadPool> pool_;
  // The GPU model's expert store when the parts' weights hold none (models made in memory).
  std::unique_ptr<moe_cache::ExpertStore> store_;
  std::unique_ptr<ForwardModel> model_;
  const gpu::GpuModel* gpu_model_ = nullptr;  // model_'s GPU model (its cache counters), if any
  std::unique_ptr<KvBlockAllocator> kv_;
  // Linear-attention state slots (models with state_slots() > 0; null otherwise): one per
  // running sequence.
  std::unique_ptr<StateSlotAllocator> slots_;
  size_t max_stop_len_ = 0;

  // Step-thread state.
  std::vector<std::unique_ptr<Sequence>> running_;  // sorted by id (oldest first)
  std::deque<std::unique_ptr<Sequence>> waiting_;   // sorted by id (oldest first)

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Sequence>> incoming_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<uint64_t> cancelled_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  Rng seed_rng_ ABSL_GUARDED_BY(mu_);
  int active_ ABSL_GUARDED_BY(mu_) = 0;
  EngineStats stats_ ABSL_GUARDED_BY(mu_);
};

absl::Status ModelEngine::Init() {
  const ModelConfig& c = parts_.weights->config;
  if (static_cast<int>(parts_.banks.size()) != c.NumMoeLayers()) {
    return absl::InvalidArgumentError(
        absl::StrCat(parts_.banks.size(), " expert banks for ", c.NumMoeLayers(), " MoE layers"));
  }
  const int threads = options_.threads > 0 ? options_.threads : common::PhysicalCoreCount();
  pool_ = std::make_unique<common::ThreadPool>(threads);
  const int bs = options_.kv_block_size;
  const int per_seq = (info_.max_context + bs - 1) / bs;
  if (options_.backend == "cuda") {
    const moe_cache::ExpertStore* store = parts_.weights->experts.get();
    if (store == nullptr && !parts_.banks.empty()) {
      ASSIGN_OR_RETURN(store_, gpu::ExpertStoreFromBanks(parts_.banks));
      store = store_.get();
    }
    gpu::GpuModelOptions go;
    go.max_batch = options_.max_batch;
    go.max_step_tokens = std::max(options_.max_batch, options_.prefill_chunk);
    go.max_context = info_.max_context;
    go.kv_block_size = bs;
    go.kv_blocks = options_.kv_blocks;
    go.expert_budget_gib = options_.gpu.expert_budget_gb;
    go.cache_policy = options_.gpu.cache_policy;
    go.pin_hot_experts = options_.gpu.pin_hot_experts;
    go.adapt_every = options_.gpu.adapt_every;
    go.graphs = options_.gpu.graphs;
    go.deterministic = options_.deterministic;
    const GpuEngineOptions::MoeMode mode = options_.gpu.moe_mode;
    const std::string& profile_path = options_.gpu.bandwidth_profile;
    bool write_profile = false;
    if (mode != GpuEngineOptions::MoeMode::kOffload) {
      go.hybrid = true;
      go.hybrid_auto = mode == GpuEngineOptions::MoeMode::kAuto;
      go.hybrid_threads = threads;
      std::error_code ec;
      if (!profile_path.empty() && std::filesystem::exists(profile_path, ec)) {
        absl::StatusOr<moe_cache::BandwidthProfile> p =
            moe_cache::ReadBandwidthProfile(profile_path);
        if (!p.ok()) {
          return absl::Status(p.status().code(),
                              absl::StrCat("--bandwidth_profile ", profile_path, ": ",
                                           p.status().message(),
                                           " (delete it to measure a new one at start)"));
        }
        go.hybrid_profile = *p;
        std::fprintf(stderr, "hybrid experts: bandwidth profile from %s\n", profile_path.c_str());
      } else {
        write_profile = !profile_path.empty();
      }
    }
    ASSIGN_OR_RETURN(std::unique_ptr<gpu::GpuModel> gm,
                     gpu::GpuModel::Create(parts_.weights, store, go));
    if (write_profile) {
      std::error_code ec;
      std::filesystem::create_directories(std::filesystem::path(profile_path).parent_path(), ec);
      const absl::Status ws = moe_cache::WriteBandwidthProfile(gm->hybrid_profile(), profile_path);
      if (ws.ok()) {
        std::fprintf(stderr, "hybrid experts: bandwidth profile written to %s\n",
                     profile_path.c_str());
      } else {
        std::fprintf(stderr, "hybrid experts: could not keep the profile: %s\n",
                     ws.ToString().c_str());
      }
    }
    gpu_model_ = gm.get();
    model_ = std::move(gm);
  } else {
    int blocks = options_.kv_blocks;
    const uint64_t block_bytes = 2ull * std::max(1, c.NumKvLayers()) * c.num_key_value_heads *
                                 bs * c.head_dim * sizeof(float);
    if (blocks == 0) {
      uint64_t want = static_cast<uint64_t>(per_seq) * options_.max_batch;
      const uint64_t pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
      const uint64_t cap = std::max<uint64_t>(per_seq, pages * page / 4 / block_bytes);
      blocks = static_cast<int>(std::min(want, cap));
    }
    if (blocks < per_seq) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kv_blocks ", blocks, " of ", bs, " tokens cannot hold one sequence of max_context ",
          info_.max_context, " (needs ", per_seq, ")"));
    }
    ASSIGN_OR_RETURN(model_, CpuForwardModel::Create(parts_, options_, pool_.get(),
                                                     info_.max_context, blocks));
  }
  if (options_.wrap_model) {
    model_ = options_.wrap_model(std::move(model_));
    if (model_ == nullptr) return absl::InvalidArgumentError("wrap_model returned no model");
  }
  kv_ = std::make_unique<KvBlockAllocator>(model_->kv_blocks(), model_->kv_block_size());
  if (model_->state_slots() > 0) {
    slots_ = std::make_unique<StateSlotAllocator>(model_->state_slots());
  } else if (c.NumLinearAttentionLayers() > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the ", options_.backend, " model keeps no linear-attention state for the ",
        c.NumLinearAttentionLayers(), " linear-attention layers of this ", c.model_type));
  }
  absl::MutexLock lock(&mu_);
  stats_.kv_blocks_total = model_->kv_blocks();
  stats_.memory_bytes = model_->memory_bytes();
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ModelEngine::Submit(GenerationRequest request) {
  RETURN_IF_ERROR(request.sampling.Validate());
  auto s = std::make_unique<Sequence>();
  if (request.prompt_ids.empty()) {
    if (request.prompt_text.empty()) return absl::InvalidArgumentError("empty prompt");
    if (parts_.tokenizer == nullptr) {
      return absl::InvalidArgumentError("a text prompt needs a tokenizer; this model has none");
    }
    request.prompt_ids = parts_.tokenizer->Encode(request.prompt_text, false);
    if (request.prompt_ids.empty()) {
      return absl::InvalidArgumentError("the prompt text encodes to no tokens");
    }
  }
  for (const auto* ids : {&request.prompt_ids, &request.forced_output_ids}) {
    for (int32_t id : *ids) {
      if (id < 0 || id >= info_.vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("token id ", id, " outside the vocabulary [0, ", info_.vocab_size, ")"));
      }
    }
  }
  if (!request.sampling.stop_strings.empty() && parts_.tokenizer == nullptr) {
    return absl::InvalidArgumentError("stop strings need a tokenizer; this model has none");
  }
  const int64_t total =
      static_cast<int64_t>(request.prompt_ids.size()) + request.sampling.max_tokens;
  if (total > info_.max_context) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt of ", request.prompt_ids.size(), " tokens + max_tokens ",
        request.sampling.max_tokens, " exceeds the context of ", info_.max_context, " tokens"));
  }
  s->prompt_len = static_cast<int>(request.prompt_ids.size());
  s->tokens = request.prompt_ids;
  s->request = std::move(request);
  absl::MutexLock lock(&mu_);
  s->id = next_id_++;
  s->seed = s->request.sampling.has_seed ? s->request.sampling.seed : seed_rng_.Next();
  const uint64_t id = s->id;
  incoming_.push_back(std::move(s));
  ++active_;
  ++stats_.requests_submitted;
  return id;
}

void ModelEngine::Cancel(uint64_t request_id) {
  absl::MutexLock lock(&mu_);
  cancelled_.insert(request_id);
}

bool ModelEngine::HasWork() const {
  absl::MutexLock lock(&mu_);
  return active_ > 0;
}

EngineStats ModelEngine::Stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void ModelEngine::Emit(Sequence& s, GenerationEvent event) {
  event.request_id = s.id;
  event.prompt_tokens = s.prompt_len;
  event.completion_tokens = s.outputs();
  const bool final = event.finish_reason != FinishReason::kNone;
  if (final) s.finished = true;
  if (s.request.on_event) s.request.on_event(event);
  if (final) {
    absl::MutexLock lock(&mu_);
    --active_;
    ++stats_.requests_finished;
  }
}

void ModelEngine::Finish(Sequence& s, FinishReason reason, std::vector<int32_t> ids,
                         absl::Status error) {
  GenerationEvent e;
  e.token_ids = std::move(ids);
  if (reason != FinishReason::kStop || s.text_sent < s.text.size()) {
    // Whatever text is still held back (no stop string matched in it).
    if (s.decoder != nullptr && reason != FinishReason::kStop) s.text += s.decoder->Flush();
    if (reason != FinishReason::kStop) {
      e.text = s.text.substr(s.text_sent);
      s.text_sent = s.text.size();
    }
  }
  e.finish_reason = reason;
  e.error = std::move(error);
  Release(s);
  Emit(s, std::move(e));
}

void ModelEngine::AddText(Sequence& s, int32_t id) {
  if (s.decoder == nullptr) return;
  s.text += s.decoder->Add(id);
}

bool ModelEngine::Start(Sequence& s) {
  s.started = true;
  s.sampler =
      std::make_unique<SequenceSampler>(s.request.sampling, s.seed, absl::MakeConstSpan(s.tokens));
  if (parts_.tokenizer != nullptr) {
    s.decoder = std::make_unique<tokenizer::IncrementalDecoder>(*parts_.tokenizer,
                                                                /*skip_special_tokens=*/true);
  }
  const std::vector<int32_t>& forced = s.request.forced_output_ids;
  if (forced.empty()) return true;
  const int n = std::min<int>(forced.size(), s.request.sampling.max_tokens);
  GenerationEvent e;
  for (int i = 0; i < n; ++i) {
    s.tokens.push_back(forced[i]);
    s.sampler->Accept(forced[i]);
    AddText(s, forced[i]);
    e.token_ids.push_back(forced[i]);
    if (s.request.sampling.logprobs) {
      e.logprobs.push_back(0.0f);  // not sampled: no distribution was looked at
      e.top_logprobs.emplace_back();
    }
  }
  if (n >= s.request.sampling.max_tokens) {
    if (s.decoder != nullptr) s.text += s.decoder->Flush();
    e.text = s.text;
    s.text_sent = s.text.size();
    e.finish_reason = FinishReason::kLength;
    Release(s);
    Emit(s, std::move(e));
    return false;
  }
  e.text = s.text;  // forced text is never matched against stop strings
  s.text_sent = s.text.size();
  Emit(s, std::move(e));
  return true;
}

void ModelEngine::Append(Sequence& s, const SampleResult& r) {
  const SamplingParams& sp = s.request.sampling;
  s.tokens.push_back(r.token);
  GenerationEvent e;
  e.token_ids = {r.token};
  if (sp.logprobs) {
    e.logprobs = {r.logprob};
    e.top_logprobs = {r.top};
  }
  bool eos = false;
  if (!sp.ignore_eos) {
    for (int32_t t : info_.eos_token_ids) eos |= t == r.token;
  }
  for (int32_t t : sp.stop_token_ids) eos |= t == r.token;
  if (!eos) AddText(s, r.token);
  // Stop strings: a match can only end in text not yet sent (earlier text was searched).
  size_t stop_at = std::string::npos;
  size_t max_len = 0;
  for (const std::string& stop : sp.stop_strings) {
    max_len = std::max(max_len, stop.size());
    const size_t from = s.text_sent;
    const size_t p = s.text.find(stop, from);
    if (p != std::string::npos) stop_at = std::min(stop_at, p);
  }
  if (stop_at != std::string::npos) {
    e.text = s.text.substr(s.text_sent, stop_at - s.text_sent);
    s.text.resize(stop_at);
    s.text_sent = s.text.size();
    e.finish_reason = FinishReason::kStop;
    Release(s);
    Emit(s, std::move(e));
    return;
  }
  const bool length = s.outputs() >= sp.max_tokens;
  if (eos || length) {
    if (s.decoder != nullptr) s.text += s.decoder->Flush();
    e.text = s.text.substr(s.text_sent);
    s.text_sent = s.text.size();
    e.finish_reason = eos ? FinishReason::kStop : FinishReason::kLength;
    Release(s);
    Emit(s, std::move(e));
    return;
  }
  // Hold back the last max_len - 1 bytes: a stop string may still complete there.
  size_t safe = s.text.size();
  if (max_len > 1) safe = s.text.size() >= max_len - 1 ? s.text.size() - (max_len - 1) : 0;
  while (safe > s.text_sent && safe < s.text.size() &&
         (static_cast<unsigned char>(s.text[safe]) & 0xC0) == 0x80) {
    --safe;  // never split a UTF-8 sequence
  }
  if (safe > s.text_sent) {
    e.text = s.text.substr(s.text_sent, safe - s.text_sent);
    s.text_sent = safe;
  }
  Emit(s, std::move(e));
}

void ModelEngine::Release(Sequence& s) {
  kv_->Free(&s.blocks);
  if (slots_ != nullptr) slots_->Free(&s.state_slot);
}

void ModelEngine::PreemptNewest() {
  auto newest = std::max_element(running_.begin(), running_.end(),
                                 [](const auto& a, const auto& b) { return a->id < b->id; });
  std::unique_ptr<Sequence> s = std::move(*newest);
  running_.erase(newest);
  Release(*s);
  s->num_computed = 0;
  auto pos = std::lower_bound(waiting_.begin(), waiting_.end(), s->id,
                              [](const auto& w, uint64_t id) { return w->id < id; });
  waiting_.insert(pos, std::move(s));
  absl::MutexLock lock(&mu_);
  ++stats_.preemptions;
}

absl::Status ModelEngine::Step() {
  const auto t0 = std::chrono::steady_clock::now();
  absl::flat_hash_set<uint64_t> cancelled;
  {
    absl::MutexLock lock(&mu_);
    for (auto& s : incoming_) waiting_.push_back(std::move(s));
    incoming_.clear();
    cancelled.swap(cancelled_);
  }
  // Cancellations: final event, blocks back to the pool.
  if (!cancelled.empty()) {
    auto cancel_in = [&](auto& list) {
      for (auto it = list.begin(); it != list.end();) {
        if (cancelled.contains((*it)->id)) {
          Finish(**it, FinishReason::kCancelled);
          it = list.erase(it);
        } else {
          ++it;
        }
      }
    };
    cancel_in(running_);
    cancel_in(waiting_);
  }
  // Admission, oldest first.
  while (static_cast<int>(running_.size()) < options_.max_batch && !waiting_.empty()) {
    if (slots_ != nullptr && slots_->free_slots() == 0) break;
    std::unique_ptr<Sequence> s = std::move(waiting_.front());
    waiting_.pop_front();
    if (!s->started && !Start(*s)) continue;
    if (slots_ != nullptr) slots_->Allocate(&s->state_slot);
    running_.push_back(std::move(s));
  }
  std::sort(running_.begin(), running_.end(),
            [](const auto& a, const auto& b) { return a->id < b->id; });
  // Plan the step: each running sequence computes its next chunk; blocks are taken oldest
  // first, and when the pool runs dry the newest sequence gives its blocks back.
  std::vector<Sequence*> planned;
  std::vector<int> counts;
  for (size_t i = 0; i < running_.size();) {
    Sequence& s = *running_[i];
    const int n =
        std::min<int>(options_.prefill_chunk, static_cast<int>(s.tokens.size()) - s.num_computed);
    const int need = (s.num_computed + n + kv_->block_size() - 1) / kv_->block_size() -
                     static_cast<int>(s.blocks.size());
    if (need <= 0 || kv_->Allocate(need, &s.blocks)) {
      planned.push_back(&s);
      counts.push_back(n);
      ++i;
      continue;
    }
    const uint64_t id = s.id;
    const bool self_newest =
        std::all_of(running_.begin(), running_.end(), [&](const auto& o) { return o->id <= id; });
    // Sequences planned earlier are older than s, so the newest is s or not yet planned.
    PreemptNewest();
    if (self_newest) continue;  // s itself went back; index i now holds the next one
  }
  EngineStats delta;
  if (!planned.empty()) {
    std::vector<Model::Chunk> chunks;
    std::vector<Sequence*> sampled;
    bool prefill = false;
    for (size_t i = 0; i < planned.size(); ++i) {
      Sequence& s = *planned[i];
      Model::Chunk ch;
      ch.tokens = absl::MakeConstSpan(s.tokens).subspan(s.num_computed, counts[i]);
      ch.start = s.num_computed;
      ch.block_table = &s.blocks;
      ch.state_slot = s.state_slot;
      const bool done = s.num_computed + counts[i] == static_cast<int>(s.tokens.size());
      ch.logits = done ? Model::Logits::kLast : Model::Logits::kNone;
      if (done) sampled.push_back(&s);
      if (counts[i] > 1 || s.num_computed + counts[i] <= s.prompt_len) prefill = true;
      if (s.num_computed < s.prompt_len) {
        delta.prefill_tokens += std::min(counts[i], s.prompt_len - s.num_computed);
      }
      chunks.push_back(ch);
    }
    std::vector<float> logits;
    absl::Status st = model_->Forward(chunks, &logits);
    if (!st.ok()) {
      // The engine's own failure (device memory, a CUDA error): the batch's keys and values may
      // be half written, so every running request ends with it and gives its blocks back.
      // Waiting requests were not in the batch: they stay queued and run at later steps.
      for (auto& s : running_) Finish(*s, FinishReason::kError, {}, st);
      running_.clear();
      absl::MutexLock lock(&mu_);
      UpdateOccupancy();
      return st;
    }
    for (size_t i = 0; i < planned.size(); ++i) planned[i]->num_computed += counts[i];
    const int V = info_.vocab_size;
    for (size_t i = 0; i < sampled.size(); ++i) {
      Sequence& s = *sampled[i];
      const SamplingParams& sp = s.request.sampling;
      SampleResult r =
          s.sampler->Sample(absl::MakeConstSpan(logits.data() + i * static_cast<size_t>(V), V),
                            sp.logprobs || sp.top_logprobs > 0, sp.top_logprobs);
      // Decode tokens: those sampled after a one-token step of an output position (the first
      // token, sampled at the end of the prompt's prefill, counts as prefill's).
      if (s.num_computed > s.prompt_len) ++delta.decode_tokens;
      Append(s, r);
    }
    // Drop finished sequences (their blocks were freed with their final event).
    running_.erase(
        std::remove_if(running_.begin(), running_.end(), [](const auto& s) { return s->finished; }),
        running_.end());
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    (prefill ? delta.prefill_seconds : delta.decode_seconds) = secs;
    delta.last_batch_size = 0;
    for (int n : counts) delta.last_batch_size += n;
  }
  absl::MutexLock lock(&mu_);
  stats_.prefill_tokens += delta.prefill_tokens;
  stats_.decode_tokens += delta.decode_tokens;
  stats_.prefill_seconds += delta.prefill_seconds;
  stats_.decode_seconds += delta.decode_seconds;
  if (!planned.empty()) {
    stats_.last_batch_size = delta.last_batch_size;
    ++stats_.steps;
  }
  UpdateOccupancy();
  return absl::OkStatus();
}

void ModelEngine::UpdateOccupancy() {
  stats_.running = static_cast<int>(running_.size());
  stats_.waiting = static_cast<int>(waiting_.size() + incoming_.size());
  stats_.kv_blocks_used = kv_->used_blocks();
  if (gpu_model_ != nullptr) {
    // Routed (layer, token, expert) uses that went through the cache: those that found their
    // expert in a slot, and misses (prefill passes that streamed their experts are neither).
    const gpu::GpuCacheStats& g = gpu_model_->stats();
    stats_.expert_cache_misses = static_cast<uint64_t>(g.misses);
    stats_.expert_cpu_computed = static_cast<uint64_t>(g.cpu_experts);
    stats_.expert_cache_hits = static_cast<uint64_t>(
        std::max<int64_t>(0, g.routes - g.streamed_routes - g.misses - g.cpu_routes));
  }
}

int DefaultMaxContext(const ModelConfig& c, int requested) {
  if (requested > 0) return requested;
  return std::min(c.max_position_embeddings > 0 ? c.max_position_embeddings : 4096, 4096);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> CreateModelEngineFromParts(
    ModelEngineParts parts, const ModelEngineOptions& options) {
  if (parts.weights == nullptr) return absl::InvalidArgumentError("no weights");
  if (options.max_batch < 1 || options.prefill_chunk < 1 || options.kv_block_size < 1 ||
      options.kv_blocks < 0 || options.max_context < 0 || options.threads < 0 ||
      (options.backend != "cpu" && options.backend != "cuda")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "engine options: max_batch ", options.max_batch, ", prefill_chunk ", options.prefill_chunk,
        ", kv_block_size ", options.kv_block_size, " must be >= 1; kv_blocks ", options.kv_blocks,
        ", max_context ", options.max_context, ", threads ", options.threads,
        " >= 0; backend \"", options.backend, "\" must be cpu or cuda"));
  }
  const ModelConfig& c = parts.weights->config;
  ModelInfo info;
  info.name = parts.name;
  info.family = c.model_type;
  info.vocab_size = c.vocab_size;
  info.max_context = DefaultMaxContext(c, options.max_context);
  if (c.max_position_embeddings > 0 && info.max_context > c.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("max_context ", info.max_context,
                                                   " exceeds the model's ",
                                                   c.max_position_embeddings, " positions"));
  }
  info.eos_token_ids = c.eos_token_ids;
  info.num_layers = c.num_hidden_layers;
  info.hidden_size = c.hidden_size;
  info.num_experts = c.num_experts;
  info.experts_per_token = c.num_experts_per_tok;
  // "auto" (or nothing) reports what it resolved to: the format the weights hold.
  info.expert_format =
      options.expert_format.empty() || options.expert_format == kAutoExpertFormat
          ? std::string(common::WeightFormatName(parts.weights->expert_format))
          : options.expert_format;
  info.backend = options.backend;
  auto engine = std::make_unique<ModelEngine>(std::move(parts), options, std::move(info));
  RETURN_IF_ERROR(engine->Init());
  return engine;
}

absl::StatusOr<std::unique_ptr<Engine>> CreateModelEngine(const ModelEngineOptions& options) {
  std::string dir = options.model_dir;
  if (dir.empty()) {
    dir = DefaultModelDir();
    if (dir.empty()) {
      return absl::NotFoundError(
          "no --model given and the embedded default model (models/tiny_qwen3_moe) is not in "
          "this binary's runfiles; set MOE_DEFAULT_MODEL_DIR or pass --model DIR");
    }
  }
  LoadOptions lo;
  ASSIGN_OR_RETURN(lo.expert_format, ParseExpertFormat(options.expert_format));
  lo.dense_dtype = options.dense_f32 ? DType::kF32 : DType::kBf16;
  lo.threads = options.threads;
  ASSIGN_OR_RETURN(std::unique_ptr<ModelWeights> weights, LoadModel(dir, lo));
  ModelEngineParts parts;
  parts.weights = weights.get();
  for (int i = 0; i < weights->config.NumMoeLayers(); ++i) {
    parts.banks.push_back(weights->ExpertBankFor(i));
  }
  parts.keepalive = std::shared_ptr<ModelWeights>(std::move(weights));
  // f32 dense weights are for comparisons with float references: keep the experts' activations
  // in f32 too.
  parts.f32_expert_activations = options.dense_f32;
  namespace fs = std::filesystem;
  if (fs::exists(fs::path(dir) / "tokenizer.json")) {
    ASSIGN_OR_RETURN(std::unique_ptr<tokenizer::Tokenizer> tok,
                     tokenizer::Tokenizer::FromDirectory(dir));
    parts.tokenizer = std::move(tok);
  }
  if (fs::exists(fs::path(dir) / "tokenizer_config.json")) {
    auto tmpl = tokenizer::ChatTemplate::FromDirectory(dir);
    if (tmpl.ok()) {
      parts.chat_template = std::move(*tmpl);
    } else if (!absl::IsNotFound(tmpl.status())) {
      return tmpl.status();  // a template this interpreter cannot run: say so at load time
    }
  }
  parts.name = fs::path(dir).lexically_normal().filename().string();
  if (parts.name.empty()) parts.name = fs::path(dir).lexically_normal().parent_path().filename();
  return CreateModelEngineFromParts(std::move(parts), options);
}

std::string DefaultModelDir() {
  namespace fs = std::filesystem;
  const char* env = std::getenv("MOE_DEFAULT_MODEL_DIR");
  if (env != nullptr && *env != '\0') return env;
  const std::string rel = "models/tiny_qwen3_moe";
  std::vector<fs::path> candidates;
  for (const char* var : {"RUNFILES_DIR", "TEST_SRCDIR"}) {
    const char* v = std::getenv(var);
    if (v != nullptr && *v != '\0') candidates.push_back(fs::path(v) / "moe_offload" / rel);
  }
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    candidates.push_back(fs::path(exe.string() + ".runfiles") / "moe_offload" / rel);
  }
  candidates.push_back(fs::path(rel));
  for (const fs::path& p : candidates) {
    if (fs::exists(p / "config.json", ec)) return p.string();
  }
  return "";
}

}  // namespace moe::engine
