// Would an arithmetic e4m3 -> bf16 decode beat the table decode of the fp8 kernels?
//
// The library's fp8 kernels (internal/fp8_rows-inl.h, Fp8Decoder::DecodeBf16) turn 64 codes into
// two vectors of 32 bf16 through two 128-entry byte tables (two vpermi2b), a sign OR and two byte
// interleaves, and then spend 2 vdpbf16ps per route on them. With the weights in cache one core
// decodes and dots at 11-15 GB/s on the GPU machine's host: at one route per expert that is
// about its DRAM share, so fp8 steps are decode-bound there.
//
// Every e4m3 code with a nonzero exponent field is a bf16 whose bits are arithmetic on the
// code: put the code in the high byte of a 16-bit lane (an interleave with zero, the same two
// interleaves as the table decode, so the same lane order), shift right arithmetically by 4
// (sign into bit 15 and its copies, exponent and mantissa into bits 4..10), keep bits 0x87F0
// and add 120 << 7 to the exponent. Zero, the subnormals (exponent field 0) and NaN (0x7F /
// 0xFF) are not: a 64-code chunk that holds one of them (found with an add, an AND and a
// compare) goes through the table decode instead. Real weights, scaled per 128 x 128 block to
// e4m3's range, have almost none: a code is subnormal below 2^-6 / 448 of its block's maximum.
//
// One core, two rows at a time (as the library's Fp8DotRows), NT routes. Prints GB/s of fp8
// bytes for the table decode and the arithmetic one (each also with two accumulators per row
// and route: `table2`, `arith2`), with the weights in L2 and in L3, for
// gaussian weights (few special codes) and for weights of which 1 in 64 is zero (most chunks
// take the table path), and checks both against a float64 reference of the same bf16
// activations (the two decodes give the same bits, so the same sums).
//   bazel-bin/cpu_moe/fp8_decode_probe [k=2048] [iterations=200]
// GCC 12's avx512fintrin.h builds _mm512_reduce_add_ps and others on self-initialized undefined
// vectors, which -Wuninitialized and -Wmaybe-uninitialized report wherever they are inlined.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
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

namespace common = moe::common;

// bf16 bits of e4m3 magnitude m (code & 0x7F), split in low and high bytes (as the library's
// Fp8Bf16Lut): built from common::Fp8E4M3ToFloat, whose values are all exact in bf16.
struct Lut {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
};

Lut MakeLut() {
  Lut l;
  for (int m = 0; m < 128; ++m) {
    const float f = common::Fp8E4M3ToFloat(static_cast<uint8_t>(m));
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint16_t b = std::isnan(f) ? 0x7FC0 : static_cast<uint16_t>(u >> 16);
    l.lo[m] = static_cast<uint8_t>(b & 0xFF);
    l.hi[m] = static_cast<uint8_t>(b >> 8);
  }
  return l;
}

struct TableDecoder {
  __m512i lo0, lo1, hi0, hi1, sign;
  explicit TableDecoder(const Lut& l)
      : lo0(_mm512_load_si512(l.lo)),
        lo1(_mm512_load_si512(l.lo + 64)),
        hi0(_mm512_load_si512(l.hi)),
        hi1(_mm512_load_si512(l.hi + 64)),
        sign(_mm512_set1_epi8(static_cast<char>(0x80))) {}
  inline void Decode(__m512i code, __m512i& p0, __m512i& p1) const {
    const __m512i lo = _mm512_permutex2var_epi8(lo0, code, lo1);
    const __m512i hi =
        _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, code, hi1), code, sign, 0xF8);
    p0 = _mm512_unpacklo_epi8(lo, hi);
    p1 = _mm512_unpackhi_epi8(lo, hi);
  }
};

