// cpu_moe kernels: AMX tiles (tdpbf16ps) for bf16 and fp8 experts with many routes in a call
// (AVX3_DL only, where Forward found AMX-TILE and AMX-BF16 and Linux granted the tile state).
//
// Textual header of cpu_moe's per-target kernels, not for other users: cpu_moe.cc includes
// forward-inl.h once per Highway target through hwy/foreach_target.h, and the toggle guard below
// lets this file re-enter for each target.
#if defined(MOE_CPU_MOE_INTERNAL_AMX_TILES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOE_CPU_MOE_INTERNAL_AMX_TILES_INL_H_
#undef MOE_CPU_MOE_INTERNAL_AMX_TILES_INL_H_
#else
#define MOE_CPU_MOE_INTERNAL_AMX_TILES_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/aligned_buffer.h"
#include "common/formats.h"
#include "cpu_moe/internal/activations-inl.h"
#include "cpu_moe/internal/fp8_rows-inl.h"
#include "cpu_moe/internal/kernel_common-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
#if HWY_TARGET == HWY_AVX3_DL
// The AVX3_DL extras of every kernel file (kernel_common-inl.h says why).
#pragma GCC target("avx512vnni")
#pragma GCC target("avx512bf16")
#pragma GCC target("amx-tile,amx-bf16")
#endif
namespace moe {
namespace cpu_moe {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET == HWY_AVX3_DL
// ---------------------------------------------------------------------------------------------
// AMX (ForwardPlan::amx): experts with at least amx_min_routes routes, through tdpbf16ps.
//
// One tdpbf16ps multiplies an A tile of m <= 16 weight rows x 32 bf16 columns by a B tile of the
// routes' bf16 activations (16 rows of column pairs x nr <= 16 routes) into a C tile of m x nr
// fp32 sums, so the work per weight byte no longer grows with the routes: vdpbf16ps (or fp8's
// fp32 FMAs) does one instruction per 32 (16) weights per route, AMX one per 512 weights for up
// to 16 routes. A tile's rows are first staged whole (fp8: the table decode of fp8_rows-inl.h,
// exact; bf16: copied) into an L2 scratch from which the A tiles load (AmxStager): tile loads
// straight from rows 2-4 KiB apart were latency-bound at 11-15 GB/s per core; staging and tile
// loads do not overlap on these cores.
// Two row sets go together (pass 1: gate and up rows; pass 2: rows p and p + n/2 of a block), as
// in the vector kernels, with their own C tiles.
//
// fp8 block scales: the m rows of a tile lie in one 128-row scale block (the caller splits there),
// so a 128-column block's sums share one scale: C is stored and zeroed after each 128 columns and
// added into fp32 accumulators times the scale, as Fp8DotRows does with its block totals.
//
// Each C element is its own chain of fp32 additions over the columns, whatever rows and routes
// share its tile, so results do not depend on the row blocking or on the routes' grouping.

// Tiles 0, 1: C of sets a, b (m x nr fp32); 2, 3: A of set a (halves 0 / 1 of a 64-column
// chunk); 4, 5: A of set b; 6, 7: B halves (16 column pairs x nr).
struct alignas(64) AmxTileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

HWY_INLINE void AmxConfigure(int m, int nr) {
  AmxTileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 2; ++t) {
    c.rows[t] = static_cast<uint8_t>(m);
    c.colsb[t] = static_cast<uint16_t>(4 * nr);
  }
  for (int t = 2; t < 6; ++t) {
    c.rows[t] = static_cast<uint8_t>(m);
    c.colsb[t] = 64;
  }
  for (int t = 6; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = static_cast<uint16_t>(4 * nr);
  }
  _tile_loadconfig(&c);
}

// Packs the bf16 activations of routes acts[0, nr) (nr <= 16) over k columns (a multiple of 32)
// into B rows: chunk c (columns [64c, 64c + 64)) is 32 rows of nr u32, row r column n holding
// route n's u32 (bf16 pair) r of the chunk, in the activations' own order, which is the A tiles'
// (fp8: the table decode's, Fp8Pos, zero-padded to whole chunks: kFp8Order; bf16: natural).
// bf16's short last chunk (32 columns) has zero rows 16..31 (its A half 1 is zero too).
template <bool kFp8Order>
HWY_INLINE void AmxPackB(const ActView* acts, int nr, size_t k, uint32_t* HWY_RESTRICT b) {
  const size_t nch = (k + 63) / 64;
  for (size_t c = 0; c < nch; ++c) {
    uint32_t* t = b + 32 * nr * c;
    const int ndw = kFp8Order || c * 64 + 64 <= k ? 32 : 16;
    if (ndw < 32) std::memset(t, 0, 32 * nr * sizeof(uint32_t));
    for (int n = 0; n < nr; ++n) {
      const uint32_t* src = reinterpret_cast<const uint32_t*>(acts[n].xb + 64 * c);
      for (int dd = 0; dd < ndw; ++dd) t[dd * nr + n] = src[dd];
    }
  }
}

// Decodes (fp8) or copies (bf16) 64-column chunk c of a row of k columns into s (tile-ready:
// chunk c at s + 64c, A half 0 at +0, half 1 at +32); a 32-column tail chunk fills half 0 and
// zeroes half 1 (bf16) or fills positions i < 16 of both halves (fp8). Software prefetch pf
// bytes ahead in the row (and on into the rows after it: the rows of a set are contiguous).
template <bool kFp8>
HWY_INLINE void AmxStageChunk(const Fp8Decoder& dec, const uint8_t* row, size_t c, size_t k,
                              PfDist pf, uint16_t* HWY_RESTRICT s) {
  const bool tail = 64 * c + 64 > k;
  if constexpr (kFp8) {
    PfAhead(pf, row + 64 * c);
    __m512i p0, p1;
    dec.DecodeBf16(LoadFp8Codes(row + 64 * c, !tail), p0, p1);
    _mm512_store_si512(s + 64 * c, p0);
    _mm512_store_si512(s + 64 * c + 32, p1);
  } else {
    PfAhead(pf, row + 128 * c);
    PfAhead(pf, row + 128 * c + 64);
    _mm512_store_si512(s + 64 * c, _mm512_loadu_si512(row + 128 * c));
    _mm512_store_si512(s + 64 * c + 32,
                       tail ? _mm512_setzero_si512() : _mm512_loadu_si512(row + 128 * c + 64));
  }
}

// Stages a tile's rows (m rows of sets a and b) into the scratch sa / sb (row j at j * spitch)
// row by row, each set as one sequential stream as the vector kernels read it (staging 64
// columns of all 16 rows at a time, 32 streams per core, ran at 0.62 of DRAM on a 2-vCPU
// EPYC machine against 0.85), in steps that the previous tile's instructions interleave with.
template <bool kFp8>
struct AmxStager {
  const uint8_t* wa = nullptr;
  const uint8_t* wb = nullptr;
  size_t pitch = 0, k = 0, nch = 0, spitch = 0;
  PfDist pf;
  int m = 0;
  size_t done = 0, total = 0;  // row-chunks (row j, chunk c at j * nch + c) staged / to stage
  uint16_t* sa = nullptr;
  uint16_t* sb = nullptr;

