#include "serving/http_front.h"

#include <algorithm>
#include <ctime>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/tokenizer/tokenizer.h"
#include "httplib.h"
#include "serving/openai.h"
#include "serving/status_map.h"

namespace moe::serving {
namespace {

std::string Dump(const Json& j) {
  // Model output may hold invalid UTF-8 at a cut; replace it rather than throw.
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

void SendJson(httplib::Response& res, int code, const Json& body) {
  res.status = code;
  res.set_content(Dump(body), "application/json");
}

void SendError(httplib::Response& res, const absl::Status& status) {
  res.status = HttpStatusCode(status);
  res.set_content(HttpErrorBody(status), "application/json");
}

// One /v1/completions or /v1/chat/completions call in progress, shared by the handler and the
// stream's content provider (which outlives the handler).
struct CompletionCall {
  OpenAiRequest request;
  PreparedPrompt prompt;
  std::shared_ptr<Call> call;
  std::vector<ChoiceBuilder> choices;
  std::string id;
  int64_t created = 0;
  int remaining = 0;  // choices without their final event
  bool done = false;  // every final event seen and written
};

Json ChunkEnvelope(const CompletionCall& c) {
  Json j = Json::object();
  j["id"] = c.id;
  j["object"] = c.request.chat ? "chat.completion.chunk" : "text_completion";
  j["created"] = c.created;
  j["model"] = c.request.model;
  return j;
}

std::string Sse(const Json& j) { return absl::StrCat("data: ", Dump(j), "\n\n"); }

// An error seen by any choice decides the whole call's status (the first one wins).
absl::Status CallError(const CompletionCall& c) {
  for (const ChoiceBuilder& b : c.choices) {
    if (!b.error().ok()) return b.error();
  }
  return absl::OkStatus();
}

// Cancellation at shutdown reaches a client as 503 (retry elsewhere), not as its own cancel.
absl::Status ClientFacing(const absl::Status& s) {
  if (absl::IsCancelled(s)) return absl::UnavailableError(s.message());
  return s;
}

}  // namespace

HttpFront::HttpFront(const ServingContext* context, int threads)
    : context_(context), server_(std::make_unique<httplib::Server>()) {
  const size_t n = static_cast<size_t>(std::max(threads, 4));
  server_->new_task_queue = [n] { return new httplib::ThreadPool(n); };
  // Idle keep-alive connections hold a thread; let them go soon.
  server_->set_keep_alive_timeout(2);
  // Bodies between max_body_bytes and 4x get a 400 naming the limit from the handler; beyond
  // that httplib refuses them (413) without reading them.
  server_->set_payload_max_length(context_->max_body_bytes * 4);
  Routes();
}

HttpFront::~HttpFront() { Stop(); }

absl::StatusOr<int> HttpFront::Start(const std::string& host, int port) {
  int bound = port;
  if (port == 0) {
    bound = server_->bind_to_any_port(host);
    if (bound < 0) return absl::UnavailableError(absl::StrCat("cannot bind HTTP to ", host));
  } else if (!server_->bind_to_port(host, port)) {
    return absl::UnavailableError(
        absl::StrCat("cannot bind HTTP to ", host, ":", port, " (in use, or not an address here)"));
  }
  thread_ = std::thread([this] { server_->listen_after_bind(); });
  return bound;
}

void HttpFront::Stop() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
}

void HttpFront::Routes() {
  const ServingContext* ctx = context_;
  httplib::Server& s = *server_;

  s.set_pre_routing_handler([ctx](const httplib::Request& req, httplib::Response& res) {
    if (req.method == "GET" && (req.path == "/health" || req.path == "/")) {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    absl::Status st = ctx->auth->Check(req.get_header_value("Authorization"));
    if (st.ok()) return httplib::Server::HandlerResponse::Unhandled;
    res.set_header("WWW-Authenticate", "Bearer");
    SendError(res, st);
    return httplib::Server::HandlerResponse::Handled;
  });

  // Errors httplib raises itself (404, 413, 400 on a bad request line) get the same JSON shape.
  s.set_error_handler(httplib::Server::HandlerWithResponse(
      [](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    absl::Status st = absl::UnknownError(absl::StrCat("HTTP ", res.status));
    if (res.status == 404) st = absl::NotFoundError(absl::StrCat("no route for ", req.method, " ", req.path));
    if (res.status == 413) st = absl::InvalidArgumentError("body: too large");
    if (res.status == 400) st = absl::InvalidArgumentError("malformed HTTP request");
    const int code = res.status;
    res.set_content(HttpErrorBody(st), "application/json");
    res.status = code;
    return httplib::Server::HandlerResponse::Handled;
  }));

  s.set_logger([ctx](const httplib::Request& req, const httplib::Response& res) {
    static const char* const kKnown[] = {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                         "/tokenize",       "/detokenize",          "/health",
                                         "/metrics",        "/"};
    std::string endpoint = "other";
    for (const char* k : kKnown) {
      if (req.path == k) endpoint = k;
    }
    ctx->metrics->CountRequest("http", endpoint, std::to_string(res.status));
  });

  s.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(kChatPageHtml, "text/html; charset=utf-8");
  });

