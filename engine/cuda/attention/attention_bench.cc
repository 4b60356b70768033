// Benchmark of the paged attention kernels on a GPU machine, at Qwen3-30B-A3B heads (32 query,
// 4 KV heads, head_dim 128, 16-token blocks, shuffled block tables).
//
//  - Decode at each batch x context: time per call (CUDA events around each call after warm-up,
//    median), the KV bytes it reads, and that rate against the device-to-device copy bandwidth
//    measured in the same run ((bytes read + written) / time of one large cudaMemcpyAsync).
//    Calls rotate over enough layers' pools that the KV never sits in L2 between calls, as in a
//    real forward pass over 48 layers.
//  - Prefill of one chunk at start 0: time and TFLOP/s (4 * heads * head_dim flops per
//    query-key pair, causal pairs only).
//
//   attention_bench --batches=1,8 --contexts=1024,4096,16384,32768 --json=/tmp/attention.json
#include <algorithm>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_split.h"
#include "engine/cuda/attention/paged_attention.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

ABSL_FLAG(std::string, batches, "1,8", "decode batch sizes");
ABSL_FLAG(std::string, contexts, "1024,4096,16384,32768", "decode context lengths (every sequence)");
ABSL_FLAG(int, prefill_tokens, 2048, "prefill chunk length (start 0); 0 skips prefill");
ABSL_FLAG(int, reps, 30, "timed calls per case (after warm-up)");
ABSL_FLAG(int, warmup, 5, "untimed calls per case");
ABSL_FLAG(int, num_q_heads, 32, "query heads");
ABSL_FLAG(int, num_kv_heads, 4, "KV heads");
ABSL_FLAG(int, head_dim, 128, "head dimension");
ABSL_FLAG(int, block_size, 16, "tokens per KV block");
ABSL_FLAG(int64_t, rotate_bytes, 512ll << 20, "KV bytes the rotated layers span (>> L2)");
ABSL_FLAG(std::string, json, "", "also write one JSON object per case to this file");

