// Would q4_0 experts stored as 16-row panels beat the row-major block-lane kernels?
//
// In a panel, int32 lane j of every vector is row j: for each 32-column block, 4 vectors of 64
// packed bytes hold the 16 rows' codes (vector v: columns 8v..8v+3 of the block in the low
// nibbles, 8v+4..8v+7 in the high nibbles, 4 per lane), beside the 16 rows' fp16 scales. A route's
// int8 activations stay in natural order and each 4-byte group is broadcast into vpdpbusd (an
// embedded-broadcast memory operand), so per block and route: 8 vpdpbusd, one conversion, one
// multiply (row scales x the route's block scale) and one FMA for 16 rows at once, no horizontal
// sums at the end of a row, and the decode is an AND and a shift per 64 bytes. The row-major
// block-lane kernel spends 7 vector operations per 256 weights and route (14 per 512 against 11
// here), two permutes per 128 bytes of each row, and a horizontal sum per row and route.
//
// One core. Prints GB/s of q4_0 bytes at 1, 2, 4 and 8 routes, for a matrix that fits in L2 and
// one that sits in L3, each checked against a float64 reference over the same int8 activations.
// Set against the library's one-core rates (cpu_moe_bench --threads=1
// --benchmark_filter=BM_CpuMoeHot/q4_0/), which read their weights from L3.
//   bazel-bin/cpu_moe/interleave_probe [k=2048] [iterations=200]
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "common/formats.h"

namespace {

using BlockQ4 = moe::common::BlockQ4_0;

constexpr int kPanel = 16;
constexpr int kMaxRoutes = 8;

// A panel-major q4_0 matrix: for panel p and block b, 256 bytes of codes at
// codes[(p * nb + b) * 256] and 16 fp16 scales at scales[(p * nb + b) * 16].
struct PanelMatrix {
  int rows = 0, cols = 0, nb = 0;
  std::vector<uint8_t, std::allocator<uint8_t>> codes_storage;
  std::vector<uint16_t> scales;
  uint8_t* codes = nullptr;
};

// Row-major q4_0 (as the library stores it) -> panels.
void Pack(const std::vector<BlockQ4>& w, int rows, int cols, PanelMatrix& m) {
  m.rows = rows;
  m.cols = cols;
  m.nb = cols / 32;
  const size_t nblk = static_cast<size_t>(rows / kPanel) * m.nb;
  m.codes_storage.assign(nblk * 256 + 64, 0);
  m.codes = m.codes_storage.data() + (64 - reinterpret_cast<uintptr_t>(m.codes_storage.data()) % 64) % 64;
  m.scales.assign(nblk * 16, 0);
  for (int p = 0; p < rows / kPanel; ++p) {
    for (int b = 0; b < m.nb; ++b) {
      uint8_t* dst = m.codes + (static_cast<size_t>(p) * m.nb + b) * 256;
      for (int j = 0; j < kPanel; ++j) {
        const BlockQ4& blk = w[static_cast<size_t>(p * kPanel + j) * m.nb + b];
        m.scales[(static_cast<size_t>(p) * m.nb + b) * 16 + j] = blk.d;
        // code of column c of the block: q4_0 stores c < 16 in the low nibble of qs[c], c >= 16
        // in the high nibble of qs[c - 16].
        auto code = [&](int c) { return c < 16 ? blk.qs[c] & 15 : blk.qs[c - 16] >> 4; };
        for (int v = 0; v < 4; ++v) {
          for (int i = 0; i < 4; ++i) {
            dst[v * 64 + 4 * j + i] =
                static_cast<uint8_t>(code(8 * v + i) | (code(8 * v + 4 + i) << 4));
          }
        }
      }
    }
  }
}

// One route's activations: int8 codes in natural order, per block the scale and -8 x the sum.
struct Act {
  std::vector<int8_t> q;
  std::vector<float> xs;
  std::vector<int32_t> neg;
};

Act Quantize(const std::vector<float>& x) {
  Act a;
  const int nb = static_cast<int>(x.size()) / 32;
  a.q.resize(x.size());
  a.xs.resize(nb);
  a.neg.resize(nb);
  for (int b = 0; b < nb; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[32 * b + i]));
    const float s = amax / 127.0f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int v = s == 0.0f ? 0 : static_cast<int>(std::lrint(x[32 * b + i] / s));
      a.q[32 * b + i] = static_cast<int8_t>(v);
      sum += v;
    }
    a.xs[b] = s;
    a.neg[b] = -8 * sum;
  }
  return a;
}

