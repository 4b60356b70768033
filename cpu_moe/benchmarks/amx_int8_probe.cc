// Would AMX int8 tiles (tdpbusd) beat the VNNI kernels for q4_0 experts with several routes?
//
// One core, weights hot in L2 (256 rows of k columns, q4_0): each tile of 16 rows is staged as
// unsigned 4-bit codes in bytes (natural element order), and every 32-column block is one
// tdpbusd of those 16 rows against nr routes' int8 activations (B: 8 rows of nr dwords), its C
// tile seeded with the routes' offset corrections (-8 x the block's activation sum, loaded with
// stride 0) and stored after the block, since each block has its own weight and activation
// scale: the int32 sums are converted and added into fp32 accumulators times dw[row] x dx[route]
// (the same arithmetic as the vector kernels, checked here against a float64 reference). Two C,
// A and B tiles alternate so that one block's flush overlaps the next block's tile work.
//
// Prints GB/s of q4_0 bytes per nr, with the parts switched off in turn (staging, scale
// transposition, flush: what each costs), to set against the library's one-core rates with the
// weights in cache (cpu_moe_bench --threads=1 --benchmark_filter=BM_CpuMoeHot/q4_0/: pass1_gbps_hot
// for k = 2048, pass2_gbps_hot for k = 768), which read their weights from L3, not L2.
//   bazel-bin/cpu_moe/amx_int8_probe [k=2048] [iterations=400]
// Exits 0 with a message on CPUs without AMX-INT8 (or where Linux does not grant the tile state).
// GCC 12's avx512fintrin.h builds masked and converting intrinsics on self-initialized
// undefined vectors, which -Wmaybe-uninitialized reports wherever they are inlined.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

struct BlockQ4 {
  uint16_t d;  // fp16
  uint8_t qs[16];
};
static_assert(sizeof(BlockQ4) == 18, "q4_0 block");

constexpr int kRows = 256;

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// vpermt2b indices: from c0 = chunk[0, 64) and c1 = chunk[8, 72) of 4 blocks (qs of block q at
// 18q + 2), r_h = [qs(2h), qs(2h), qs(2h+1), qs(2h+1)] (16 bytes each); the second copy of each
// is shifted right by 4 (16-bit lanes) so that masking leaves codes 0..15 then 16..31.
alignas(64) uint8_t g_idx[2][64];
alignas(64) uint16_t g_shift[32];

void InitTables() {
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 64; ++i) {
      const int off = 18 * (2 * h + i / 32) + 2 + i % 16;
      g_idx[h][i] = static_cast<uint8_t>(off < 64 ? off : 64 + (off - 8));
    }
  }
  for (int i = 0; i < 32; ++i) g_shift[i] = (i / 8) % 2 ? 4 : 0;
}

// Stages one row of nblk blocks (a multiple of 4) as bytes 0..15 (codes) into s[32 * nblk].
inline void StageRow(const BlockQ4* row, int nblk, uint8_t* s) {
  const __m512i i0 = _mm512_load_si512(g_idx[0]);
  const __m512i i1 = _mm512_load_si512(g_idx[1]);
  const __m512i sh = _mm512_load_si512(g_shift);
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int b = 0; b < nblk; b += 4) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(row + b);
    const __m512i c0 = _mm512_loadu_si512(p);
    const __m512i c1 = _mm512_loadu_si512(p + 8);
    _mm512_store_si512(s + 32 * b, _mm512_and_si512(
        _mm512_srlv_epi16(_mm512_permutex2var_epi8(c0, i0, c1), sh), mask));
    _mm512_store_si512(s + 32 * b + 64, _mm512_and_si512(
        _mm512_srlv_epi16(_mm512_permutex2var_epi8(c0, i1, c1), sh), mask));
  }
}

struct Parts {
  bool stage = true, scales = true, flush = true;
};

