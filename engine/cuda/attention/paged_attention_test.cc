// Paged attention kernels against a float64 CPU reference computed from the same bf16 keys and
// values. Pools start as bf16 NaN, so a read of any slot that was never appended (the tail of a
// sequence's last block, a block of another sequence) turns the output NaN; block tables are
// shuffled (no sequence owns consecutive blocks) and their unused entries hold an id far past
// the pool; outputs are NaN-poisoned before every launch and checked fully written.
//
// Tolerance: the kernels accumulate in f32 over the bf16 K/V, with queries and softmax weights
// carried as bf16 hi + lo pairs (~2^-16 relative). Every output row must satisfy
// |out - ref|_2 <= 1e-3 |ref|_2; the error seen is of order 1e-5, so a mistake in one position
// (a weight off by 1/len even at 32K positions) or a bf16-rounded operand fails.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "common/formats.h"
#include "common/gpu_test_util.h"
#include "engine/cuda/attention/paged_attention.h"
#include "gtest/gtest.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace moe::engine::gpu {
namespace {

#if MOE_HAVE_CUDA

constexpr uint16_t kBf16Nan = 0x7fc0;
constexpr int32_t kBadBlock = 0x3fffffff;  // an unused table entry: faults if ever read
constexpr double kTol = 1e-3;

#define ASSERT_CUDA(x) ASSERT_EQ((x), cudaSuccess) << #x
#define ASSERT_OK(x)                           \
  do {                                         \
    const absl::Status s_ = (x);               \
    ASSERT_TRUE(s_.ok()) << #x << ": " << s_;  \
  } while (0)

template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) p_ = nullptr;
  }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return p_; }
  cudaError_t Upload(const std::vector<T>& h) {
    return cudaMemcpy(p_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> Download() const {
    std::vector<T> h(n_);
    if (cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess) h.clear();
    return h;
  }
  cudaError_t PoisonNan() { return cudaMemset(p_, 0xff, n_ * sizeof(T)); }

 private:
  T* p_ = nullptr;
  size_t n_;
};

float RoundBf16(float x) { return common::Bf16ToFloat(common::FloatToBf16(x)); }

// Nonzero values of both signs with magnitudes in [lo, hi].
std::vector<float> RandomVec(size_t n, float lo, float hi, std::mt19937& rng) {
  std::uniform_real_distribution<float> mag(lo, hi);
  std::bernoulli_distribution sign(0.5);
  std::vector<float> v(n);
  for (float& x : v) x = sign(rng) ? mag(rng) : -mag(rng);
  return v;
}

// Sequences with contents in a paged pool on the device. Keys/values of sequence s, position p,
// head h are host_k[s][(p * kv_heads + h) * D + d], already rounded to bf16, and were stored by
// LaunchAppendKv in one call (all positions of all sequences).
struct PagedSequences {
  int kv_heads = 0, head_dim = 0, block_size = 0, max_blocks = 0;
  std::vector<int> lens;
  std::vector<std::vector<float>> host_k, host_v;
  std::vector<int32_t> tables;  // [num_seqs, max_blocks]
  std::unique_ptr<PagedKvPool> pool;
  std::unique_ptr<DeviceBuffer<int32_t>> d_tables;

  const PagedKvLayer& layer() const { return pool->layer(0); }
};

// Shuffled block ids over a pool with spare blocks; unused table entries are kBadBlock.
void AssignTables(PagedSequences& s, int num_blocks, std::mt19937& rng) {
  std::vector<int32_t> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  s.tables.assign(s.lens.size() * s.max_blocks, kBadBlock);
  size_t next = 0;
  for (size_t i = 0; i < s.lens.size(); ++i) {
    const int nb = (s.lens[i] + s.block_size - 1) / s.block_size;
    for (int j = 0; j < nb; ++j) s.tables[i * s.max_blocks + j] = ids[next++];
  }
}

void MakeSequences(const std::vector<int>& lens, int kv_heads, int head_dim, int block_size,
                   std::mt19937& rng, PagedSequences& s) {
  s.kv_heads = kv_heads;
  s.head_dim = head_dim;
  s.block_size = block_size;
  s.lens = lens;
  int total_blocks = 0;
  s.max_blocks = 1;
  for (int len : lens) {
    const int nb = (std::max(len, 1) + block_size - 1) / block_size;
    total_blocks += nb;
    s.max_blocks = std::max(s.max_blocks, nb + 1);
  }
  const int num_blocks = total_blocks + 3;
  auto pool = PagedKvPool::Create(1, kv_heads, head_dim, block_size, num_blocks);
  ASSERT_TRUE(pool.ok()) << pool.status();
  s.pool = std::move(*pool);
  const uint64_t elems = s.pool->layer_bytes() / sizeof(uint16_t);
  {
    std::vector<uint16_t> nan(elems, kBf16Nan);
    ASSERT_CUDA(cudaMemcpy(s.layer().k, nan.data(), elems * 2, cudaMemcpyHostToDevice));
    ASSERT_CUDA(cudaMemcpy(s.layer().v, nan.data(), elems * 2, cudaMemcpyHostToDevice));
  }
  AssignTables(s, num_blocks, rng);
  s.d_tables = std::make_unique<DeviceBuffer<int32_t>>(s.tables.size());
  ASSERT_CUDA(s.d_tables->Upload(s.tables));

  // One append of every position of every sequence, f32 in; the host keeps the bf16 values.
  const int row = kv_heads * head_dim;
  std::vector<float> k, v;
  std::vector<int32_t> positions, seq_ids;
  s.host_k.resize(lens.size());
  s.host_v.resize(lens.size());
  for (size_t i = 0; i < lens.size(); ++i) {
    std::vector<float> kk = RandomVec(static_cast<size_t>(lens[i]) * row, 0.05f, 1.0f, rng);
    std::vector<float> vv = RandomVec(static_cast<size_t>(lens[i]) * row, 0.05f, 1.0f, rng);
    k.insert(k.end(), kk.begin(), kk.end());
    v.insert(v.end(), vv.begin(), vv.end());
    for (float& x : kk) x = RoundBf16(x);
    for (float& x : vv) x = RoundBf16(x);
    s.host_k[i] = std::move(kk);
    s.host_v[i] = std::move(vv);
    for (int p = 0; p < lens[i]; ++p) {
      positions.push_back(p);
      seq_ids.push_back(static_cast<int32_t>(i));
    }
  }
  // A padding token (negative position) that must be skipped.
  positions.push_back(-1);
  seq_ids.push_back(0);
  k.insert(k.end(), row, 7.0f);
  v.insert(v.end(), row, 7.0f);
  DeviceBuffer<float> dk(k.size()), dv(v.size());
  DeviceBuffer<int32_t> dpos(positions.size()), dseq(seq_ids.size());
  ASSERT_CUDA(dk.Upload(k));
  ASSERT_CUDA(dv.Upload(v));
  ASSERT_CUDA(dpos.Upload(positions));
  ASSERT_CUDA(dseq.Upload(seq_ids));
  AppendKvArgs a;
  a.k = dk.get();
  a.v = dv.get();
  a.num_tokens = static_cast<int>(positions.size());
  a.positions = dpos.get();
  a.seq_ids = dseq.get();
  a.block_tables = s.d_tables->get();
  a.max_blocks_per_seq = s.max_blocks;
  ASSERT_OK(LaunchAppendKv(s.layer(), a, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
}

// float64 attention of query `q` (head_dim values) of KV head `kvh` over positions [0, n) of
// sequence `seq`.
void Reference(const PagedSequences& s, int seq, int kvh, const float* q, int n, double* out) {
  const int D = s.head_dim, row = s.kv_heads * D;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> w(n);
  double mx = -INFINITY;
  for (int p = 0; p < n; ++p) {
    const float* k = s.host_k[seq].data() + static_cast<size_t>(p) * row + kvh * D;
    double dot = 0;
    for (int d = 0; d < D; ++d) dot += static_cast<double>(q[d]) * k[d];
    w[p] = dot * scale;
    mx = std::max(mx, w[p]);
  }
  double sum = 0;
  for (double& x : w) sum += (x = std::exp(x - mx));
  std::fill(out, out + D, 0.0);
  for (int p = 0; p < n; ++p) {
    const float* v = s.host_v[seq].data() + static_cast<size_t>(p) * row + kvh * D;
    for (int d = 0; d < D; ++d) out[d] += w[p] / sum * v[d];
  }
}

// Checks one output row; returns its relative error.
double CheckRow(const float* got, const double* ref, int D) {
  double err = 0, norm = 0;
  for (int d = 0; d < D; ++d) {
    EXPECT_TRUE(std::isfinite(got[d])) << "dim " << d << " not written or not finite";
    err += (got[d] - ref[d]) * (got[d] - ref[d]);
    norm += ref[d] * ref[d];
  }
  const double rel = std::sqrt(err) / std::sqrt(norm);
  EXPECT_LE(rel, kTol);
  return rel;
}

struct DecodeCase {
  std::vector<int> lens;
  int kv_heads, group, head_dim;
  int block_size = 16;
  int max_context = 32768;
};

// Runs decode eagerly and checks every row against the reference.
void RunDecode(const DecodeCase& c, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "D=" << c.head_dim << " group=" << c.group
                                  << " kv_heads=" << c.kv_heads << " block=" << c.block_size
                                  << " batch=" << c.lens.size() << " first len=" << c.lens[0]);
  std::mt19937 rng(seed);
  PagedSequences s;
  MakeSequences(c.lens, c.kv_heads, c.head_dim, c.block_size, rng, s);
  if (testing::Test::HasFatalFailure()) return;
  const int B = static_cast<int>(c.lens.size()), Hq = c.kv_heads * c.group, D = c.head_dim;
  DecodeWorkspaceConfig wc;
  wc.max_batch = B;
  wc.num_q_heads = Hq;
  wc.num_kv_heads = c.kv_heads;
  wc.head_dim = D;
  wc.max_context = c.max_context;
  auto ws = DecodeWorkspace::Create(wc);
  ASSERT_TRUE(ws.ok()) << ws.status();

  const std::vector<float> q = RandomVec(static_cast<size_t>(B) * Hq * D, 0.05f, 3.0f, rng);
  std::vector<int32_t> lens(c.lens.begin(), c.lens.end());
  DeviceBuffer<float> dq(q.size()), dout(q.size());
  DeviceBuffer<int32_t> dlens(B);
  ASSERT_CUDA(dq.Upload(q));
  ASSERT_CUDA(dlens.Upload(lens));
  ASSERT_CUDA(dout.PoisonNan());
  DecodeArgs a;
  a.q = dq.get();
  a.out = dout.get();
  a.seq_lens = dlens.get();
  a.block_tables = s.d_tables->get();
  a.max_blocks_per_seq = s.max_blocks;
  a.batch = B;
  a.num_q_heads = Hq;
  ASSERT_OK(LaunchDecodeAttention(s.layer(), a, **ws, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> out = dout.Download();
  ASSERT_EQ(out.size(), q.size());
  double worst = 0;
  std::vector<double> ref(D);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < Hq; ++h) {
      const size_t off = (static_cast<size_t>(b) * Hq + h) * D;
      if (c.lens[b] <= 0) {
        for (int d = 0; d < D; ++d) ASSERT_EQ(out[off + d], 0.0f) << "empty sequence " << b;
        continue;
      }
      Reference(s, b, h / c.group, q.data() + off, c.lens[b], ref.data());
      worst = std::max(worst, CheckRow(out.data() + off, ref.data(), D));
    }
  }
  std::printf("decode D=%d group=%d kv_heads=%d batch=%d len[0]=%d: worst relative error %.2e\n",
              D, c.group, c.kv_heads, B, c.lens[0], worst);
}

TEST(AppendKvTest, StoresBf16AtTheTablePositionsAndSkipsPadding) {
  MOE_SKIP_WITHOUT_GPU();
  std::mt19937 rng(11);
  PagedSequences s;
  MakeSequences({37, 5, 16}, 3, 64, 16, rng, s);
  if (testing::Test::HasFatalFailure()) return;
  const int D = 64, H = 3, bs = 16;
  const size_t elems = s.pool->layer_bytes() / 2;
  std::vector<uint16_t> k(elems), v(elems);
  ASSERT_CUDA(cudaMemcpy(k.data(), s.layer().k, elems * 2, cudaMemcpyDeviceToHost));
  ASSERT_CUDA(cudaMemcpy(v.data(), s.layer().v, elems * 2, cudaMemcpyDeviceToHost));
  std::vector<bool> written(elems, false);
  for (size_t i = 0; i < s.lens.size(); ++i) {
    for (int p = 0; p < s.lens[i]; ++p) {
      const int block = s.tables[i * s.max_blocks + p / bs];
      for (int h = 0; h < H; ++h) {
        for (int d = 0; d < D; ++d) {
          const size_t at = ((static_cast<size_t>(block) * H + h) * bs + p % bs) * D + d;
          const size_t src = (static_cast<size_t>(p) * H + h) * D + d;
          ASSERT_EQ(k[at], common::FloatToBf16(s.host_k[i][src])) << i << " " << p << " " << h;
          ASSERT_EQ(v[at], common::FloatToBf16(s.host_v[i][src])) << i << " " << p << " " << h;
          written[at] = true;
        }
      }
    }
  }
  for (size_t at = 0; at < elems; ++at) {
    if (!written[at]) {
      ASSERT_EQ(k[at], kBf16Nan) << "slot " << at << " written but not appended";
      ASSERT_EQ(v[at], kBf16Nan) << "slot " << at << " written but not appended";
    }
  }
}

TEST(DecodeAttentionTest, SingleSequenceAllLengthsDimsAndGroups) {
  MOE_SKIP_WITHOUT_GPU();
  uint32_t seed = 100;
  for (int D : {128, 64, 32}) {
    for (int group : {1, 4, 8}) {
      for (int len : {1, 2, 17, 511, 4096, 32768}) {
        RunDecode({{len}, /*kv_heads=*/2, group, D}, seed++);
        if (testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

TEST(DecodeAttentionTest, MixedBatchOfFive) {
  MOE_SKIP_WITHOUT_GPU();
  uint32_t seed = 200;
  for (int D : {128, 64, 32, 16}) {
    for (int group : {1, 4, 8}) {
      RunDecode({{4096, 1, 32768, 17, 511}, /*kv_heads=*/2, group, D}, seed++);
      if (testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST(DecodeAttentionTest, Qwen3HeadsLargeGroupsBlockSizesAndEmptyRows) {
  MOE_SKIP_WITHOUT_GPU();
  RunDecode({{32768, 3000}, /*kv_heads=*/4, /*group=*/8, 128}, 300);
  RunDecode({{2, 700, 33}, /*kv_heads=*/2, /*group=*/16, 128}, 301);  // rows g+8 in use
  RunDecode({{1000, 0, 77}, /*kv_heads=*/2, /*group=*/4, 64, /*block_size=*/64}, 302);
  RunDecode({{5000, 48}, /*kv_heads=*/1, /*group=*/7, 128, /*block_size=*/32}, 303);
  // Lengths far past the context the workspace was planned for still work (longer chunks).
  RunDecode({{20000, 9}, /*kv_heads=*/4, /*group=*/8, 128, 16, /*max_context=*/512}, 304);
  // Qwen3.5 / 3.6 full attention: heads of 256, 16 query heads over 2 KV heads.
  RunDecode({{16384, 1, 300}, /*kv_heads=*/2, /*group=*/8, 256}, 305);
  RunDecode({{123000, 40}, /*kv_heads=*/2, /*group=*/8, 256}, 306);
  RunDecode({{700, 33}, /*kv_heads=*/2, /*group=*/1, 256, /*block_size=*/32}, 307);
}

struct PrefillCase {
  int start, n, kv_heads, group, head_dim;
  int block_size = 16;
};

void RunPrefill(const PrefillCase& c, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "start=" << c.start << " n=" << c.n << " D=" << c.head_dim
                                  << " group=" << c.group << " block=" << c.block_size);
  std::mt19937 rng(seed);
  PagedSequences s;
  // The sequence holds the earlier positions and the chunk itself (already appended).
  MakeSequences({c.start + c.n}, c.kv_heads, c.head_dim, c.block_size, rng, s);
  if (testing::Test::HasFatalFailure()) return;
  const int Hq = c.kv_heads * c.group, D = c.head_dim;
  const std::vector<float> q = RandomVec(static_cast<size_t>(c.n) * Hq * D, 0.05f, 3.0f, rng);
  DeviceBuffer<float> dq(q.size()), dout(q.size());
  ASSERT_CUDA(dq.Upload(q));
  ASSERT_CUDA(dout.PoisonNan());
  PrefillArgs a;
  a.q = dq.get();
  a.out = dout.get();
  a.num_tokens = c.n;
  a.start = c.start;
  a.block_table = s.d_tables->get();
  a.num_q_heads = Hq;
  ASSERT_OK(LaunchPrefillAttention(s.layer(), a, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> out = dout.Download();
  ASSERT_EQ(out.size(), q.size());
  std::vector<double> ref(D);
  double worst = 0;
  for (int i = 0; i < c.n; ++i) {
    for (int h = 0; h < Hq; ++h) {
      const size_t off = (static_cast<size_t>(i) * Hq + h) * D;
      Reference(s, 0, h / c.group, q.data() + off, c.start + i + 1, ref.data());
      worst = std::max(worst, CheckRow(out.data() + off, ref.data(), D));
      if (testing::Test::HasFailure()) {
        ADD_FAILURE() << "token " << i << " head " << h;
        return;
      }
    }
  }
  std::printf("prefill start=%d n=%d D=%d group=%d: worst relative error %.2e\n", c.start, c.n,
              D, c.group, worst);
}

TEST(PrefillAttentionTest, ChunksOffsetsDimsAndGroups) {
  MOE_SKIP_WITHOUT_GPU();
  uint32_t seed = 400;
  for (int D : {128, 64, 32}) {
    for (int group : {1, 4, 8}) {
      for (int start : {0, 100}) {
        for (int n : {1, 7, 64, 300}) {
          RunPrefill({start, n, /*kv_heads=*/2, group, D}, seed++);
          if (testing::Test::HasFailure()) return;
        }
      }
    }
  }
}

TEST(PrefillAttentionTest, Qwen3HeadsSmallHeadsAndOtherBlocks) {
  MOE_SKIP_WITHOUT_GPU();
  RunPrefill({0, 1024, 4, 8, 128}, 500);
  RunPrefill({1000, 129, 4, 8, 128, /*block_size=*/64}, 501);
  RunPrefill({37, 50, 2, 16, 16}, 502);
  RunPrefill({5, 33, 3, 3, 64, /*block_size=*/32}, 503);
  RunPrefill({0, 300, 2, 8, 256}, 504);
  RunPrefill({1000, 70, 2, 8, 256, /*block_size=*/64}, 505);
}

// A decode launch captured once, replayed with new lengths, tables and queries written into the
// same device buffers, equals an eager launch bit for bit (and the reference).
TEST(DecodeAttentionTest, CapturedGraphReplaysWithNewLengthsAndTables) {
  MOE_SKIP_WITHOUT_GPU();
  const int kv_heads = 4, group = 8, D = 128, Hq = kv_heads * group, B = 5, bs = 16;
  std::mt19937 rng(600);
  // One pool holding the longest lengths of both rounds; rounds re-shuffle the tables.
  PagedSequences s;
  const std::vector<int> max_lens = {9000, 4096, 700, 40, 3};
  MakeSequences(max_lens, kv_heads, D, bs, rng, s);
  if (testing::Test::HasFatalFailure()) return;
  DecodeWorkspaceConfig wc;
  wc.max_batch = B;
  wc.num_q_heads = Hq;
  wc.num_kv_heads = kv_heads;
  wc.head_dim = D;
  wc.max_context = 8192;
  auto ws = DecodeWorkspace::Create(wc);
  ASSERT_TRUE(ws.ok()) << ws.status();
  const size_t n_out = static_cast<size_t>(B) * Hq * D;
  DeviceBuffer<float> dq(n_out), dout(n_out), dout_eager(n_out);
  DeviceBuffer<int32_t> dlens(B), dtables(s.tables.size());
  DecodeArgs a;
  a.q = dq.get();
  a.out = dout.get();
  a.seq_lens = dlens.get();
  a.block_tables = dtables.get();
  a.max_blocks_per_seq = s.max_blocks;
  a.batch = B;
  a.num_q_heads = Hq;

  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Capture with a placeholder state: nothing is read at capture time.
  ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const absl::Status launched = LaunchDecodeAttention(s.layer(), a, **ws, stream);
  cudaGraph_t graph;
  ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  ASSERT_OK(launched);
  cudaGraphExec_t exec;
  ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));

  // Each round: a prefix of each sequence, and in odd rounds sequences 0 and 1 trade places
  // (their table rows and data), so both the lengths and the table contents change.
  const std::vector<std::vector<int>> rounds = {
      {9000, 1, 700, 17, 3}, {33, 4096, 0, 40, 2}, {8191, 4000, 512, 1, 1}};
  for (size_t round = 0; round < rounds.size(); ++round) {
    SCOPED_TRACE(testing::Message() << "round " << round);
    std::vector<int32_t> lens(rounds[round].begin(), rounds[round].end());
    const std::vector<float> q = RandomVec(static_cast<size_t>(B) * Hq * D, 0.05f, 3.0f, rng);
    const std::vector<int32_t>& tables = s.tables;
    std::vector<int> order(B);
    std::iota(order.begin(), order.end(), 0);
    if (round % 2 == 1) std::swap(order[0], order[1]);
    std::vector<int32_t> round_tables(tables.size());
    for (int b = 0; b < B; ++b) {
      std::copy_n(tables.begin() + order[b] * s.max_blocks, s.max_blocks,
                  round_tables.begin() + b * s.max_blocks);
      lens[b] = std::min(lens[b], max_lens[order[b]]);
    }
    ASSERT_CUDA(cudaMemcpyAsync(dq.get(), q.data(), q.size() * 4, cudaMemcpyHostToDevice, stream));
    ASSERT_CUDA(cudaMemcpyAsync(dlens.get(), lens.data(), B * 4, cudaMemcpyHostToDevice, stream));
    ASSERT_CUDA(cudaMemcpyAsync(dtables.get(), round_tables.data(), round_tables.size() * 4,
                                cudaMemcpyHostToDevice, stream));
    ASSERT_CUDA(cudaMemsetAsync(dout.get(), 0xff, q.size() * 4, stream));
    ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    ASSERT_CUDA(cudaMemsetAsync(dout_eager.get(), 0xff, q.size() * 4, stream));
    DecodeArgs eager = a;
    eager.out = dout_eager.get();
    ASSERT_OK(LaunchDecodeAttention(s.layer(), eager, **ws, stream));
    ASSERT_CUDA(cudaStreamSynchronize(stream));
    const std::vector<float> got = dout.Download(), want = dout_eager.Download();
    ASSERT_EQ(got.size(), want.size());
    ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0)
        << "graph replay differs from the eager launch";
    std::vector<double> ref(D);
    for (int b = 0; b < B; ++b) {
      for (int h = 0; h < Hq; ++h) {
        const size_t off = (static_cast<size_t>(b) * Hq + h) * D;
        if (lens[b] == 0) {
          for (int d = 0; d < D; ++d) ASSERT_EQ(got[off + d], 0.0f);
          continue;
        }
        Reference(s, order[b], h / group, q.data() + off, lens[b], ref.data());
        CheckRow(got.data() + off, ref.data(), D);
      }
    }
  }
  ASSERT_CUDA(cudaGraphExecDestroy(exec));
  ASSERT_CUDA(cudaGraphDestroy(graph));
  ASSERT_CUDA(cudaStreamDestroy(stream));
}

TEST(PagedAttentionTest, RejectsUnservedShapes) {
  MOE_SKIP_WITHOUT_GPU();
  PagedKvLayer l;
  l.num_blocks = 4;
  l.num_kv_heads = 2;
  l.head_dim = 128;
  l.block_size = 16;
  PrefillArgs p;
  p.num_tokens = 1;
  p.num_q_heads = 34;  // group 17 > 16
  EXPECT_EQ(LaunchPrefillAttention(l, p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.num_q_heads = 3;  // not a multiple
  EXPECT_EQ(LaunchPrefillAttention(l, p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  l.block_size = 8;
  p.num_q_heads = 4;
  EXPECT_EQ(LaunchPrefillAttention(l, p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  l.block_size = 16;
  l.head_dim = 256;
  p.num_q_heads = 32;  // group 16: heads of 256 serve groups up to 8
  EXPECT_EQ(LaunchPrefillAttention(l, p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  l.head_dim = 96;
  p.num_q_heads = 4;
  EXPECT_EQ(LaunchPrefillAttention(l, p, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

#else

TEST(PagedAttentionTest, NeedsCuda) { MOE_SKIP_WITHOUT_GPU(); }

#endif  // MOE_HAVE_CUDA

}  // namespace
}  // namespace moe::engine::gpu