// out[t][r] = row r . route t, for NT routes.
template <int NT>
__attribute__((noinline)) void PanelGemv(const PanelMatrix& m, const Act* const* acts,
                                         float* const* out) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int p = 0; p < m.rows / kPanel; ++p) {
    __m512 accf[NT];
    for (int t = 0; t < NT; ++t) accf[t] = _mm512_setzero_ps();
    const uint8_t* c = m.codes + static_cast<size_t>(p) * m.nb * 256;
    const uint16_t* s = m.scales.data() + static_cast<size_t>(p) * m.nb * 16;
    for (int b = 0; b < m.nb; ++b, c += 256, s += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(c) + 2048, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(c) + 2048 + 64, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(c) + 2048 + 128, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(c) + 2048 + 192, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(s) + 256, _MM_HINT_T0);
      const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
      __m512i w[8];
      for (int v = 0; v < 4; ++v) {
        const __m512i raw = _mm512_load_si512(c + 64 * v);
        w[2 * v] = _mm512_and_si512(raw, mask);
        w[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
      }
      for (int t = 0; t < NT; ++t) {
        const int32_t* a = reinterpret_cast<const int32_t*>(acts[t]->q.data() + 32 * b);
        __m512i acc = _mm512_set1_epi32(acts[t]->neg[b]);
        for (int g = 0; g < 8; ++g) acc = _mm512_dpbusd_epi32(acc, w[g], _mm512_set1_epi32(a[g]));
        accf[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc),
                                  _mm512_mul_ps(ws, _mm512_set1_ps(acts[t]->xs[b])), accf[t]);
      }
    }
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out[t] + p * kPanel, accf[t]);
  }
}

void Run(int nt, const PanelMatrix& m, const Act* const* acts, float* const* out) {
  switch (nt) {
    case 1: PanelGemv<1>(m, acts, out); break;
    case 2: PanelGemv<2>(m, acts, out); break;
    case 4: PanelGemv<4>(m, acts, out); break;
    default: PanelGemv<8>(m, acts, out); break;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int k = argc > 1 ? std::atoi(argv[1]) : 2048;
  const int iters = argc > 2 ? std::atoi(argv[2]) : 200;
  if (k % 32 != 0 || k <= 0) {
    std::fprintf(stderr, "k must be a positive multiple of 32\n");
    return 2;
  }
  if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw")) {
    std::printf("this CPU lacks AVX-512 VNNI; nothing to measure\n");
    return 0;
  }
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> code(0, 15);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  // Rows: 256 (one L2's worth at k = 2048: 288 KiB) and 16384 (18 MiB, L3).
  for (int rows : {256, 16384}) {
    const int nb = k / 32;
    std::vector<BlockQ4> w(static_cast<size_t>(rows) * nb);
    for (BlockQ4& b : w) {
      b.d = _cvtss_sh(0.01f * (1.0f + 0.1f * nd(rng)), 0);
      for (uint8_t& q : b.qs) q = static_cast<uint8_t>(code(rng) | (code(rng) << 4));
    }
    PanelMatrix m;
    Pack(w, rows, k, m);
    std::vector<Act> acts;
    for (int t = 0; t < kMaxRoutes; ++t) {
      std::vector<float> x(k);
      for (float& v : x) v = nd(rng);
      acts.push_back(Quantize(x));
    }
    std::vector<std::vector<float>> outs(kMaxRoutes, std::vector<float>(rows));
    const Act* ap[kMaxRoutes];
    float* op[kMaxRoutes];
    for (int t = 0; t < kMaxRoutes; ++t) {
      ap[t] = &acts[t];
      op[t] = outs[t].data();
    }
    const double bytes = static_cast<double>(rows) * nb * sizeof(BlockQ4);
    std::printf("k=%d rows=%d (%.1f MiB of q4_0)\n", k, rows, bytes / (1 << 20));
    for (int nt : {1, 2, 4, 8}) {
      Run(nt, m, ap, op);
      // Check against float64 over the same int8 activations.
      double max_rel = 0.0;
      for (int t = 0; t < nt; ++t) {
        for (int r = 0; r < rows; ++r) {
          double ref = 0.0, mag = 0.0;
          for (int b = 0; b < nb; ++b) {
            const BlockQ4& blk = w[static_cast<size_t>(r) * nb + b];
            long isum = 0;
            for (int c = 0; c < 32; ++c) {
              const int q = c < 16 ? blk.qs[c] & 15 : blk.qs[c - 16] >> 4;
              isum += static_cast<long>(q - 8) * acts[t].q[32 * b + c];
            }
            const double term = static_cast<double>(_cvtsh_ss(blk.d)) * acts[t].xs[b] * isum;
            ref += term;
            mag += std::fabs(term);
          }
          max_rel = std::max(max_rel, std::fabs(outs[t][r] - ref) / std::max(mag, 1e-30));
        }
      }
      std::vector<double> rates;
      for (int rep = 0; rep < 5; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) Run(nt, m, ap, op);
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        rates.push_back(bytes * iters / s * 1e-9);
      }
      std::sort(rates.begin(), rates.end());
      std::printf("  routes=%d  %.2f GB/s (median of 5; min %.2f max %.2f)  max err / sum|terms| %.2e%s\n",
                  nt, rates[2], rates[0], rates[4], max_rel, max_rel < 1e-5 ? "" : "  WRONG");
      if (max_rel >= 1e-5) return 1;
    }
  }
  return 0;
}