// out[r * nr + n] = sum over blocks of d(r, b) * dx(b, n) * (codes(r, b) - 8) . x(n, b).
void AmxRows(const std::vector<BlockQ4>& w, int k, int nr, const uint32_t* bpack,
             const int32_t* corr, const float* dx, const Parts& parts, float* out) {
  const int nblk = k / 32;
  alignas(64) static uint8_t staged[16 * 4096];
  alignas(64) static float dw_t[128][16];
  alignas(64) int32_t cbuf[2][256];
  alignas(64) int32_t row_idx[16][16], route_idx[16][16];
  const int nv = nr;  // 16 rows x nr routes = nr vectors of 16
  for (int v = 0; v < nv; ++v) {
    for (int i = 0; i < 16; ++i) {
      row_idx[v][i] = (16 * v + i) / nr;
      route_idx[v][i] = (16 * v + i) % nr;
    }
  }
  const __mmask16 route_mask = nr >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << nr) - 1);
  for (int r0 = 0; r0 < kRows; r0 += 16) {
    if (parts.stage) {
      for (int j = 0; j < 16; ++j) StageRow(&w[(r0 + j) * nblk], nblk, staged + j * k);
    }
    if (parts.scales) {
      const __m512i rows = _mm512_mullo_epi32(
          _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
          _mm512_set1_epi32(nblk * 18));
      for (int b = 0; b < nblk; ++b) {
        const __m512i g = _mm512_i32gather_epi32(_mm512_add_epi32(rows, _mm512_set1_epi32(18 * b)),
                                                 &w[r0 * nblk], 1);
        _mm512_store_ps(dw_t[b], _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)));
      }
    }
    __m512 acc[16];
    for (int v = 0; v < nv; ++v) acc[v] = _mm512_setzero_ps();
    auto flush = [&](int b, const int32_t* cb) {
      const __m512 dw = _mm512_load_ps(dw_t[b]);
      const __m512 dxv = _mm512_maskz_loadu_ps(route_mask, dx + b * nr);
      for (int v = 0; v < nv; ++v) {
        const __m512 s = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_load_si512(row_idx[v]), dw),
                                       _mm512_permutexvar_ps(_mm512_load_si512(route_idx[v]), dxv));
        acc[v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb + 16 * v)), s, acc[v]);
      }
    };
    for (int b = 0; b < nblk; b += 2) {
      _tile_loadd(0, corr + b * nr, 0);
      _tile_loadd(2, staged + 32 * b, k);
      _tile_loadd(4, bpack + b * 8 * nr, 4 * nr);
      _tile_dpbusd(0, 2, 4);
      _tile_loadd(1, corr + (b + 1) * nr, 0);
      _tile_loadd(3, staged + 32 * (b + 1), k);
      _tile_loadd(5, bpack + (b + 1) * 8 * nr, 4 * nr);
      _tile_dpbusd(1, 3, 5);
      _tile_stored(0, cbuf[0], 4 * nr);
      if (parts.flush) flush(b, cbuf[0]);
      _tile_stored(1, cbuf[1], 4 * nr);
      if (parts.flush) flush(b + 1, cbuf[1]);
    }
    for (int v = 0; v < nv; ++v) _mm512_storeu_ps(out + r0 * nr + 16 * v, acc[v]);
  }
}

