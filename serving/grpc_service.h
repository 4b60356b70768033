// GrpcService: moe.serving.v1.Serving on gRPC's callback API. Generate is a server-streaming
// reactor with one write in flight; engine events wake it from the scheduler's thread. Client
// cancellation and deadlines (both reach OnCancel) cancel the engine requests at once, which
// frees their sequences at the next engine step. Every call checks the API key first.
//
// Thread-safe (gRPC calls it from its own threads); borrows the ServingContext.
#ifndef MOE_SERVING_GRPC_SERVICE_H_
#define MOE_SERVING_GRPC_SERVICE_H_

#include "serving/context.h"
#include "serving/proto/serving.grpc.pb.h"

namespace moe::serving {

class GrpcService final : public v1::Serving::CallbackService {
 public:
  explicit GrpcService(const ServingContext* context) : context_(context) {}

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* context,
                                     const v1::TokenizeRequest* request,
                                     v1::TokenizeResponse* response) override;
  grpc::ServerUnaryReactor* Detokenize(grpc::CallbackServerContext* context,
                                       const v1::DetokenizeRequest* request,
                                       v1::DetokenizeResponse* response) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request,
                                         v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const v1::GetStatsRequest* request,
                                     v1::Stats* response) override;

 private:
  grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context, const char* method,
                                   const absl::Status& status);
  absl::Status Authorize(grpc::CallbackServerContext* context) const;

  const ServingContext* context_;
};

// The request as the engine takes it (prompt checked against the model, sampling defaults
// filled in: 0 top_p / repetition_penalty / max_tokens mean the defaults).
absl::StatusOr<engine::GenerationRequest> ToEngineRequest(const v1::GenerateRequest& request,
                                                          const engine::Engine& engine);

// Engine statistics plus the server's queue.
v1::Stats ToStatsProto(const engine::EngineStats& stats, int in_flight);

}  // namespace moe::serving

#endif  // MOE_SERVING_GRPC_SERVICE_H_
