#include "serving/grpc_service.h"

#include <limits>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "engine/tokenizer/tokenizer.h"
#include "serving/status_map.h"

namespace moe::serving {
namespace {

const char* CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    default: return "OTHER";
  }
}

// A Generate call refused before it started.
class RefusedReactor final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  RefusedReactor(Metrics* metrics, const grpc::Status& status) : metrics_(metrics), code_(status.error_code()) {
    Finish(status);
  }
  void OnDone() override {
    metrics_->CountRequest("grpc", "Generate", CodeName(code_));
    delete this;
  }

 private:
  Metrics* metrics_;
  grpc::StatusCode code_;
};

// Owns itself (deleted in OnDone) and shares the Call with the scheduler's callbacks.
class GenerateReactor final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  GenerateReactor(const ServingContext* context, std::shared_ptr<Call> call)
      : context_(context), call_(std::move(call)) {
    call_->events->SetListener([this] { Pump(); });
    Pump();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    write_in_flight_ = false;
    if (!ok) {
      // The stream broke (the client went away): stop the engine's work now.
      context_->scheduler->Cancel(*call_);
      FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "the stream was closed"));
      return;
    }
    PumpLocked();
  }

  void OnCancel() override {
    // Client cancel or deadline: free the sequence at the engine's next step.
    context_->scheduler->Cancel(*call_);
    absl::MutexLock lock(&mu_);
    FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client"));
  }

  void OnDone() override {
    // After this returns the listener never runs again, so deleting is safe.
    call_->events->SetListener(nullptr);
    context_->metrics->CountRequest("grpc", "Generate", CodeName(code_));
    delete this;
  }

 private:
  void Pump() {
    absl::MutexLock lock(&mu_);
    PumpLocked();
  }

  void FinishLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    code_ = status.error_code();
    Finish(status);
  }

  void PumpLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || write_in_flight_) return;
    EventQueue::Item item;
    if (!call_->events->Pop(&item)) return;
    const engine::GenerationEvent& e = item.event;
    response_.Clear();
    for (int32_t id : e.token_ids) response_.add_token_ids(id);
    response_.set_text(e.text);
    for (size_t i = 0; i < e.logprobs.size(); ++i) {
      v1::TokenLogprobs* lp = response_.add_logprobs();
      lp->set_logprob(e.logprobs[i]);
      if (i < e.top_logprobs.size()) {
        for (const engine::TopLogprob& t : e.top_logprobs[i]) {
          v1::TopLogprob* top = lp->add_top();
          top->set_token_id(t.token_id);
          top->set_logprob(t.logprob);
        }
      }
    }
    switch (e.finish_reason) {
      case engine::FinishReason::kNone:
        write_in_flight_ = true;
        StartWrite(&response_);
        return;
      case engine::FinishReason::kStop:
      case engine::FinishReason::kLength: {
        response_.set_finish_reason(e.finish_reason == engine::FinishReason::kStop
                                        ? v1::FINISH_REASON_STOP
                                        : v1::FINISH_REASON_LENGTH);
        response_.mutable_usage()->set_prompt_tokens(e.prompt_tokens);
        response_.mutable_usage()->set_completion_tokens(e.completion_tokens);
        finished_ = true;
        code_ = grpc::StatusCode::OK;
        StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
        return;
      }
      case engine::FinishReason::kCancelled:
        FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED,
                                  "the request was cancelled (the server is shutting down)"));
        return;
      case engine::FinishReason::kError:
        FinishLocked(ToGrpcStatus(e.error.ok() ? absl::InternalError("the engine failed") : e.error));
        return;
    }
  }

  const ServingContext* context_;
  std::shared_ptr<Call> call_;
  absl::Mutex mu_;
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::StatusCode code_ = grpc::StatusCode::OK;
  v1::GenerateResponse response_;  // the one write in flight
};

}  // namespace

