// ServingContext: what both fronts (HTTP and gRPC) share. A plain struct of borrowed pointers:
// the Server owns every pointee and outlives both fronts. The pointees are thread-safe.
#ifndef MOE_SERVING_CONTEXT_H_
#define MOE_SERVING_CONTEXT_H_

#include <cstddef>

#include "engine/engine.h"
#include "serving/auth.h"
#include "serving/metrics.h"
#include "serving/openai.h"
#include "serving/scheduler.h"

namespace moe::serving {

struct ServingContext {
  engine::Engine* engine = nullptr;
  Scheduler* scheduler = nullptr;
  Metrics* metrics = nullptr;
  const ApiKeyAuth* auth = nullptr;
  RequestLimits limits;
  size_t max_body_bytes = 4 << 20;  // larger request bodies (and gRPC messages) are refused
};

}  // namespace moe::serving

#endif  // MOE_SERVING_CONTEXT_H_