bool AmxInt8Available() {
  if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8")) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  const int k = argc > 1 ? std::atoi(argv[1]) : 2048;
  const int iters = argc > 2 ? std::atoi(argv[2]) : 400;
  if (k <= 0 || k % 128 != 0 || k > 4096 || iters <= 0) {
    std::fprintf(stderr, "usage: amx_int8_probe [k: a multiple of 128, <= 4096] [iterations]\n");
    return 2;
  }
  if (!AmxInt8Available()) {
    std::printf("no AMX-INT8 here (or Linux did not grant the tile state); nothing to measure\n");
    return 0;
  }
  InitTables();
  const int nblk = k / 32;
  std::mt19937 rng(1);
  std::vector<BlockQ4> w(static_cast<size_t>(kRows) * nblk);
  for (BlockQ4& b : w) {
    b.d = _cvtss_sh(1e-4f * (1 + rng() % 100), 0);
    for (uint8_t& q : b.qs) q = static_cast<uint8_t>(rng());
  }
  std::printf("q4_0, %d rows x %d columns (%.0f KB, in L2), one core; GB/s of q4_0 bytes\n", kRows,
              k, w.size() * 18 / 1e3);
  std::printf("%4s %10s %10s %10s %10s   %s\n", "nr", "all", "no_stage", "no_scales",
              "no_flush", "max |err| / max |ref|");
  for (int nr : {1, 2, 4, 8, 16}) {
    std::vector<int8_t> xq(static_cast<size_t>(nr) * k);
    std::vector<float> dx(static_cast<size_t>(nblk) * nr);
    for (int8_t& v : xq) v = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
    for (float& v : dx) v = 1e-3f * (1 + rng() % 1000);
    std::vector<uint32_t> bpack(static_cast<size_t>(nblk) * 8 * nr);
    std::vector<int32_t> corr(static_cast<size_t>(nblk) * nr);
    for (int b = 0; b < nblk; ++b) {
      for (int n = 0; n < nr; ++n) {
        int sum = 0;
        for (int i = 0; i < 32; ++i) sum += xq[n * k + 32 * b + i];
        corr[b * nr + n] = -8 * sum;
        for (int kk = 0; kk < 8; ++kk) {
          std::memcpy(&bpack[(b * 8 + kk) * nr + n], &xq[n * k + 32 * b + 4 * kk], 4);
        }
      }
    }
    TileConfig cfg{};
    cfg.palette = 1;
    for (int t : {0, 1}) cfg.rows[t] = 16, cfg.colsb[t] = static_cast<uint16_t>(4 * nr);  // C
    for (int t : {2, 3}) cfg.rows[t] = 16, cfg.colsb[t] = 32;                            // A
    for (int t : {4, 5}) cfg.rows[t] = 8, cfg.colsb[t] = static_cast<uint16_t>(4 * nr);   // B
    _tile_loadconfig(&cfg);
    std::vector<float> out(static_cast<size_t>(kRows) * nr);
    AmxRows(w, k, nr, bpack.data(), corr.data(), dx.data(), Parts{}, out.data());
    double max_err = 0.0, max_ref = 0.0;
    for (int r = 0; r < kRows; ++r) {
      for (int n = 0; n < nr; ++n) {
        double ref = 0.0;
        for (int b = 0; b < nblk; ++b) {
          const BlockQ4& blk = w[r * nblk + b];
          long dot = 0;
          for (int i = 0; i < 32; ++i) {
            const int q = i < 16 ? blk.qs[i] & 15 : blk.qs[i - 16] >> 4;
            dot += (q - 8) * xq[n * k + 32 * b + i];
          }
          ref += static_cast<double>(_cvtsh_ss(blk.d)) * dx[b * nr + n] * static_cast<double>(dot);
        }
        max_err = std::fmax(max_err, std::fabs(ref - out[r * nr + n]));
        max_ref = std::fmax(max_ref, std::fabs(ref));
      }
    }
    double gbps[4];
    const Parts variants[4] = {{}, {false, true, true}, {true, false, true}, {true, true, false}};
    for (int v = 0; v < 4; ++v) {
      AmxRows(w, k, nr, bpack.data(), corr.data(), dx.data(), variants[v], out.data());  // warm
      const auto t0 = std::chrono::steady_clock::now();
      for (int it = 0; it < iters; ++it) {
        AmxRows(w, k, nr, bpack.data(), corr.data(), dx.data(), variants[v], out.data());
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      gbps[v] = static_cast<double>(w.size()) * 18 * iters / s / 1e9;
    }
    std::printf("%4d %10.2f %10.2f %10.2f %10.2f   %.2g\n", nr, gbps[0], gbps[1], gbps[2], gbps[3],
                max_err / max_ref);
    _tile_release();
  }
  return 0;
}
