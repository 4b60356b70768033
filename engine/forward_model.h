// ForwardModel: what the engine loop (model_engine.cc) needs of a model, whatever runs it: one
// batched forward pass over chunks of consecutive tokens of different sequences, writing their
// keys and values into the implementation's own KV storage (addressed through the block tables
// the engine hands out from a KvBlockAllocator), and the logits of the rows that want them.
// Two implementations: CpuForwardModel (engine/model.h over a host KvCache) and the CUDA
// backend's GpuModel (engine/cuda/gpu_model.h, a paged KV cache in device memory).
//
// Also the shared chunk type. Implementations are not thread-safe: one caller (the engine's Step
// thread) at a time.
#ifndef MOE_ENGINE_FORWARD_MODEL_H_
#define MOE_ENGINE_FORWARD_MODEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/model_config.h"
#include "engine/routing_override.h"

namespace moe::engine {

enum class ChunkLogits { kNone, kLast, kAll };

// A run of consecutive tokens of one sequence, starting at position `start`; its KV blocks
// (block_table) must already cover positions [0, start + tokens.size()), and positions
// [0, start) must hold this sequence's keys and values. Models with linear-attention layers
// (state_slots() > 0) also keep the sequence's fixed-size recurrent state in `state_slot`
// (a StateSlotAllocator id, distinct for the chunks of one call): a chunk that starts at 0
// resets it, a later chunk continues from what the previous one left there.
struct ModelChunk {
  absl::Span<const int32_t> tokens;
  int start = 0;
  const std::vector<int32_t>* block_table = nullptr;
  ChunkLogits logits = ChunkLogits::kLast;
  int state_slot = -1;
};

// The KV pool's block ids: which blocks are free. Owns no KV memory (that is the model's).
// Not thread-safe: the engine's Step thread allocates and frees.
class KvBlockAllocator {
 public:
  // num_blocks >= 1, block_size >= 1 (checked by the caller).
  KvBlockAllocator(int num_blocks, int block_size);

  int num_blocks() const { return num_blocks_; }
  int block_size() const { return block_size_; }
  int free_blocks() const { return static_cast<int>(free_.size()); }
  int used_blocks() const { return num_blocks_ - free_blocks(); }

  // Takes n blocks (lowest ids first) into `table`; false (taking none) if fewer are free.
  bool Allocate(int n, std::vector<int32_t>* table);
  // Returns a sequence's blocks to the pool and clears `table`.
  void Free(std::vector<int32_t>* table);

 private:
  int num_blocks_ = 0;
  int block_size_ = 0;
  std::vector<int32_t> free_;  // a stack, highest id at the bottom
};

// The recurrent-state slot ids: which are free. Owns no state memory (that is the model's).
// Not thread-safe: the engine's Step thread allocates and frees.
class StateSlotAllocator {
 public:
  explicit StateSlotAllocator(int num_slots);

  int num_slots() const { return num_slots_; }
  int free_slots() const { return static_cast<int>(free_.size()); }

  // Takes the lowest free id into *slot; false (leaving *slot as it is) if none is free.
  bool Allocate(int* slot);
  // Returns *slot (if >= 0) to the pool and sets it to -1.
  void Free(int* slot);

 private:
  int num_slots_ = 0;
  std::vector<int> free_;  // a stack, highest id at the bottom
};

class ForwardModel {
 public:
  virtual ~ForwardModel() = default;

  // Runs the chunks as one batch, writes their keys and values into the model's KV storage and
  // appends to `logits` one [vocab] row per wanted token, in chunk order. InvalidArgument for
  // token ids outside the vocabulary, positions past max_positions() or a block table that does
  // not cover its chunk, or state slots (models with state_slots() > 0) missing, out of range
  // or repeated.
  virtual absl::Status Forward(absl::Span<const ModelChunk> chunks,
                               std::vector<float>* logits) = 0;

  virtual const ModelConfig& config() const = 0;
  virtual int max_positions() const = 0;
  // The KV storage's geometry: block ids handed to Forward must be below kv_blocks().
  virtual int kv_blocks() const = 0;
  virtual int kv_block_size() const = 0;
  // Recurrent-state slots (ModelChunk::state_slot ids are below this); 0 for models without
  // linear-attention layers, whose chunks need none.
  virtual int state_slots() const { return 0; }
  // Bytes the model holds for its weights and KV cache (on the host for the CPU model, on the
  // device for the GPU model).
  virtual uint64_t memory_bytes() const = 0;
  // "cpu" or "cuda".
  virtual std::string backend() const = 0;

  // Benchmarks: recorded routing forced at the router (engine/routing_override.h). Borrowed;
  // nullptr restores the router's own choice.
  virtual void set_routing_override(RoutingOverride* routing) = 0;
};

}  // namespace moe::engine

#endif  // MOE_ENGINE_FORWARD_MODEL_H_
