#include "tests/serving/scripted_engine.h"

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moe::serving::testing {
namespace {

uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h *= 0xff51afd7ed558ccdULL;
  return h ^ (h >> 33);
}

}  // namespace

ScriptedEngine::ScriptedEngine(ScriptedEngineOptions options) : options_(std::move(options)) {
  info_.name = options_.name;
  info_.family = "scripted";
  info_.vocab_size = options_.tokenizer->vocab_size();
  info_.max_context = options_.max_context;
  // Qwen's <|im_end|> ends a chat turn; <|endoftext|> a plain completion.
  for (const char* t : {"<|im_end|>", "<|endoftext|>"}) {
    if (auto id = options_.tokenizer->TokenToId(t)) info_.eos_token_ids.push_back(*id);
  }
  if (!info_.eos_token_ids.empty()) eos_ = info_.eos_token_ids[0];
  info_.num_layers = 1;
  info_.hidden_size = 8;
  info_.num_experts = 4;
  info_.experts_per_token = 2;
  info_.expert_format = "none";
  info_.backend = "scripted";
  stats_.kv_blocks_total = options_.kv_blocks;
}

int ScriptedEngine::BlocksFor(int tokens) const {
  return (tokens + options_.kv_block_size - 1) / options_.kv_block_size;
}

int32_t ScriptedEngine::NextToken(const Sequence& s) const {
  const size_t pos = s.output.size();
  if (s.scripted) {
    // The script continues after any forced tokens.
    const size_t at = pos - std::min(pos, s.request.forced_output_ids.size());
    return at < s.script.size() ? s.script[at] : eos_;
  }
  uint64_t h = 1469598103934665603ULL;
  for (int32_t id : s.prompt) h = Mix(h, static_cast<uint64_t>(id));
  if (s.request.sampling.temperature > 0) {
    h = Mix(h, s.request.sampling.has_seed ? s.request.sampling.seed : 12345);
  }
  h = Mix(h, pos);
  // Ordinary byte-level tokens of the Qwen vocabulary (ids 300-20000 are common sub-words).
  return static_cast<int32_t>(300 + h % 19700);
}

absl::StatusOr<uint64_t> ScriptedEngine::Submit(engine::GenerationRequest request) {
  if (absl::Status st = request.sampling.Validate(); !st.ok()) return st;
  auto s = std::make_unique<Sequence>();
  s->prompt = request.prompt_ids.empty()
                  ? options_.tokenizer->Encode(request.prompt_text, false)
                  : request.prompt_ids;
  if (s->prompt.empty()) return absl::InvalidArgumentError("prompt: empty");
  for (int32_t id : s->prompt) {
    if (id < 0 || id >= info_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("prompt: token id ", id, " is outside the vocabulary"));
    }
  }
  const int prompt_len = static_cast<int>(s->prompt.size());
  if (prompt_len + request.sampling.max_tokens > options_.max_context) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the prompt (", prompt_len, " tokens) plus max_tokens (", request.sampling.max_tokens,
        ") is over the context of ", options_.max_context, " tokens"));
  }
  const std::string text = options_.tokenizer->Decode(s->prompt, false);
  for (const ScriptEntry& e : options_.script) {
    if (text.find(e.match) != std::string::npos) {
      s->scripted = true;
      s->script = options_.tokenizer->Encode(e.output, false);
      break;
    }
  }
  s->decoder = std::make_unique<tokenizer::IncrementalDecoder>(*options_.tokenizer, true);
  s->request = std::move(request);
  absl::MutexLock lock(&mu_);
  s->id = next_id_++;
  ++stats_.requests_submitted;
  const uint64_t id = s->id;
  waiting_.push_back(std::move(s));
  return id;
}

void ScriptedEngine::Cancel(uint64_t request_id) {
  absl::MutexLock lock(&mu_);
  for (auto& s : waiting_) {
    if (s->id == request_id) s->cancelled = true;
  }
  for (auto& s : running_) {
    if (s->id == request_id) s->cancelled = true;
  }
}

bool ScriptedEngine::HasWork() const {
  absl::MutexLock lock(&mu_);
  return !waiting_.empty() || !running_.empty();
}

engine::EngineStats ScriptedEngine::Stats() const {
  absl::MutexLock lock(&mu_);
  engine::EngineStats s = stats_;
  s.running = static_cast<int>(running_.size());
  s.waiting = static_cast<int>(waiting_.size());
  s.kv_blocks_used = blocks_used_;
  return s;
}