struct ArithDecoder {
  TableDecoder table;
  __m512i keep, bias, one, low7, eight;
  explicit ArithDecoder(const Lut& l)
      : table(l),
        keep(_mm512_set1_epi16(static_cast<short>(0x87F0))),
        bias(_mm512_set1_epi16(0x3C00)),
        one(_mm512_set1_epi8(1)),
        low7(_mm512_set1_epi8(0x7F)),
        eight(_mm512_set1_epi8(8)) {}
  inline void Decode(__m512i code, __m512i& p0, __m512i& p1) const {
    // ((code + 1) & 0x7F) <= 8: magnitude 0..7 (zero, subnormal) or 0x7F (NaN).
    const __mmask64 special = _mm512_cmple_epu8_mask(
        _mm512_and_si512(_mm512_add_epi8(code, one), low7), eight);
    if (__builtin_expect(special != 0, 0)) {
      table.Decode(code, p0, p1);
      return;
    }
    const __m512i z = _mm512_setzero_si512();
    p0 = _mm512_add_epi16(_mm512_and_si512(_mm512_srai_epi16(_mm512_unpacklo_epi8(z, code), 4), keep),
                          bias);
    p1 = _mm512_add_epi16(_mm512_and_si512(_mm512_srai_epi16(_mm512_unpackhi_epi8(z, code), 4), keep),
                          bias);
  }
};

// Column of the chunk held by bf16 position j of the decode's (p0, p1) pair (the interleaves
// work per 128-bit lane q: p0 word i < 8 of lane q is code 16q + i, p1's code 16q + 8 + i).
inline int ColumnOf(int j) {
  const int v = j / 32, q = (j % 32) / 8, i = j % 8;
  return 16 * q + 8 * v + i;
}

// out[r][t] = dot(row r, x_t) for rows [0, rows), two rows at a time. kSplit: two
// accumulators per row and route (p0's and p1's products), so that each chain has one
// vdpbf16ps per chunk instead of two.
template <class D, int NT, bool kSplit>
void DotRows(const D& dec, const uint8_t* w, int rows, int k, const uint16_t* const* xb,
             float* out) {
  for (int r = 0; r < rows; r += 2) {
    const uint8_t* w0 = w + static_cast<size_t>(r) * k;
    const uint8_t* w1 = w0 + k;
    __m512 acc[2][NT], acc2[2][NT];
    for (int rr = 0; rr < 2; ++rr) {
      for (int t = 0; t < NT; ++t) acc[rr][t] = acc2[rr][t] = _mm512_setzero_ps();
    }
    for (int c = 0; c < k; c += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w0 + c + 2048), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w1 + c + 2048), _MM_HINT_T0);
      __m512i p[2][2];
      dec.Decode(_mm512_loadu_si512(w0 + c), p[0][0], p[0][1]);
      dec.Decode(_mm512_loadu_si512(w1 + c), p[1][0], p[1][1]);
      for (int t = 0; t < NT; ++t) {
        const __m512i x0 = _mm512_loadu_si512(xb[t] + c);
        const __m512i x1 = _mm512_loadu_si512(xb[t] + c + 32);
        for (int rr = 0; rr < 2; ++rr) {
          acc[rr][t] = _mm512_dpbf16_ps(acc[rr][t], (__m512bh)p[rr][0], (__m512bh)x0);
          if (kSplit) {
            acc2[rr][t] = _mm512_dpbf16_ps(acc2[rr][t], (__m512bh)p[rr][1], (__m512bh)x1);
          } else {
            acc[rr][t] = _mm512_dpbf16_ps(acc[rr][t], (__m512bh)p[rr][1], (__m512bh)x1);
          }
        }
      }
    }
    for (int rr = 0; rr < 2; ++rr) {
      for (int t = 0; t < NT; ++t) {
        out[(r + rr) * NT + t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[rr][t], acc2[rr][t]));
      }
    }
  }
}

struct Result {
  double gbps = 0.0;
  double max_rel = 0.0;
};

// ref[4 r + t]: the float64 dot; mag[4 r + t]: the sum of its terms' magnitudes, against which
// the error is measured (fp32 accumulation loses bits of the terms, not of a cancelled sum).
template <class D, int NT, bool kSplit>
Result Run(const D& dec, const std::vector<uint8_t>& w, int rows, int k,
           const std::vector<std::vector<uint16_t>>& xb, const std::vector<double>& ref,
           const std::vector<double>& mag, int iterations) {
  const uint16_t* xp[NT];
  for (int t = 0; t < NT; ++t) xp[t] = xb[t].data();
  std::vector<float> out(static_cast<size_t>(rows) * NT);
  DotRows<D, NT, kSplit>(dec, w.data(), rows, k, xp, out.data());  // warm-up
  Result res;
  for (int r = 0; r < rows; ++r) {
    for (int t = 0; t < NT; ++t) {
      const double want = ref[static_cast<size_t>(r) * 4 + t];
      const double got = out[static_cast<size_t>(r) * NT + t];
      const double scale = std::max(1e-30, mag[static_cast<size_t>(r) * 4 + t]);
      res.max_rel = std::max(res.max_rel, std::fabs(got - want) / scale);
    }
  }
  std::vector<double> times;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < iterations; ++it) {
      DotRows<D, NT, kSplit>(dec, w.data(), rows, k, xp, out.data());
      asm volatile("" : : "r"(out.data()) : "memory");
    }
    times.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  res.gbps = static_cast<double>(rows) * k * iterations / times[2] * 1e-9;
  return res;
}