  HWY_INLINE void Advance(const Fp8Decoder& dec, size_t count) {
    const size_t end = std::min(total, done + count);
    for (; done < end; ++done) {
      const size_t j = done / nch, c = done % nch;
      AmxStageChunk<kFp8>(dec, wa + j * pitch, c, k, pf, sa + j * spitch);
      if (wb != nullptr) AmxStageChunk<kFp8>(dec, wb + j * pitch, c, k, pf, sb + j * spitch);
    }
  }
};

// acc[0, m * nr) (+)= scale * C tile `ct` (stored compact, row j route n at j * nr + n).
#define MOE_AMX_FLUSH(ct, cbuf, acc, count, scale, first)                          \
  do {                                                                           \
    _tile_stored(ct, cbuf, 4 * nr);                                              \
    _tile_zero(ct);                                                              \
    const __m512 sv = _mm512_set1_ps(scale);                                     \
    for (int v = 0; v < (count); v += 16) {                                      \
      const __mmask16 mk = (count) - v >= 16 ? 0xFFFF : (1u << ((count) - v)) - 1; \
      const __m512 cv = _mm512_maskz_load_ps(mk, cbuf + v);                      \
      const __m512 prev = (first) ? _mm512_setzero_ps() : _mm512_maskz_load_ps(mk, acc + v); \
      _mm512_mask_store_ps(acc + v, mk, _mm512_fmadd_ps(cv, sv, prev));          \
    }                                                                            \
  } while (0)

// The tiles over staged rows sa / sb (m rows of sets a and b, sb null for one set): acc_a /
// acc_b [m * nr] (row j route n at j * nr + n) = the rows' dots with the nr routes packed in
// bpack. fp8 (kFp8): scale_a / scale_b per 128-column block; bf16: none. Meanwhile `next`
// stages the following tile (nothing when it has nothing to stage), a proportional part per
// chunk: the tile instructions run on the AMX unit beside the vector decode. The tiles must be
// configured for (m, nr).
template <bool kFp8>
HWY_INLINE void AmxRowsTile(const uint16_t* sa, const uint16_t* sb, size_t spitch, int m,
                            size_t k, const float* scale_a, const float* scale_b,
                            const uint32_t* bpack, int nr, const Fp8Decoder& dec,
                            AmxStager<kFp8>& next, float* HWY_RESTRICT acc_a,
                            float* HWY_RESTRICT acc_b) {
  alignas(64) float cbuf[256];
  const size_t nch = (k + 63) / 64;
  const int count = m * nr;
  const bool two = sb != nullptr;
  const size_t step = (next.total + nch - 1) / nch;
  _tile_zero(0);
  _tile_zero(1);
  bool first = true;
  const size_t stride = 2 * spitch;
  for (size_t c = 0; c < nch; ++c) {
    _tile_loadd(6, bpack + 32 * nr * c, 4 * nr);
    _tile_loadd(7, bpack + 32 * nr * c + 16 * nr, 4 * nr);
    _tile_loadd(2, sa + 64 * c, stride);
    _tile_loadd(3, sa + 64 * c + 32, stride);
    _tile_dpbf16ps(0, 2, 6);
    _tile_dpbf16ps(0, 3, 7);
    if (two) {
      _tile_loadd(4, sb + 64 * c, stride);
      _tile_loadd(5, sb + 64 * c + 32, stride);
      _tile_dpbf16ps(1, 4, 6);
      _tile_dpbf16ps(1, 5, 7);
    }
    if constexpr (kFp8) {
      // End of a 128-column scale block (or of the row).
      if ((c & 1) == 1 || c + 1 == nch) {
        const size_t blk = c / 2;
        MOE_AMX_FLUSH(0, cbuf, acc_a, count, scale_a[blk], first);
        if (two) MOE_AMX_FLUSH(1, cbuf, acc_b, count, scale_b[blk], first);
        first = false;
      }
    }
    next.Advance(dec, step);
  }
  if constexpr (!kFp8) {
    _tile_stored(0, acc_a, 4 * nr);
    if (two) _tile_stored(1, acc_b, 4 * nr);
  }
}
#undef MOE_AMX_FLUSH

// The AMX state of a Forward call's work item: configures the tiles for (m, nr) when they
// change, and releases them when the item is done.
class AmxScope {
 public:
  AmxScope() = default;
  AmxScope(const AmxScope&) = delete;
  AmxScope& operator=(const AmxScope&) = delete;
  ~AmxScope() {
    if (m_ >= 0) _tile_release();
  }
  void Configure(int m, int nr) {
    if (m == m_ && nr == nr_) return;
    AmxConfigure(m, nr);
    m_ = m;
    nr_ = nr;
  }