absl::Status ScriptedEngine::Step() {
  std::vector<std::pair<engine::EventCallback, engine::GenerationEvent>> out;
  const absl::Time start = absl::Now();
  bool prefilled = false;
  {
    absl::MutexLock lock(&mu_);
    auto emit_final = [&](Sequence& s, engine::FinishReason reason, engine::GenerationEvent e) {
      e.request_id = s.id;
      e.finish_reason = reason;
      e.prompt_tokens = static_cast<int>(s.prompt.size());
      e.completion_tokens = static_cast<int>(s.output.size());
      blocks_used_ -= s.blocks;
      s.blocks = 0;
      ++stats_.requests_finished;
      out.emplace_back(std::move(s.request.on_event), std::move(e));
    };
    // Cancelled ones leave first, freeing their blocks.
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if ((*it)->cancelled) {
        emit_final(**it, engine::FinishReason::kCancelled, {});
        it = waiting_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = running_.begin(); it != running_.end();) {
      if ((*it)->cancelled) {
        emit_final(**it, engine::FinishReason::kCancelled, {});
        it = running_.erase(it);
      } else {
        ++it;
      }
    }
    // Admit waiting sequences at this step boundary.
    while (!waiting_.empty() && static_cast<int>(running_.size()) < options_.max_batch) {
      running_.push_back(std::move(waiting_.front()));
      waiting_.pop_front();
    }
    int rows = 0;
    std::vector<Sequence*> finished;
    for (size_t i = 0; i < running_.size(); ++i) {
      Sequence& s = *running_[i];
      const int total = static_cast<int>(s.prompt.size() + s.output.size());
      // Prefill (or recompute after preemption) in chunks; the last chunk also decodes.
      const int want = s.prefilled + options_.prefill_chunk < total
                           ? s.prefilled + options_.prefill_chunk
                           : total + 1;
      const int need = BlocksFor(want) - s.blocks;
      if (options_.kv_blocks > 0 && need > 0 && blocks_used_ + need > options_.kv_blocks) {
        // Preempt the newest sequence (possibly this one): its blocks go, it restarts later.
        Sequence& victim = *running_.back();
        blocks_used_ -= victim.blocks;
        victim.blocks = 0;
        victim.prefilled = 0;
        ++stats_.preemptions;
        waiting_.push_front(std::move(running_.back()));
        running_.pop_back();
        if (&victim == &s) break;
        --i;  // retry this one with the freed blocks
        continue;
      }
      s.blocks += std::max(need, 0);
      blocks_used_ += std::max(need, 0);
      ++rows;
      if (want <= total) {  // a prefill chunk that is not the last
        stats_.prefill_tokens += want - s.prefilled;
        s.prefilled = want;
        prefilled = true;
        continue;
      }
      if (s.prefilled < total) {
        stats_.prefill_tokens += total - s.prefilled;
        prefilled = true;
      }
      s.prefilled = total + 1;
      // Decode one token: forced ones first.
      const size_t pos = s.output.size();
      const bool forced = pos < s.request.forced_output_ids.size();
      const int32_t id = forced ? s.request.forced_output_ids[pos] : NextToken(s);
      ++stats_.decode_tokens;
      engine::GenerationEvent e;
      e.request_id = s.id;
      const bool eos = !forced && !s.request.sampling.ignore_eos &&
                       (std::find(info_.eos_token_ids.begin(), info_.eos_token_ids.end(), id) !=
                            info_.eos_token_ids.end() ||
                        std::find(s.request.sampling.stop_token_ids.begin(),
                                  s.request.sampling.stop_token_ids.end(),
                                  id) != s.request.sampling.stop_token_ids.end());
      s.output.push_back(id);
      e.token_ids.push_back(id);
      if (s.request.sampling.logprobs) {
        e.logprobs.push_back(-0.125f * static_cast<float>(pos % 8));
        std::vector<engine::TopLogprob> top;
        for (int k = 0; k < s.request.sampling.top_logprobs; ++k) {
          top.push_back({k == 0 ? id : static_cast<int32_t>(300 + k), -0.5f * k});
        }
        e.top_logprobs.push_back(std::move(top));
      }
      if (!eos) {
        std::string piece = s.decoder->Add(id);
        const size_t before = s.text.size();
        s.text += piece;
        // Stop strings: text from the first match on is never sent.
        size_t cut = std::string::npos;
        for (const std::string& stop : s.request.sampling.stop_strings) {
          const size_t from = before >= stop.size() ? before - stop.size() + 1 : 0;
          const size_t at = s.text.find(stop, from);
          if (at != std::string::npos) cut = std::min(cut, at);
        }
        if (cut != std::string::npos) {
          e.text = s.text.substr(before, cut > before ? cut - before : 0);
          s.text.resize(std::max(cut, before));
          emit_final(s, engine::FinishReason::kStop, std::move(e));
          finished.push_back(&s);
          continue;
        }
        e.text = std::move(piece);
      }
      if (eos) {
        emit_final(s, engine::FinishReason::kStop, std::move(e));
        finished.push_back(&s);
      } else if (static_cast<int>(s.output.size()) >= s.request.sampling.max_tokens) {
        e.text += s.decoder->Flush();
        emit_final(s, engine::FinishReason::kLength, std::move(e));
        finished.push_back(&s);
      } else {
        e.prompt_tokens = static_cast<int>(s.prompt.size());
        e.completion_tokens = static_cast<int>(s.output.size());
        out.emplace_back(s.request.on_event, std::move(e));
      }
    }
    running_.erase(std::remove_if(running_.begin(), running_.end(),
                                  [&](const std::unique_ptr<Sequence>& p) {
                                    return std::find(finished.begin(), finished.end(), p.get()) !=
                                           finished.end();
                                  }),
                   running_.end());
    stats_.last_batch_size = rows;
    ++stats_.steps;
  }
  std::this_thread::sleep_for(absl::ToChronoNanoseconds(options_.step_time));
  {
    absl::MutexLock lock(&mu_);
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    (prefilled ? stats_.prefill_seconds : stats_.decode_seconds) += seconds;
  }
  // Outside the lock: a callback may call Cancel.
  for (auto& [callback, event] : out) {
    if (callback) callback(event);
  }
  return absl::OkStatus();
}

}  // namespace moe::serving::testing
