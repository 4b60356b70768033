// Metrics: the server's counters and latency histograms, rendered in the Prometheus text format
// (version 0.0.4) for GET /metrics. Engine-side gauges (batch size, queue depth, expert cache)
// are read from EngineStats at render time rather than copied here.
//
// Thread-safe: every method may be called from any thread.
#ifndef MOE_SERVING_METRICS_H_
#define MOE_SERVING_METRICS_H_

#include <cstdint>
#include <map>
#include <string>
#include "absl/strings/string_view.h"
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "engine/engine.h"

namespace moe::serving {

// A cumulative histogram with fixed upper bounds (seconds).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double value);
  // Appends NAME_bucket{le=...}, NAME_sum and NAME_count lines.
  void Render(absl::string_view name, std::string* out) const;
  uint64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> buckets_;  // per bound, not cumulative; the last one is +Inf
  double sum_ = 0.0;
  uint64_t count_ = 0;
};

class Metrics {
 public:
  Metrics();

  // One finished request: api "http" or "grpc", the endpoint or method, the status it ended
  // with (HTTP code, or the gRPC code's name).
  void CountRequest(absl::string_view api, absl::string_view endpoint, absl::string_view code);
  void ObserveTimeToFirstToken(double seconds);
  void ObserveInterTokenLatency(double seconds);
  void AddTokens(uint64_t prompt_tokens, uint64_t completion_tokens);
  // One engine step that failed (its requests ended with the engine's error).
  void CountEngineFailure();

  // The whole exposition: our counters and histograms plus the engine's gauges.
  std::string Render(const engine::EngineStats& stats, int queue_depth, int in_flight) const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::tuple<std::string, std::string, std::string>, uint64_t> requests_
      ABSL_GUARDED_BY(mu_);
  Histogram ttft_ ABSL_GUARDED_BY(mu_);
  Histogram itl_ ABSL_GUARDED_BY(mu_);
  uint64_t prompt_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t completion_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t engine_failures_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace moe::serving

#endif  // MOE_SERVING_METRICS_H_
