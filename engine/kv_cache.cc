#include "engine/kv_cache.h"

#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace moe::engine {

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(int num_layers, int num_kv_heads,
                                                         int head_dim, int block_size,
                                                         int num_blocks) {
  if (num_layers <= 0 || num_kv_heads <= 0 || head_dim <= 0 || block_size <= 0 || num_blocks <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV cache sizes must be > 0: layers ", num_layers, ", kv heads ", num_kv_heads,
        ", head_dim ", head_dim, ", block size ", block_size, ", blocks ", num_blocks));
  }
  std::unique_ptr<KvCache> c(new KvCache());
  c->num_layers_ = num_layers;
  c->num_kv_heads_ = num_kv_heads;
  c->head_dim_ = head_dim;
  c->block_size_ = block_size;
  c->num_blocks_ = num_blocks;
  c->block_stride_ = static_cast<int64_t>(num_kv_heads) * block_size * head_dim;
  c->layer_stride_ = c->block_stride_ * num_blocks;
  const size_t n = static_cast<size_t>(c->layer_stride_) * num_layers;
  ASSIGN_OR_RETURN(c->k_, common::AlignedBuffer<float>::Allocate(n));
  ASSIGN_OR_RETURN(c->v_, common::AlignedBuffer<float>::Allocate(n));
  c->free_.reserve(num_blocks);
  for (int b = num_blocks - 1; b >= 0; --b) c->free_.push_back(b);
  return c;
}

uint64_t KvCache::bytes() const {
  return 2ull * static_cast<uint64_t>(layer_stride_) * num_layers_ * sizeof(float);
}

bool KvCache::Allocate(int n, std::vector<int32_t>* table) {
  if (n > static_cast<int>(free_.size())) return false;
  for (int i = 0; i < n; ++i) {
    table->push_back(free_.back());
    free_.pop_back();
  }
  return true;
}

void KvCache::Free(std::vector<int32_t>* table) {
  // Pushed back in reverse so the next Allocate hands out the same low ids first.
  for (auto it = table->rbegin(); it != table->rend(); ++it) free_.push_back(*it);
  table->clear();
}

void KvCache::Store(int layer, const int32_t* table, int position, const float* k, const float* v) {
  const int64_t block = table[position / block_size_];
  const int slot = position % block_size_;
  float* kb = keys(layer) + block * block_stride_;
  float* vb = values(layer) + block * block_stride_;
  for (int h = 0; h < num_kv_heads_; ++h) {
    const int64_t off = (static_cast<int64_t>(h) * block_size_ + slot) * head_dim_;
    std::memcpy(kb + off, k + static_cast<int64_t>(h) * head_dim_, head_dim_ * sizeof(float));
    std::memcpy(vb + off, v + static_cast<int64_t>(h) * head_dim_, head_dim_ * sizeof(float));
  }
}

}  // namespace moe::engine