absl::StatusOr<engine::GenerationRequest> ToEngineRequest(const v1::GenerateRequest& request,
                                                          const engine::Engine& engine) {
  engine::GenerationRequest out;
  const engine::ModelInfo& info = engine.model_info();
  if (!request.model().empty() && request.model() != info.name) {
    return absl::InvalidArgumentError(absl::StrCat("model: unknown model \"", request.model(),
                                                   "\"; this server serves \"", info.name, "\""));
  }
  switch (request.prompt_case()) {
    case v1::GenerateRequest::kText:
      if (request.text().empty()) return absl::InvalidArgumentError("text: the prompt is empty");
      if (engine.tokenizer() != nullptr) {
        out.prompt_ids = engine.tokenizer()->Encode(request.text(), false);
      } else {
        out.prompt_text = request.text();
      }
      break;
    case v1::GenerateRequest::kTokenIds:
      if (request.token_ids().ids().empty()) {
        return absl::InvalidArgumentError("token_ids: the prompt is empty");
      }
      for (int32_t id : request.token_ids().ids()) {
        if (id < 0 || (info.vocab_size > 0 && id >= info.vocab_size)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "token_ids: ", id, " is outside the vocabulary (", info.vocab_size, " tokens)"));
        }
        out.prompt_ids.push_back(id);
      }
      break;
    default:
      return absl::InvalidArgumentError("prompt: give text or token_ids");
  }
  const v1::SamplingParams& s = request.sampling();
  engine::SamplingParams& p = out.sampling;
  p.temperature = s.temperature();
  p.top_p = s.top_p() == 0.0f ? 1.0f : s.top_p();
  p.top_k = s.top_k();
  p.min_p = s.min_p();
  p.repetition_penalty = s.repetition_penalty() == 0.0f ? 1.0f : s.repetition_penalty();
  p.presence_penalty = s.presence_penalty();
  p.frequency_penalty = s.frequency_penalty();
  p.has_seed = s.has_seed();
  p.seed = s.seed();
  if (s.max_tokens() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens: ", s.max_tokens(), " is negative"));
  }
  p.max_tokens = s.max_tokens() == 0 ? 16 : s.max_tokens();
  if (info.max_context > 0 && p.max_tokens > info.max_context) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens: ", p.max_tokens,
                                                   " is over the context of ", info.max_context));
  }
  if (s.stop_size() > 16) return absl::InvalidArgumentError("stop: at most 16 stop strings");
  p.stop_strings.assign(s.stop().begin(), s.stop().end());
  p.stop_token_ids.assign(s.stop_token_ids().begin(), s.stop_token_ids().end());
  p.ignore_eos = s.ignore_eos();
  p.logprobs = s.logprobs();
  p.top_logprobs = s.top_logprobs();
  if (absl::Status st = p.Validate(); !st.ok()) return st;
  const int prompt_len = static_cast<int>(out.prompt_ids.size());
  if (prompt_len > 0 && info.max_context > 0 && prompt_len + p.max_tokens > info.max_context) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_tokens: the prompt (", prompt_len, " tokens) plus max_tokens (", p.max_tokens,
        ") is over the context of ", info.max_context, " tokens"));
  }
  return out;
}

v1::Stats ToStatsProto(const engine::EngineStats& s, int in_flight) {
  v1::Stats out;
  out.set_prefill_tokens_per_second(s.prefill_seconds > 0 ? s.prefill_tokens / s.prefill_seconds : 0);
  out.set_decode_tokens_per_second(s.decode_seconds > 0 ? s.decode_tokens / s.decode_seconds : 0);
  out.set_prefill_tokens(s.prefill_tokens);
  out.set_decode_tokens(s.decode_tokens);
  out.set_last_batch_size(s.last_batch_size);
  out.set_mean_batch_size(s.steps > 0 ? static_cast<double>(s.decode_tokens) / s.steps : 0);
  out.set_running(s.running);
  out.set_waiting(s.waiting);
  out.set_queue_depth(std::max(0, in_flight - s.running));
  out.set_steps(s.steps);
  out.set_preemptions(s.preemptions);
  out.set_kv_blocks_total(s.kv_blocks_total);
  out.set_kv_blocks_used(s.kv_blocks_used);
  out.set_expert_cache_hits(s.expert_cache_hits);
  out.set_expert_cache_misses(s.expert_cache_misses);
  out.set_expert_cache_misses_per_token(
      s.decode_tokens + s.prefill_tokens > 0
          ? static_cast<double>(s.expert_cache_misses) / (s.decode_tokens + s.prefill_tokens)
          : 0);
  out.set_expert_fetched_bytes(s.expert_fetched_bytes);
  out.set_memory_bytes(s.memory_bytes);
  out.set_requests_submitted(s.requests_submitted);
  out.set_requests_finished(s.requests_finished);
  out.set_expert_cache_running(s.expert_cache_hits + s.expert_cache_misses > 0);
  return out;
}

absl::Status GrpcService::Authorize(grpc::CallbackServerContext* context) const {
  const auto& md = context->client_metadata();
  auto it = md.find("authorization");
  absl::string_view header;
  if (it != md.end()) header = absl::string_view(it->second.data(), it->second.size());
  return context_->auth->Check(header);
}