  s.Get("/health", [ctx](const httplib::Request&, httplib::Response& res) {
    if (ctx->scheduler->draining()) {
      SendJson(res, 503, Json{{"status", "draining"}});
    } else {
      SendJson(res, 200, Json{{"status", "ok"}});
    }
  });

  s.Get("/metrics", [ctx](const httplib::Request&, httplib::Response& res) {
    const engine::EngineStats stats = ctx->engine->Stats();
    const int in_flight = ctx->scheduler->in_flight();
    res.set_content(ctx->metrics->Render(stats, std::max(0, in_flight - stats.running), in_flight),
                    "text/plain; version=0.0.4");
  });

  s.Get("/v1/models", [ctx](const httplib::Request&, httplib::Response& res) {
    const engine::ModelInfo& info = ctx->engine->model_info();
    Json model = {{"id", info.name},
                  {"object", "model"},
                  {"created", 0},
                  {"owned_by", "moe-offload"},
                  {"max_model_len", info.max_context}};
    SendJson(res, 200, Json{{"object", "list"}, {"data", Json::array({model})}});
  });

  s.Post("/tokenize", [ctx](const httplib::Request& req, httplib::Response& res) {
    const tokenizer::Tokenizer* tok = ctx->engine->tokenizer();
    if (tok == nullptr) return SendError(res, absl::FailedPreconditionError("this model has no tokenizer"));
    if (req.body.size() > ctx->max_body_bytes) {
      return SendError(res, absl::InvalidArgumentError("body: over the size limit"));
    }
    Json body = Json::parse(req.body, nullptr, false);
    if (body.is_discarded() || !body.is_object()) {
      return SendError(res, absl::InvalidArgumentError("body: must be a JSON object"));
    }
    const Json* text = nullptr;
    for (const char* name : {"prompt", "text"}) {
      auto it = body.find(name);
      if (it != body.end()) text = &*it;
    }
    if (text == nullptr || !text->is_string()) {
      return SendError(res, absl::InvalidArgumentError("prompt: must be a string"));
    }
    bool special = true;  // vLLM's default
    if (auto it = body.find("add_special_tokens"); it != body.end()) {
      if (!it->is_boolean()) {
        return SendError(res, absl::InvalidArgumentError("add_special_tokens: must be a boolean"));
      }
      special = it->get<bool>();
    }
    std::vector<int32_t> ids = tok->Encode(text->get<std::string>(), special);
    SendJson(res, 200, Json{{"tokens", ids}, {"count", ids.size()},
                            {"max_model_len", ctx->engine->model_info().max_context}});
  });

  s.Post("/detokenize", [ctx](const httplib::Request& req, httplib::Response& res) {
    const tokenizer::Tokenizer* tok = ctx->engine->tokenizer();
    if (tok == nullptr) return SendError(res, absl::FailedPreconditionError("this model has no tokenizer"));
    if (req.body.size() > ctx->max_body_bytes) {
      return SendError(res, absl::InvalidArgumentError("body: over the size limit"));
    }
    Json body = Json::parse(req.body, nullptr, false);
    if (body.is_discarded() || !body.is_object()) {
      return SendError(res, absl::InvalidArgumentError("body: must be a JSON object"));
    }
    auto it = body.find("tokens");
    if (it == body.end() || !it->is_array()) {
      return SendError(res, absl::InvalidArgumentError("tokens: must be an array of token ids"));
    }
    std::vector<int32_t> ids;
    for (const Json& e : *it) {
      if (!e.is_number_integer() || e.get<int64_t>() < 0 || e.get<int64_t>() >= tok->vocab_size()) {
        return SendError(res, absl::InvalidArgumentError(absl::StrCat(
                                  "tokens: ", Dump(e), " is not a token id of this model")));
      }
      ids.push_back(e.get<int32_t>());
    }
    SendJson(res, 200, Json{{"prompt", tok->Decode(ids, false)}});
  });

