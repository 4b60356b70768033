// Attention over a paged bf16 KV cache on the GPU: the pools, the append kernel that stores new
// tokens' keys and values, split-sequence decode attention (flash-decoding: a partial pass and a
// reduce, with a fixed grid so that a CUDA graph can replay it with new lengths and tables) and
// causal prefill attention for a chunk of one sequence.
//
// Layout (the CPU KvCache's, engine/kv_cache.h, in bf16): per layer, keys
// [num_blocks, num_kv_heads, block_size, head_dim] and values the same, so the block_size
// positions of one head in one block are contiguous (block_size * head_dim * 2 bytes). A decode
// tile of 16 positions of one head is then one contiguous 4 KB run at head_dim 128, read with
// 16-byte loads. Block tables are int32 [batch, max_blocks_per_seq] (position p of sequence b
// lives in block block_tables[b * max_blocks_per_seq + p / block_size] at row p % block_size),
// sequence lengths int32 [batch]. Query head h reads KV head h / (num_q_heads / num_kv_heads)
// (grouped-query attention), as on the CPU. Scores are (q . k) * head_dim^-0.5 in f32.
//
// Numerics: queries and outputs are f32, keys and values bf16. The products run on tensor cores
// (mma.sync bf16 with f32 accumulation); queries and softmax weights enter them as a bf16 pair
// (hi + lo, about 16 significant bits), so the result matches f32 arithmetic over the bf16 keys
// and values to ~1e-5 relative, not bf16-rounded queries.
//
// Supported: head_dim 16, 32, 64, 128 or 256; num_q_heads / num_kv_heads from 1 to 16 (to 8 at
// head_dim 256); block_size a power of two from 16 to 1024. Every launch validates on the host and returns InvalidArgument
// outside that; kernel launch errors come back as Internal. Launch functions neither allocate nor
// synchronize. Plain C++ header: no CUDA includes; without CUDA everything returns Unavailable.
#ifndef MOE_ENGINE_CUDA_ATTENTION_PAGED_ATTENTION_H_
#define MOE_ENGINE_CUDA_ATTENTION_PAGED_ATTENTION_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

struct CUstream_st;

namespace moe::engine::gpu {

// One layer's pools in device memory (a view; PagedKvPool owns them). bf16 values as raw bits.
struct PagedKvLayer {
  uint16_t* k = nullptr;  // [num_blocks, num_kv_heads, block_size, head_dim]
  uint16_t* v = nullptr;  // [num_blocks, num_kv_heads, block_size, head_dim]
  int num_blocks = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;
};

// InvalidArgument unless the shape is one the kernels serve (see the file comment).
absl::Status ValidateLayer(const PagedKvLayer& layer);

// Device memory of every layer's K and V pools. Owns it; thread-compatible. Which block belongs
// to which sequence is the caller's business (block tables).
class PagedKvPool {
 public:
  // Unavailable without CUDA; ResourceExhausted when cudaMalloc fails; InvalidArgument for a
  // shape ValidateLayer rejects.
  static absl::StatusOr<std::unique_ptr<PagedKvPool>> Create(int num_layers, int num_kv_heads,
                                                             int head_dim, int block_size,
                                                             int num_blocks);
  ~PagedKvPool();
  PagedKvPool(const PagedKvPool&) = delete;
  PagedKvPool& operator=(const PagedKvPool&) = delete;

  int num_layers() const { return static_cast<int>(layers_.size()); }
  const PagedKvLayer& layer(int i) const { return layers_[i]; }
  // Bytes of one layer's K pool (its V pool is the same size).
  uint64_t layer_bytes() const;

 private:
  PagedKvPool() = default;
  std::vector<PagedKvLayer> layers_;
};

// New tokens' keys and values to store. Token t goes to position positions[t] of the sequence
// whose block table is row seq_ids[t] of block_tables; a negative position skips the token (the
// padding of a fixed-size captured batch).
struct AppendKvArgs {
  const float* k = nullptr;               // device f32 [num_tokens, num_kv_heads, head_dim]
  const float* v = nullptr;               // device f32 [num_tokens, num_kv_heads, head_dim]
  int num_tokens = 0;
  const int32_t* positions = nullptr;     // device [num_tokens]
  const int32_t* seq_ids = nullptr;       // device [num_tokens]; nullptr: every token is row 0
  const int32_t* block_tables = nullptr;  // device [rows, max_blocks_per_seq]
  int max_blocks_per_seq = 0;
};

// Rounds to bf16 (nearest even) and stores. Capturable; enqueued on `stream`.
absl::Status LaunchAppendKv(const PagedKvLayer& layer, const AppendKvArgs& args,
                            CUstream_st* stream);

// How decode work is split over the sequence. A decode launch for batch B runs
// SplitsForBatch(B) blocks per (sequence, KV head); at run time a sequence of length L uses
// chunks of SplitChunk(L, splits, min_chunk) positions and the blocks past its end exit at once.
// The grid therefore depends on B alone, and any length (even past max_context) is served.
struct DecodePlan {
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int max_batch = 0;
  // Blocks the partial pass aims at for any batch: enough to fill the GPU at B = 1.
  int target_blocks = 0;
  // Fewest positions per split (a multiple of 16): short sequences are not over-split.
  int min_chunk = 32;
  // Most splits per (sequence, KV head): ceil(max_context / min_chunk), at most kMaxSplits.
  int max_splits = 1;