grpc::ServerUnaryReactor* GrpcService::Finish(grpc::CallbackServerContext* context,
                                              const char* method, const absl::Status& status) {
  grpc::Status s = ToGrpcStatus(status);
  context_->metrics->CountRequest("grpc", method, CodeName(s.error_code()));
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(s);
  return reactor;
}

grpc::ServerWriteReactor<v1::GenerateResponse>* GrpcService::Generate(
    grpc::CallbackServerContext* context, const v1::GenerateRequest* request) {
  absl::Status status = Authorize(context);
  if (!status.ok()) return new RefusedReactor(context_->metrics, ToGrpcStatus(status));
  absl::StatusOr<engine::GenerationRequest> req = ToEngineRequest(*request, *context_->engine);
  if (!req.ok()) return new RefusedReactor(context_->metrics, ToGrpcStatus(req.status()));
  std::vector<engine::GenerationRequest> requests;
  requests.push_back(*std::move(req));
  absl::StatusOr<std::shared_ptr<Call>> call = context_->scheduler->Submit(std::move(requests));
  if (!call.ok()) return new RefusedReactor(context_->metrics, ToGrpcStatus(call.status()));
  return new GenerateReactor(context_, *std::move(call));
}

grpc::ServerUnaryReactor* GrpcService::Tokenize(grpc::CallbackServerContext* context,
                                                const v1::TokenizeRequest* request,
                                                v1::TokenizeResponse* response) {
  if (absl::Status s = Authorize(context); !s.ok()) return Finish(context, "Tokenize", s);
  const tokenizer::Tokenizer* tok = context_->engine->tokenizer();
  if (tok == nullptr) {
    return Finish(context, "Tokenize", absl::FailedPreconditionError("this model has no tokenizer"));
  }
  for (int32_t id : tok->Encode(request->text(), request->add_special_tokens())) {
    response->add_token_ids(id);
  }
  return Finish(context, "Tokenize", absl::OkStatus());
}

grpc::ServerUnaryReactor* GrpcService::Detokenize(grpc::CallbackServerContext* context,
                                                  const v1::DetokenizeRequest* request,
                                                  v1::DetokenizeResponse* response) {
  if (absl::Status s = Authorize(context); !s.ok()) return Finish(context, "Detokenize", s);
  const tokenizer::Tokenizer* tok = context_->engine->tokenizer();
  if (tok == nullptr) {
    return Finish(context, "Detokenize", absl::FailedPreconditionError("this model has no tokenizer"));
  }
  for (int32_t id : request->token_ids()) {
    if (id < 0 || id >= tok->vocab_size()) {
      return Finish(context, "Detokenize",
                    absl::InvalidArgumentError(absl::StrCat("token_ids: ", id,
                                                            " is outside the vocabulary")));
    }
  }
  std::vector<int32_t> ids(request->token_ids().begin(), request->token_ids().end());
  response->set_text(tok->Decode(ids, request->skip_special_tokens()));
  return Finish(context, "Detokenize", absl::OkStatus());
}

grpc::ServerUnaryReactor* GrpcService::GetModelInfo(grpc::CallbackServerContext* context,
                                                    const v1::GetModelInfoRequest*,
                                                    v1::ModelInfo* response) {
  if (absl::Status s = Authorize(context); !s.ok()) return Finish(context, "GetModelInfo", s);
  const engine::ModelInfo& info = context_->engine->model_info();
  response->set_name(info.name);
  response->set_family(info.family);
  response->set_vocab_size(info.vocab_size);
  response->set_max_context(info.max_context);
  for (int32_t id : info.eos_token_ids) response->add_eos_token_ids(id);
  response->set_num_layers(info.num_layers);
  response->set_hidden_size(info.hidden_size);
  response->set_num_experts(info.num_experts);
  response->set_experts_per_token(info.experts_per_token);
  response->set_expert_format(info.expert_format);
  response->set_backend(info.backend);
  return Finish(context, "GetModelInfo", absl::OkStatus());
}

grpc::ServerUnaryReactor* GrpcService::GetStats(grpc::CallbackServerContext* context,
                                                const v1::GetStatsRequest*, v1::Stats* response) {
  if (absl::Status s = Authorize(context); !s.ok()) return Finish(context, "GetStats", s);
  *response = ToStatsProto(context_->engine->Stats(), context_->scheduler->in_flight());
  return Finish(context, "GetStats", absl::OkStatus());
}

}  // namespace moe::serving