 private:
  int m_ = -1;
  int nr_ = -1;
};

// A group's packed B: its n routes in subgroups of 16, subgroup s (routes
// [16s, 16s + nr)) at dword 32 * nch * 16s, laid out by AmxPackB with nr columns (nch: 64-column
// chunks of the contraction dimension).
HWY_INLINE size_t AmxSubgroupOffset(size_t nch, int s0) { return 32 * nch * s0; }

// Packs routes acts[0, n) of a group (any n) over k columns into b (n * 32 * nch dwords).
template <bool kFp8Order>
HWY_INLINE void AmxPackGroup(const ActView* acts, int n, size_t k, uint32_t* HWY_RESTRICT b) {
  const size_t nch = (k + 63) / 64;
  for (int s0 = 0; s0 < n; s0 += 16) {
    AmxPackB<kFp8Order>(acts + s0, std::min(16, n - s0), k, b + AmxSubgroupOffset(nch, s0));
  }
}

// Zeroes a short last chunk (k % 64 == 32) of a group whose B is then written element by
// element (AmxPutBf16): the rows that hold no column stay zero.
HWY_INLINE void AmxZeroTail(int n, size_t k, uint32_t* HWY_RESTRICT b) {
  if (k % 64 == 0) return;
  const size_t nch = (k + 63) / 64;
  for (int s0 = 0; s0 < n; s0 += 16) {
    const int nr = std::min(16, n - s0);
    std::memset(b + AmxSubgroupOffset(nch, s0) + 32 * nr * (nch - 1), 0,
                32 * nr * sizeof(uint32_t));
  }
}

// Writes bf16(v[j]) for columns j in [c0, c1) of route i (of a group of n routes) into the
// group's packed B b over k columns, at the column's position (kFp8Order: Fp8Pos).
template <bool kFp8Order>
HWY_INLINE void AmxPutBf16(uint32_t* b, int n, size_t k, int i, size_t c0, size_t c1,
                           const float* HWY_RESTRICT v) {
  const size_t nch = (k + 63) / 64;
  const int s0 = i / 16 * 16;
  const int nr = std::min(16, n - s0);
  uint16_t* t = reinterpret_cast<uint16_t*>(b + AmxSubgroupOffset(nch, s0));
  for (size_t j = c0; j < c1; ++j) {
    const size_t c = j / 64;
    const size_t pos = kFp8Order ? Fp8Pos(j % 64) : j % 64;
    t[2 * ((32 * c + pos / 2) * nr + (i - s0)) + (pos & 1)] = common::FloatToBf16(v[j]);
  }
}

// Dots rows [r0, r1) of set a (rows a_row0 + (r - r0)) and, when b_row0 >= 0, the same rows of
// set b (b_row0 + (r - r0)) of matrix m of expert e with a group's n routes, packed in bgroup
// (AmxPackGroup): route i's dot of row offset j goes to `store(set, j, i, value)`.
template <common::WeightFormat F, class Store>
HWY_INLINE void AmxDotRows(const MatrixRef& mat, size_t e, size_t a_row0, long b_row0,
                           size_t nrows, const uint32_t* bgroup, int n, const Store& store) {
  constexpr bool kFp8 = F == common::WeightFormat::kFp8Block;
  const size_t k = mat.cols;
  const size_t pitch = kFp8 ? k : 2 * k;
  const uint8_t* base = static_cast<const uint8_t*>(mat.weights) + e * mat.rows * pitch;
  const size_t bcols = (k + common::kFp8BlockSize - 1) / common::kFp8BlockSize;
  const size_t brows = (mat.rows + common::kFp8BlockSize - 1) / common::kFp8BlockSize;
  const float* scales = kFp8 ? static_cast<const float*>(mat.scales) + e * brows * bcols : nullptr;
  const size_t nch = (k + 63) / 64;
  // u16 per scratch row: one 64-byte line more than the row, so that a tile's 16 rows fall into
  // different L1 sets (rows 4 KiB apart all map to one set of the 12-way L1 and evict each other).
  const size_t spitch = 64 * nch + 32;
  // Two tiles' scratch (staged / being staged), each 16 rows of sets a and b: 256 KiB for
  // k = 2048 bf16 columns, in L2.
  static thread_local common::AlignedBuffer<uint16_t> scratch;
  if (scratch.size() < 64 * spitch) scratch = common::AlignedBuffer<uint16_t>(64 * spitch);
  alignas(64) float acc_a[256];
  alignas(64) float acc_b[256];
  const bool two = b_row0 >= 0;
  // Rows of the tile at row offset j0: 16, or fewer where a set's 128-row scale block ends (fp8).
  auto tile_rows = [&](size_t j0) {
    size_t m = std::min<size_t>(16, nrows - j0);
    if constexpr (kFp8) {
      m = std::min(m, common::kFp8BlockSize - (a_row0 + j0) % common::kFp8BlockSize);
      if (two) {
        m = std::min(m, common::kFp8BlockSize -
                            (static_cast<size_t>(b_row0) + j0) % common::kFp8BlockSize);
      }
    }
    return m;
  };
  auto stager_for = [&](size_t j0, int buf) {
    AmxStager<kFp8> st;
    if (j0 >= nrows) return st;  // nothing to stage
    st.m = static_cast<int>(tile_rows(j0));
    st.wa = base + (a_row0 + j0) * pitch;
    st.wb = two ? base + (static_cast<size_t>(b_row0) + j0) * pitch : nullptr;
    st.pitch = pitch;
    st.k = k;
    st.nch = nch;
    st.spitch = spitch;
    st.pf = mat.prefetch;
    st.total = static_cast<size_t>(st.m) * nch;
    st.sa = scratch.data() + buf * 32 * spitch;
    st.sb = st.sa + 16 * spitch;
    return st;
  };
  const Fp8Decoder dec;
  AmxScope amx;
  // Each tile's rows are staged once and serve every subgroup of 16 routes in turn (a group
  // with 36 routes runs three); the next tile is staged during the first subgroup's
  // instructions (AmxRowsTile advances it, and finds nothing left to do in the later ones).
  AmxStager<kFp8> cur = stager_for(0, 0);
  cur.Advance(dec, cur.total);
  int buf = 0;
  for (size_t j0 = 0; j0 < nrows;) {
    const size_t m = static_cast<size_t>(cur.m);
    AmxStager<kFp8> next = stager_for(j0 + m, buf ^ 1);
    const size_t ra = a_row0 + j0, rb = two ? static_cast<size_t>(b_row0) + j0 : 0;
    for (int s0 = 0; s0 < n; s0 += 16) {
      const int nr = std::min(16, n - s0);
      amx.Configure(cur.m, nr);
      AmxRowsTile<kFp8>(cur.sa, two ? cur.sb : nullptr, spitch, cur.m, k,
                        kFp8 ? scales + (ra / common::kFp8BlockSize) * bcols : nullptr,
                        kFp8 && two ? scales + (rb / common::kFp8BlockSize) * bcols : nullptr,
                        bgroup + AmxSubgroupOffset(nch, s0), nr, dec, next, acc_a, acc_b);
      for (size_t j = 0; j < m; ++j) {
        for (int i = 0; i < nr; ++i) {
          store(0, j0 + j, s0 + i, acc_a[j * nr + i]);
          if (two) store(1, j0 + j, s0 + i, acc_b[j * nr + i]);
        }
      }
    }
    next.Advance(dec, next.total);  // whatever the interleaving left
    j0 += m;
    cur = next;
    buf ^= 1;
  }
}
#endif

}  // namespace HWY_NAMESPACE
}  // namespace cpu_moe
}  // namespace moe
HWY_AFTER_NAMESPACE();

#endif  // MOE_CPU_MOE_INTERNAL_AMX_TILES_INL_H_ toggle guard
