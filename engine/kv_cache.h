// KvCache: the paged key/value pool. One pool of fixed-size blocks (block_size tokens each) for
// all layers; a sequence holds a list of block ids (its block table) and sequences of any
// lengths share the pool. Keys and values are f32.
//
// Layout per layer: [num_blocks, num_kv_heads, block_size, head_dim] for keys, the same for
// values, so one block of one head is contiguous.
//
// Owns its memory. Not thread-safe: the engine's Step thread allocates and frees; kernels read
// and write disjoint blocks concurrently.
#ifndef MOE_ENGINE_KV_CACHE_H_
#define MOE_ENGINE_KV_CACHE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/aligned_buffer.h"

namespace moe::engine {

class KvCache {
 public:
  // ResourceExhausted when the memory cannot be had; InvalidArgument for bad sizes.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(int num_layers, int num_kv_heads,
                                                         int head_dim, int block_size,
                                                         int num_blocks);

  int num_blocks() const { return num_blocks_; }
  int block_size() const { return block_size_; }
  int free_blocks() const { return static_cast<int>(free_.size()); }
  int used_blocks() const { return num_blocks_ - free_blocks(); }
  uint64_t bytes() const;

  // Takes n blocks (lowest ids first) into `table`; false (taking none) if fewer are free.
  bool Allocate(int n, std::vector<int32_t>* table);
  // Returns a sequence's blocks to the pool and clears `table`.
  void Free(std::vector<int32_t>* table);

  // Blocks of a layer: block b starts at keys(layer) + b * block_stride().
  float* keys(int layer) { return k_.data() + layer * layer_stride_; }
  float* values(int layer) { return v_.data() + layer * layer_stride_; }
  int64_t block_stride() const { return block_stride_; }

  // Stores one token's keys and values ([num_kv_heads, head_dim] each) at `position` of the
  // sequence with block table `table`.
  void Store(int layer, const int32_t* table, int position, const float* k, const float* v);

 private:
  KvCache() = default;
  int num_layers_ = 0, num_kv_heads_ = 0, head_dim_ = 0, block_size_ = 0, num_blocks_ = 0;
  int64_t block_stride_ = 0, layer_stride_ = 0;
  common::AlignedBuffer<float> k_, v_;
  std::vector<int32_t> free_;  // a stack, highest id at the bottom
};

}  // namespace moe::engine

#endif  // MOE_ENGINE_KV_CACHE_H_
