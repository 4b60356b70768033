#include "graph_capture/graph_cache.h"

#include <iterator>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace moe::graph_capture {

absl::StatusOr<int> BucketFor(int batch, int max_bucket) {
  if (max_bucket < 1 || (max_bucket & (max_bucket - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max bucket must be a power of two, got ", max_bucket));
  }
  if (batch < 1 || batch > max_bucket) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch ", batch, " outside 1..", max_bucket));
  }
  int bucket = 1;
  while (bucket < batch) bucket <<= 1;
  return bucket;
}

bool GraphCache::Contains(int bucket) const {
  for (const auto& e : entries_) {
    if (e.first == bucket) return true;
  }
  return false;
}

absl::StatusOr<DecodeGraph*> GraphCache::Get(int bucket, CUstream_st* stream, BucketStepFn step) {
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    if (it->first == bucket) {
      entries_.splice(entries_.begin(), entries_, it);
      return entries_.front().second.get();
    }
  }
  auto bucket_step = [&](CUstream_st* s) { return step(bucket, s); };
  if (static_cast<int>(entries_.size()) >= capacity_) {
    // Re-use the least recently used executable for the new bucket.
    auto& lru = entries_.back();
    absl::StatusOr<bool> in_place = lru.second->Recapture(stream, bucket_step);
    if (!in_place.ok()) {
      // Its graph may no longer match its executable: drop it rather than replay a mix.
      entries_.pop_back();
      return in_place.status();
    }
    ++captures_;
    if (*in_place) ++updates_in_place_;
    lru.first = bucket;
    entries_.splice(entries_.begin(), entries_, std::prev(entries_.end()));
    return entries_.front().second.get();
  }
  ASSIGN_OR_RETURN(std::unique_ptr<DecodeGraph> graph, DecodeGraph::Create(stream, bucket_step));
  ++captures_;
  entries_.emplace_front(bucket, std::move(graph));
  return entries_.front().second.get();
}

absl::Status GraphCache::Replay(int bucket, CUstream_st* stream, BucketStepFn step) {
  ASSIGN_OR_RETURN(DecodeGraph * graph, Get(bucket, stream, step));
  return graph->Launch(stream);
}

}  // namespace moe::graph_capture
