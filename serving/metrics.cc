#include "serving/metrics.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace moe::serving {
namespace {

// Label values come from our own code, but escape anyway so a future caller cannot break the
// exposition format.
std::string Escape(absl::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out.push_back('\\');
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out.push_back(c);
  }
  return out;
}

void Gauge(std::string* out, absl::string_view name, absl::string_view help, double value,
           absl::string_view type = "gauge") {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n", name, " ",
                  absl::StrFormat("%.17g", value), "\n");
}

// Latencies from 1 ms to 60 s: a decode step of a small model is a few ms, a cold start seconds.
std::vector<double> LatencyBounds() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), buckets_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double value) {
  size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  ++buckets_[i];
  sum_ += value;
  ++count_;
}

void Histogram::Render(absl::string_view name, std::string* out) const {
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += buckets_[i];
    absl::StrAppend(out, name, "_bucket{le=\"", absl::StrFormat("%g", bounds_[i]), "\"} ",
                    cumulative, "\n");
  }
  cumulative += buckets_.back();
  absl::StrAppend(out, name, "_bucket{le=\"+Inf\"} ", cumulative, "\n");
  absl::StrAppend(out, name, "_sum ", absl::StrFormat("%.17g", sum_), "\n");
  absl::StrAppend(out, name, "_count ", count_, "\n");
}

Metrics::Metrics() : ttft_(LatencyBounds()), itl_(LatencyBounds()) {}

void Metrics::CountRequest(absl::string_view api, absl::string_view endpoint,
                           absl::string_view code) {
  absl::MutexLock lock(&mu_);
  ++requests_[{std::string(api), std::string(endpoint), std::string(code)}];
}

void Metrics::ObserveTimeToFirstToken(double seconds) {
  absl::MutexLock lock(&mu_);
  ttft_.Observe(seconds);
}

void Metrics::ObserveInterTokenLatency(double seconds) {
  absl::MutexLock lock(&mu_);
  itl_.Observe(seconds);
}

void Metrics::AddTokens(uint64_t prompt_tokens, uint64_t completion_tokens) {
  absl::MutexLock lock(&mu_);
  prompt_tokens_ += prompt_tokens;
  completion_tokens_ += completion_tokens;
}

void Metrics::CountEngineFailure() {
  absl::MutexLock lock(&mu_);
  ++engine_failures_;
}

std::string Metrics::Render(const engine::EngineStats& stats, int queue_depth,
                            int in_flight) const {
  std::string out;
  absl::MutexLock lock(&mu_);
  out += "# HELP moe_requests_total Finished requests by api, endpoint and status.\n";
  out += "# TYPE moe_requests_total counter\n";
  for (const auto& [key, n] : requests_) {
    absl::StrAppend(&out, "moe_requests_total{api=\"", Escape(std::get<0>(key)),
                    "\",endpoint=\"", Escape(std::get<1>(key)), "\",status=\"",
                    Escape(std::get<2>(key)), "\"} ", n, "\n");
  }
  out += "# HELP moe_time_to_first_token_seconds Submit to first generated token.\n";
  out += "# TYPE moe_time_to_first_token_seconds histogram\n";
  ttft_.Render("moe_time_to_first_token_seconds", &out);
  out += "# HELP moe_inter_token_latency_seconds Time between a stream's token events.\n";
  out += "# TYPE moe_inter_token_latency_seconds histogram\n";
  itl_.Render("moe_inter_token_latency_seconds", &out);
  Gauge(&out, "moe_prompt_tokens_total", "Prompt tokens of finished requests.",
        static_cast<double>(prompt_tokens_), "counter");
  Gauge(&out, "moe_completion_tokens_total", "Generated tokens of finished requests.",
        static_cast<double>(completion_tokens_), "counter");
  Gauge(&out, "moe_batch_size", "Rows of the engine's last step.", stats.last_batch_size);
  Gauge(&out, "moe_queue_depth", "Admitted requests not yet running in the engine.", queue_depth);
  Gauge(&out, "moe_requests_in_flight", "Admitted requests not yet finished.", in_flight);
  Gauge(&out, "moe_running_sequences", "Sequences holding KV blocks.", stats.running);
  Gauge(&out, "moe_engine_steps_total", "Engine steps.", static_cast<double>(stats.steps),
        "counter");
  Gauge(&out, "moe_engine_step_failures_total",
        "Engine steps that failed (their requests ended with the error).",
        static_cast<double>(engine_failures_), "counter");
  Gauge(&out, "moe_preemptions_total", "Sequences preempted for KV memory.",
        static_cast<double>(stats.preemptions), "counter");
  Gauge(&out, "moe_kv_blocks_used", "KV blocks in use.", stats.kv_blocks_used);
  Gauge(&out, "moe_kv_blocks_total", "KV blocks in the pool.", stats.kv_blocks_total);
  Gauge(&out, "moe_expert_cache_hits_total", "Expert cache hits (0 without a cache).",
        static_cast<double>(stats.expert_cache_hits), "counter");
  Gauge(&out, "moe_expert_cache_misses_total", "Expert cache misses (0 without a cache).",
        static_cast<double>(stats.expert_cache_misses), "counter");
  Gauge(&out, "moe_expert_cpu_computed_total",
        "Expert misses computed on the CPU (hybrid mode) instead of fetched.",
        static_cast<double>(stats.expert_cpu_computed), "counter");
  Gauge(&out, "moe_expert_fetched_bytes_total", "Bytes of experts fetched on misses.",
        static_cast<double>(stats.expert_fetched_bytes), "counter");
  Gauge(&out, "moe_memory_bytes", "Weights, KV pool and scratch.",
        static_cast<double>(stats.memory_bytes));
  return out;
}

}  // namespace moe::serving