bool Supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}

}  // namespace

int main(int argc, char** argv) {
  const int k = argc > 1 ? std::atoi(argv[1]) : 2048;
  const int iterations_l2 = argc > 2 ? std::atoi(argv[2]) : 200;
  if (k <= 0 || k % 64 != 0) {
    std::fprintf(stderr, "k = %d must be a positive multiple of 64\n", k);
    return 2;
  }
  if (!Supported()) {
    std::printf("fp8_decode_probe: this CPU lacks AVX-512 VBMI or BF16; nothing to measure\n");
    return 0;
  }
  static const char* const kNames[4] = {"table", "arith", "table2", "arith2"};
  const Lut lut = MakeLut();
  const TableDecoder table(lut);
  const ArithDecoder arith(lut);

  // The two decodes must give the same bf16 bits for every code (the arithmetic one falls back
  // to the table for the special codes).
  for (int c0 = 0; c0 < 256; c0 += 64) {
    alignas(64) uint8_t codes[64];
    for (int i = 0; i < 64; ++i) codes[i] = static_cast<uint8_t>(c0 + i);
    __m512i a0, a1, b0, b1;
    table.Decode(_mm512_load_si512(codes), a0, a1);
    arith.Decode(_mm512_load_si512(codes), b0, b1);
    if (_mm512_cmpneq_epi16_mask(a0, b0) != 0 || _mm512_cmpneq_epi16_mask(a1, b1) != 0) {
      std::fprintf(stderr, "decodes differ in chunk %d\n", c0);
      return 1;
    }
  }
  // Normal codes only (the arithmetic path itself): every code with exponent field 1..15 and
  // not NaN, against common::Fp8E4M3ToFloat.
  for (int code = 0; code < 256; ++code) {
    const int m = code & 0x7F;
    if (m < 8 || m == 0x7F) continue;
    alignas(64) uint8_t codes[64];
    std::fill(codes, codes + 64, static_cast<uint8_t>(code));
    __m512i p0, p1;
    arith.Decode(_mm512_load_si512(codes), p0, p1);
    alignas(64) uint16_t bits[32];
    _mm512_store_si512(bits, p0);
    const uint32_t u = static_cast<uint32_t>(bits[0]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    if (f != common::Fp8E4M3ToFloat(static_cast<uint8_t>(code))) {
      std::fprintf(stderr, "code 0x%02x: arithmetic %g, reference %g\n", code, f,
                   common::Fp8E4M3ToFloat(static_cast<uint8_t>(code)));
      return 1;
    }
  }

  std::mt19937_64 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<std::vector<uint16_t>> xb(4, std::vector<uint16_t>(k));
  for (auto& x : xb) {
    for (int j = 0; j < k; ++j) x[j] = common::FloatToBf16(nd(rng));
  }
  std::printf("fp8_decode_probe: k=%d, one core, GB/s of fp8 bytes (median of 5), two rows at a "
              "time; max error against float64 (relative to the sum of |terms|) in brackets\n", k);
  std::printf("%-10s %-9s %-7s %-22s %-22s %-22s\n", "weights", "in", "decode", "1 route",
              "2 routes", "4 routes");
  for (int zeros = 0; zeros < 2; ++zeros) {
    for (int where = 0; where < 2; ++where) {
      // L2: 128 rows (256 KiB at k = 2048); L3: 12288 rows (24 MiB).
      const int rows = where == 0 ? 128 : 12288;
      const int iterations = where == 0 ? iterations_l2 : std::max(1, iterations_l2 / 64);
      std::vector<float> f(static_cast<size_t>(rows) * k);
      for (float& v : f) v = nd(rng);
      if (zeros) {
        for (size_t i = 0; i < f.size(); i += 64) f[i + rng() % 64] = 0.0f;
      }
      // Scaled so that the largest magnitude is 448, as a 128 x 128 block scale would.
      float amax = 0.0f;
      for (float v : f) amax = std::max(amax, std::fabs(v));
      std::vector<uint8_t> w(f.size());
      for (size_t i = 0; i < f.size(); ++i) w[i] = common::FloatToFp8E4M3(f[i] * 448.0f / amax);
      // Reference: float64 dot of the exact weights with the bf16 activations, pairing column
      // ColumnOf(j) of each chunk with activation position j as the kernels do.
      std::vector<std::vector<uint16_t>> xperm(4, std::vector<uint16_t>(k));
      for (int t = 0; t < 4; ++t) {
        for (int c = 0; c < k; c += 64) {
          for (int j = 0; j < 64; ++j) xperm[t][c + j] = xb[t][c + ColumnOf(j)];
        }
      }
      std::vector<double> ref(static_cast<size_t>(rows) * 4), mag(ref.size());
      for (int r = 0; r < rows; ++r) {
        for (int t = 0; t < 4; ++t) {
          double s = 0.0, a = 0.0;
          for (int j = 0; j < k; ++j) {
            const double term =
                static_cast<double>(common::Fp8E4M3ToFloat(w[static_cast<size_t>(r) * k + j])) *
                common::Bf16ToFloat(xb[t][j]);
            s += term;
            a += std::fabs(term);
          }
          ref[static_cast<size_t>(r) * 4 + t] = s;
          mag[static_cast<size_t>(r) * 4 + t] = a;
        }
      }
      size_t special = 0;
      for (size_t c = 0; c < w.size(); c += 64) {
        bool any = false;
        for (size_t i = c; i < c + 64; ++i) any |= (w[i] & 0x78) == 0 || (w[i] & 0x7F) == 0x7F;
        special += any;
      }
      for (int d = 0; d < 4; ++d) {
        Result r1, r2, r4;
        if (d == 0) {
          r1 = Run<TableDecoder, 1, false>(table, w, rows, k, xperm, ref, mag, iterations);
          r2 = Run<TableDecoder, 2, false>(table, w, rows, k, xperm, ref, mag, iterations);
          r4 = Run<TableDecoder, 4, false>(table, w, rows, k, xperm, ref, mag, iterations);
        } else if (d == 1) {
          r1 = Run<ArithDecoder, 1, false>(arith, w, rows, k, xperm, ref, mag, iterations);
          r2 = Run<ArithDecoder, 2, false>(arith, w, rows, k, xperm, ref, mag, iterations);
          r4 = Run<ArithDecoder, 4, false>(arith, w, rows, k, xperm, ref, mag, iterations);
        } else if (d == 2) {
          r1 = Run<TableDecoder, 1, true>(table, w, rows, k, xperm, ref, mag, iterations);
          r2 = Run<TableDecoder, 2, true>(table, w, rows, k, xperm, ref, mag, iterations);
          r4 = Run<TableDecoder, 4, true>(table, w, rows, k, xperm, ref, mag, iterations);
        } else {
          r1 = Run<ArithDecoder, 1, true>(arith, w, rows, k, xperm, ref, mag, iterations);
          r2 = Run<ArithDecoder, 2, true>(arith, w, rows, k, xperm, ref, mag, iterations);
          r4 = Run<ArithDecoder, 4, true>(arith, w, rows, k, xperm, ref, mag, iterations);
        }
        char cell[3][32];
        const Result* rs[3] = {&r1, &r2, &r4};
        for (int i = 0; i < 3; ++i) {
          std::snprintf(cell[i], sizeof(cell[i]), "%6.1f [%.1e]", rs[i]->gbps, rs[i]->max_rel);
        }
        std::printf("%-10s %-9s %-7s %-22s %-22s %-22s\n",
                    zeros ? "1/64 zero" : "gaussian", where == 0 ? "L2" : "L3 24MiB",
                    kNames[d], cell[0], cell[1], cell[2]);
        const double worst = std::max({r1.max_rel, r2.max_rel, r4.max_rel});
        if (!(worst < 1e-4)) {
          std::fprintf(stderr, "error %g against float64 exceeds 1e-4\n", worst);
          return 1;
        }
      }
      std::printf("%-10s %-9s chunks with a special code: %.2f%%\n", "", "",
                  100.0 * special / (w.size() / 64));
    }
  }
  return 0;
}