  auto completion = [ctx](bool chat) {
    return [ctx, chat](const httplib::Request& req, httplib::Response& res) {
      if (req.body.size() > ctx->max_body_bytes) {
        return SendError(res, absl::InvalidArgumentError(absl::StrCat(
                                  "body: ", req.body.size(), " bytes is over the limit of ",
                                  ctx->max_body_bytes)));
      }
      auto c = std::make_shared<CompletionCall>();
      absl::StatusOr<OpenAiRequest> parsed =
          ParseOpenAiRequest(req.body, chat, ctx->engine->model_info().name, ctx->limits);
      if (!parsed.ok()) return SendError(res, parsed.status());
      c->request = *std::move(parsed);
      absl::StatusOr<PreparedPrompt> prompt = PreparePrompt(c->request, *ctx->engine, ctx->limits);
      if (!prompt.ok()) return SendError(res, prompt.status());
      c->prompt = *std::move(prompt);
      std::vector<engine::GenerationRequest> requests(c->request.n);
      for (int i = 0; i < c->request.n; ++i) {
        engine::GenerationRequest& r = requests[i];
        r.prompt_ids = c->prompt.prompt_ids;
        r.prompt_text = c->prompt.prompt_text;
        r.forced_output_ids = c->prompt.forced_output_ids;
        r.sampling = c->request.sampling;
        // n choices with one seed must still differ (and stay reproducible).
        if (r.sampling.has_seed) r.sampling.seed += static_cast<uint64_t>(i);
      }
      absl::StatusOr<std::shared_ptr<Call>> call = ctx->scheduler->Submit(std::move(requests));
      if (!call.ok()) return SendError(res, call.status());
      c->call = *std::move(call);
      for (int i = 0; i < c->request.n; ++i) {
        c->choices.emplace_back(c->request, c->prompt, ctx->engine->tokenizer());
      }
      c->remaining = c->request.n;
      c->id = NewResponseId(chat);
      c->created = static_cast<int64_t>(std::time(nullptr));

      if (!c->request.stream) {
        EventQueue::Item item;
        while (c->remaining > 0) {
          if (!c->call->events->WaitPop(&item, absl::Seconds(1))) continue;
          c->choices[item.index].Add(item.index, item.event);
          if (item.event.finish_reason != engine::FinishReason::kNone) --c->remaining;
        }
        if (absl::Status st = CallError(*c); !st.ok()) return SendError(res, ClientFacing(st));
        Json body = Json::object();
        body["id"] = c->id;
        body["object"] = chat ? "chat.completion" : "text_completion";
        body["created"] = c->created;
        body["model"] = c->request.model;
        Json choices = Json::array();
        int prompt_tokens = 0, completion_tokens = 0;
        for (int i = 0; i < c->request.n; ++i) {
          choices.push_back(c->choices[i].Final(i));
          prompt_tokens = std::max(prompt_tokens, c->choices[i].prompt_tokens());
          completion_tokens += c->choices[i].completion_tokens();
        }
        body["choices"] = choices;
        body["usage"] = UsageJson(prompt_tokens, completion_tokens);
        return SendJson(res, 200, body);
      }

      res.set_header("Cache-Control", "no-cache");
      res.set_header("X-Accel-Buffering", "no");
      res.set_chunked_content_provider(
          "text/event-stream",
          [ctx, c](size_t, httplib::DataSink& sink) {
            auto write = [&sink](const std::string& s) { return sink.write(s.data(), s.size()); };
            if (c->request.chat) {
              // The role comes first, as OpenAI sends it.
              for (int i = 0; i < c->request.n; ++i) {
                Json chunk = ChunkEnvelope(*c);
                chunk["choices"] = Json::array({Json{{"index", i},
                                                     {"delta", {{"role", "assistant"}, {"content", ""}}},
                                                     {"logprobs", nullptr},
                                                     {"finish_reason", nullptr}}});
                if (!write(Sse(chunk))) return false;
              }
            }
            EventQueue::Item item;
            while (c->remaining > 0) {
              if (!c->call->events->WaitPop(&item, absl::Seconds(1))) {
                // An SSE comment: finds clients that went away while nothing was generated.
                if (!sink.is_writable() || !write(": keep-alive\n\n")) return false;
                continue;
              }
              Json choice = c->choices[item.index].Add(item.index, item.event);
              if (item.event.finish_reason != engine::FinishReason::kNone) --c->remaining;
              if (choice.is_null() || !c->choices[item.index].error().ok()) continue;
              Json chunk = ChunkEnvelope(*c);
              chunk["choices"] = Json::array({std::move(choice)});
              if (!write(Sse(chunk))) return false;  // the releaser cancels
            }
            if (absl::Status st = CallError(*c); !st.ok()) {
              write(absl::StrCat("data: ", HttpErrorBody(ClientFacing(st)), "\n\n"));
            } else if (c->request.include_usage) {
              int prompt_tokens = 0, completion_tokens = 0;
              for (const ChoiceBuilder& b : c->choices) {
                prompt_tokens = std::max(prompt_tokens, b.prompt_tokens());
                completion_tokens += b.completion_tokens();
              }
              Json chunk = ChunkEnvelope(*c);
              chunk["choices"] = Json::array();
              chunk["usage"] = UsageJson(prompt_tokens, completion_tokens);
              write(Sse(chunk));
            }
            write("data: [DONE]\n\n");
            c->done = true;
            sink.done();
            return true;
          },
          [ctx, c](bool) {
            // The client went away (or the server stopped) before the end: free the sequences.
            if (!c->done) ctx->scheduler->Cancel(*c->call);
          });
    };
  };
  s.Post("/v1/completions", completion(false));
  s.Post("/v1/chat/completions", completion(true));
}

}  // namespace moe::serving
