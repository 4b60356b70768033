#include "serving/server.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "serving/auth.h"
#include "serving/context.h"
#include "serving/grpc_service.h"
#include "serving/http_front.h"
#include "serving/metrics.h"
#include "serving/scheduler.h"

namespace moe::serving {

// Members in construction order; destroyed in reverse (fronts before the scheduler before the
// engine).
struct Server::Impl {
  ServerOptions options;
  std::unique_ptr<engine::Engine> engine;
  Metrics metrics;
  std::unique_ptr<ApiKeyAuth> auth;
  std::unique_ptr<Scheduler> scheduler;
  ServingContext context;
  std::unique_ptr<GrpcService> grpc_service;
  std::unique_ptr<grpc::Server> grpc_server;
  std::unique_ptr<HttpFront> http;
  int grpc_port = 0;
  int http_port = -1;
  bool shut_down = false;
};

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Server::~Server() { Shutdown(absl::ZeroDuration()); }

int Server::grpc_port() const { return impl_->grpc_port; }
int Server::http_port() const { return impl_->http_port; }
const engine::Engine& Server::engine() const { return *impl_->engine; }

absl::StatusOr<std::unique_ptr<Server>> Server::Start(std::unique_ptr<engine::Engine> engine,
                                                      const ServerOptions& options) {
  if (engine == nullptr) return absl::InvalidArgumentError("no engine");
  if (options.max_batch < 1) return absl::InvalidArgumentError("--max_batch must be >= 1");
  if (options.max_queue < 0) return absl::InvalidArgumentError("--max_queue must be >= 0");
  if (options.max_n < 1) return absl::InvalidArgumentError("max_n must be >= 1");
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->engine = std::move(engine);
  impl->auth = std::make_unique<ApiKeyAuth>(options.api_key);
  impl->scheduler = std::make_unique<Scheduler>(
      impl->engine.get(), SchedulerOptions{options.max_batch, options.max_queue}, &impl->metrics);
  ServingContext& ctx = impl->context;
  ctx.engine = impl->engine.get();
  ctx.scheduler = impl->scheduler.get();
  ctx.metrics = &impl->metrics;
  ctx.auth = impl->auth.get();
  ctx.limits.max_n = options.max_n;
  ctx.limits.max_context = impl->engine->model_info().max_context;
  ctx.max_body_bytes = options.max_body_bytes;

  impl->grpc_service = std::make_unique<GrpcService>(&impl->context);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat(options.host, ":", options.grpc_port),
                           grpc::InsecureServerCredentials(), &impl->grpc_port);
  builder.RegisterService(impl->grpc_service.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_body_bytes));
  impl->grpc_server = builder.BuildAndStart();
  if (impl->grpc_server == nullptr || impl->grpc_port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen for gRPC on ", options.host, ":",
                                               options.grpc_port));
  }
  impl->grpc_server->GetHealthCheckService()->SetServingStatus(true);

  if (options.http_port >= 0) {
    // One thread per connection that may be open at once, plus room for health and metrics.
    const int threads = std::min(options.max_batch + options.max_queue + 16, 2048);
    impl->http = std::make_unique<HttpFront>(&impl->context, threads);
    absl::StatusOr<int> port = impl->http->Start(options.host, options.http_port);
    if (!port.ok()) {
      impl->grpc_server->Shutdown();
      return port.status();
    }
    impl->http_port = *port;
  }
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

int Server::Shutdown(absl::Duration grace) {
  Impl& s = *impl_;
  if (s.shut_down) return 0;
  s.shut_down = true;
  s.grpc_server->GetHealthCheckService()->SetServingStatus(false);
  s.scheduler->StartDraining();
  int cancelled = 0;
  if (!s.scheduler->WaitUntilIdle(absl::Now() + grace)) {
    cancelled = s.scheduler->in_flight();
    s.scheduler->CancelAll();
    // The engine delivers the cancellations at its next step; streams then end themselves.
    s.scheduler->WaitUntilIdle(absl::Now() + absl::Seconds(5));
  }
  // Let the last writes reach the clients before the fronts close.
  s.grpc_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (s.http) s.http->Stop();
  s.scheduler->Stop();
  return cancelled;
}

}  // namespace moe::serving