  static constexpr int kMaxSplits = 1024;

  int SplitsForBatch(int batch) const;
  // Partial results the workspace must hold: max over B <= max_batch of
  // B * SplitsForBatch(B) * num_q_heads.
  int64_t PartialCapacity() const;
};

// Positions per split for a sequence of `len` positions over `splits` splits: ceil(len / splits)
// rounded up to a multiple of 16, at least min_chunk. The device code uses the same formula.
int SplitChunk(int len, int splits, int min_chunk);

struct DecodeWorkspaceConfig {
  int max_batch = 1;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int max_context = 0;    // longest sequence expected (sets the split count, not a limit)
  int target_blocks = 0;  // 0: four per SM of the current device (two full waves)
  int min_chunk = 32;
};

// InvalidArgument for bad sizes. sm_count is used when config.target_blocks is 0.
absl::StatusOr<DecodePlan> MakeDecodePlan(const DecodeWorkspaceConfig& config, int sm_count);

// Device scratch of the decode partial pass: normalized partial outputs and their log2-sum-exp.
// Owns its memory; one launch at a time may use it (one per stream).
class DecodeWorkspace {
 public:
  // Unavailable without CUDA; ResourceExhausted when cudaMalloc fails.
  static absl::StatusOr<std::unique_ptr<DecodeWorkspace>> Create(
      const DecodeWorkspaceConfig& config);
  ~DecodeWorkspace();
  DecodeWorkspace(const DecodeWorkspace&) = delete;
  DecodeWorkspace& operator=(const DecodeWorkspace&) = delete;

  const DecodePlan& plan() const { return plan_; }
  float* partial_out() const { return partial_out_; }  // [B, num_q_heads, splits, head_dim]
  float* partial_lse() const { return partial_lse_; }  // [B, num_q_heads, splits]
  uint64_t bytes() const;

 private:
  DecodeWorkspace() = default;
  DecodePlan plan_;
  float* partial_out_ = nullptr;
  float* partial_lse_ = nullptr;
};

// One new token per sequence (its K/V already appended) attends to positions [0, seq_lens[b]).
// A sequence with seq_lens[b] <= 0 gets zeros. Two kernels on `stream`; capturable, and a
// captured graph may be replayed with new q, seq_lens and block table contents.
struct DecodeArgs {
  const float* q = nullptr;               // device f32 [batch, num_q_heads, head_dim]
  float* out = nullptr;                   // device f32 [batch, num_q_heads, head_dim]
  const int32_t* seq_lens = nullptr;      // device [batch]
  const int32_t* block_tables = nullptr;  // device [batch, max_blocks_per_seq]
  int max_blocks_per_seq = 0;
  int batch = 0;
  int num_q_heads = 0;
};

absl::Status LaunchDecodeAttention(const PagedKvLayer& layer, const DecodeArgs& args,
                                   const DecodeWorkspace& workspace, CUstream_st* stream);

// Causal attention for tokens at positions start .. start + num_tokens - 1 of one sequence, whose
// K/V (these tokens' included) are in the cache: token i attends to positions [0, start + i].
// One kernel on `stream`.
struct PrefillArgs {
  const float* q = nullptr;              // device f32 [num_tokens, num_q_heads, head_dim]
  float* out = nullptr;                  // device f32 [num_tokens, num_q_heads, head_dim]
  int num_tokens = 0;
  int start = 0;
  const int32_t* block_table = nullptr;  // device [ceil((start + num_tokens) / block_size)]
  int num_q_heads = 0;
};

absl::Status LaunchPrefillAttention(const PagedKvLayer& layer, const PrefillArgs& args,
                                    CUstream_st* stream);

}  // namespace moe::engine::gpu

#endif  // MOE_ENGINE_CUDA_ATTENTION_PAGED_ATTENTION_H_