namespace moe::engine::gpu {
namespace {

#if MOE_HAVE_CUDA
#define CHECK_CUDA(x)                                                                  \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e_));             \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

#define CHECK_OK(x)                                                                    \
  do {                                                                                 \
    absl::Status s_ = (x);                                                             \
    if (!s_.ok()) {                                                                    \
      std::fprintf(stderr, "%s failed: %s\n", #x, s_.ToString().c_str());              \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

std::vector<int> ParseInts(const std::string& s) {
  std::vector<int> out;
  for (absl::string_view p : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    out.push_back(std::stoi(std::string(p)));
  }
  return out;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Times `fn` (which enqueues on `stream`) call by call; returns the median in seconds.
template <typename Fn>
double TimeCalls(cudaStream_t stream, int warmup, int reps, Fn fn) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) fn(i);
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaEventRecord(a, stream));
    fn(warmup + i);
    CHECK_CUDA(cudaEventRecord(b, stream));
    CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  return Median(ms) * 1e-3;
}

double CopyBandwidth(cudaStream_t stream) {
  const size_t bytes = 1ull << 30;
  void *src = nullptr, *dst = nullptr;
  CHECK_CUDA(cudaMalloc(&src, bytes));
  CHECK_CUDA(cudaMalloc(&dst, bytes));
  CHECK_CUDA(cudaMemset(src, 1, bytes));
  const double t = TimeCalls(stream, 3, 10, [&](int) {
    CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
  });
  CHECK_CUDA(cudaFree(src));
  CHECK_CUDA(cudaFree(dst));
  return 2.0 * bytes / t;
}

struct Tables {
  std::vector<int32_t> host;
  int max_blocks = 0;
};

// Every sequence of `len` positions gets its own shuffled blocks of the pool.
Tables ShuffledTables(int batch, int len, int block_size, int num_blocks, std::mt19937& rng) {
  Tables t;
  t.max_blocks = (len + block_size - 1) / block_size;
  std::vector<int32_t> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  t.host.assign(ids.begin(), ids.begin() + static_cast<size_t>(batch) * t.max_blocks);
  return t;
}

int Main() {
  const int hq = absl::GetFlag(FLAGS_num_q_heads), hkv = absl::GetFlag(FLAGS_num_kv_heads);
  const int hd = absl::GetFlag(FLAGS_head_dim), bs = absl::GetFlag(FLAGS_block_size);
  const int reps = absl::GetFlag(FLAGS_reps), warmup = absl::GetFlag(FLAGS_warmup);
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const double copy_bw = CopyBandwidth(stream);
  std::printf("device %s, %d SMs; D2D copy bandwidth %.1f GB/s (read + written)\n", prop.name,
              prop.multiProcessorCount, copy_bw * 1e-9);
  std::printf("heads %d q / %d kv, head_dim %d, block %d\n\n", hq, hkv, hd, bs);
  FILE* json = nullptr;
  if (!absl::GetFlag(FLAGS_json).empty()) json = std::fopen(absl::GetFlag(FLAGS_json).c_str(), "w");
  std::mt19937 rng(1);

  std::printf("%-8s %8s %7s %10s %10s %10s %9s\n", "decode", "batch", "context", "us/call",
              "KV MB", "GB/s", "of copy");
  for (int batch : ParseInts(absl::GetFlag(FLAGS_batches))) {
    for (int ctx : ParseInts(absl::GetFlag(FLAGS_contexts))) {
      const int blocks_per_seq = (ctx + bs - 1) / bs;
      const int num_blocks = batch * blocks_per_seq;
      const double kv_bytes = 2.0 * batch * ctx * hkv * hd * sizeof(uint16_t);
      const int layers = static_cast<int>(std::clamp<double>(
          absl::GetFlag(FLAGS_rotate_bytes) / kv_bytes, 1, 64));
      auto pool = PagedKvPool::Create(layers, hkv, hd, bs, num_blocks);
      CHECK_OK(pool.status());
      for (int l = 0; l < layers; ++l) {
        CHECK_CUDA(cudaMemset((*pool)->layer(l).k, 0x3e, (*pool)->layer_bytes()));
        CHECK_CUDA(cudaMemset((*pool)->layer(l).v, 0x3d, (*pool)->layer_bytes()));
      }
      const Tables tables = ShuffledTables(batch, ctx, bs, num_blocks, rng);
      std::vector<int32_t> lens(batch, ctx);
      std::vector<float> q(static_cast<size_t>(batch) * hq * hd, 0.5f);
      int32_t *d_tables = nullptr, *d_lens = nullptr;
      float *d_q = nullptr, *d_out = nullptr;
      CHECK_CUDA(cudaMalloc(&d_tables, tables.host.size() * 4));
      CHECK_CUDA(cudaMalloc(&d_lens, lens.size() * 4));
      CHECK_CUDA(cudaMalloc(&d_q, q.size() * 4));
      CHECK_CUDA(cudaMalloc(&d_out, q.size() * 4));
      CHECK_CUDA(cudaMemcpy(d_tables, tables.host.data(), tables.host.size() * 4,
                            cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(d_lens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(d_q, q.data(), q.size() * 4, cudaMemcpyHostToDevice));
      DecodeWorkspaceConfig wc;
      wc.max_batch = batch;
      wc.num_q_heads = hq;
      wc.num_kv_heads = hkv;
      wc.head_dim = hd;
      wc.max_context = 32768;
      auto ws = DecodeWorkspace::Create(wc);
      CHECK_OK(ws.status());
      DecodeArgs a;
      a.q = d_q;
      a.out = d_out;
      a.seq_lens = d_lens;
      a.block_tables = d_tables;
      a.max_blocks_per_seq = tables.max_blocks;
      a.batch = batch;
      a.num_q_heads = hq;
      const double t = TimeCalls(stream, warmup, reps, [&](int i) {
        CHECK_OK(LaunchDecodeAttention((*pool)->layer(i % layers), a, **ws, stream));
      });
      const double bw = kv_bytes / t;
      std::printf("%-8s %8d %7d %10.2f %10.2f %10.1f %8.1f%%\n", "", batch, ctx, t * 1e6,
                  kv_bytes * 1e-6, bw * 1e-9, 100.0 * bw / copy_bw);
      if (json) {
        std::fprintf(json,
                     "{\"kind\":\"decode\",\"device\":\"%s\",\"batch\":%d,\"context\":%d,"
                     "\"us_per_call\":%.3f,\"kv_bytes\":%.0f,\"gb_per_s\":%.2f,"
                     "\"copy_gb_per_s\":%.2f,\"fraction_of_copy\":%.4f,\"splits\":%d}\n",
                     prop.name, batch, ctx, t * 1e6, kv_bytes, bw * 1e-9, copy_bw * 1e-9,
                     bw / copy_bw, (*ws)->plan().SplitsForBatch(batch));
      }
      CHECK_CUDA(cudaFree(d_tables));
      CHECK_CUDA(cudaFree(d_lens));
      CHECK_CUDA(cudaFree(d_q));
      CHECK_CUDA(cudaFree(d_out));
    }
  }

  const int n = absl::GetFlag(FLAGS_prefill_tokens);
  if (n > 0) {
    const int num_blocks = (n + bs - 1) / bs;
    auto pool = PagedKvPool::Create(1, hkv, hd, bs, num_blocks);
    CHECK_OK(pool.status());
    CHECK_CUDA(cudaMemset((*pool)->layer(0).k, 0x3e, (*pool)->layer_bytes()));
    CHECK_CUDA(cudaMemset((*pool)->layer(0).v, 0x3d, (*pool)->layer_bytes()));
    const Tables tables = ShuffledTables(1, n, bs, num_blocks, rng);
    std::vector<float> q(static_cast<size_t>(n) * hq * hd, 0.5f);
    int32_t* d_table = nullptr;
    float *d_q = nullptr, *d_out = nullptr;
    CHECK_CUDA(cudaMalloc(&d_table, tables.host.size() * 4));
    CHECK_CUDA(cudaMalloc(&d_q, q.size() * 4));
    CHECK_CUDA(cudaMalloc(&d_out, q.size() * 4));
    CHECK_CUDA(cudaMemcpy(d_table, tables.host.data(), tables.host.size() * 4,
                          cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_q, q.data(), q.size() * 4, cudaMemcpyHostToDevice));
    PrefillArgs a;
    a.q = d_q;
    a.out = d_out;
    a.num_tokens = n;
    a.start = 0;
    a.block_table = d_table;
    a.num_q_heads = hq;
    const double t = TimeCalls(stream, warmup, reps, [&](int) {
      CHECK_OK(LaunchPrefillAttention((*pool)->layer(0), a, stream));
    });
    const double flops = 4.0 * hq * hd * (static_cast<double>(n) * (n + 1) / 2);
    std::printf("\nprefill  %d tokens from start 0: %.1f us, %.1f TFLOP/s (causal pairs)\n", n,
                t * 1e6, flops / t * 1e-12);
    if (json) {
      std::fprintf(json,
                   "{\"kind\":\"prefill\",\"device\":\"%s\",\"tokens\":%d,\"us_per_call\":%.3f,"
                   "\"tflop_per_s\":%.3f}\n",
                   prop.name, n, t * 1e6, flops / t * 1e-12);
    }
    CHECK_CUDA(cudaFree(d_table));
    CHECK_CUDA(cudaFree(d_q));
    CHECK_CUDA(cudaFree(d_out));
  }
  if (json) std::fclose(json);
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}
#else
int Main() {
  std::fprintf(stderr, "attention_bench: built without CUDA\n");
  return 1;
}
#endif

}  // namespace
}  // namespace moe::engine::gpu

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return moe::engine::gpu::Main();
}
