// Highway's foreach_target re-includes this file once per SIMD target.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "common/membw.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "hwy/cache_control.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace moe::common {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Sum of n 64-bit words at p (aligned to the vector size, n a multiple of 8 * lanes). Four
// independent accumulators keep several loads in flight; the sum is returned so the loads cannot
// be optimized away. prefetch_bytes > 0 adds a software prefetch that far ahead of the loads
// (one per 64-byte line): the hardware prefetchers stop at every 4 KiB page, and a probe without
// software prefetch reads less than kernels that have it (on the GPU machine's host 92-98 GB/s
// while the bf16 expert kernel streamed 110-120).
uint64_t SumWords(const uint64_t* HWY_RESTRICT p, size_t n, size_t prefetch_bytes) {
  const hn::ScalableTag<uint64_t> d;
  const size_t lanes = hn::Lanes(d);
  auto s0 = hn::Zero(d), s1 = hn::Zero(d), s2 = hn::Zero(d), s3 = hn::Zero(d);
  size_t i = 0;
  const size_t step_bytes = 4 * lanes * sizeof(uint64_t);
  for (; i + 4 * lanes <= n; i += 4 * lanes) {
    if (prefetch_bytes != 0) {
      const char* ahead = reinterpret_cast<const char*>(p + i) + prefetch_bytes;
      for (size_t o = 0; o < step_bytes; o += 64) hwy::Prefetch(ahead + o);
    }
    s0 = hn::Add(s0, hn::Load(d, p + i));
    s1 = hn::Add(s1, hn::Load(d, p + i + lanes));
    s2 = hn::Add(s2, hn::Load(d, p + i + 2 * lanes));
    s3 = hn::Add(s3, hn::Load(d, p + i + 3 * lanes));
  }
  uint64_t sum = hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(s0, s1), hn::Add(s2, s3))));
  for (; i < n; ++i) sum += p[i];
  return sum;
}

// The read pattern of the bf16 expert kernel (a gate row and its up row at once): two streams,
// the halves of [p, p + 2n), read side by side, each with a prefetch l1_bytes ahead into L1 and
// one l2_bytes ahead into L2 only (prefetcht1 on x86). n as for SumWords.
uint64_t SumWordsTwoStreams(const uint64_t* HWY_RESTRICT p, size_t n, size_t l1_bytes,
                            size_t l2_bytes) {
  const hn::ScalableTag<uint64_t> d;
  const size_t lanes = hn::Lanes(d);
  const uint64_t* HWY_RESTRICT q = p + n;
  auto s0 = hn::Zero(d), s1 = hn::Zero(d), s2 = hn::Zero(d), s3 = hn::Zero(d);
  size_t i = 0;
  const size_t step_bytes = 2 * lanes * sizeof(uint64_t);
  for (; i + 2 * lanes <= n; i += 2 * lanes) {
    for (size_t o = 0; o < step_bytes; o += 64) {
      const char* a = reinterpret_cast<const char*>(p + i) + o;
      const char* b = reinterpret_cast<const char*>(q + i) + o;
      hwy::Prefetch(a + l1_bytes);
      hwy::Prefetch(b + l1_bytes);
#if HWY_ARCH_X86
      _mm_prefetch(a + l2_bytes, _MM_HINT_T1);
      _mm_prefetch(b + l2_bytes, _MM_HINT_T1);
#endif
    }
    s0 = hn::Add(s0, hn::Load(d, p + i));
    s1 = hn::Add(s1, hn::Load(d, q + i));
    s2 = hn::Add(s2, hn::Load(d, p + i + lanes));
    s3 = hn::Add(s3, hn::Load(d, q + i + lanes));
  }
  uint64_t sum = hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(s0, s1), hn::Add(s2, s3))));
  for (; i < n; ++i) sum += p[i] + q[i];
  return sum;
}

}  // namespace HWY_NAMESPACE
}  // namespace moe::common
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/membw.h"

namespace moe::common {

HWY_EXPORT(SumWords);
HWY_EXPORT(SumWordsTwoStreams);

namespace {

constexpr size_t kChunkBytes = 64 << 10;  // the buffer's unit
constexpr uint64_t kRunChunks = 16;       // chunks per work item (1 MiB)

// Keeps the sums observable so the reads are not dead code.
std::atomic<uint64_t> g_sink{0};

}  // namespace

DramProbe::DramProbe(ThreadPool& pool, size_t bytes)
    : pool_(pool), bytes_(std::max(kChunkBytes, bytes / kChunkBytes * kChunkBytes)) {
  const size_t words = bytes_ / sizeof(uint64_t);
  // On huge pages (best effort), as the experts a kernel is held against should be.
  auto* buf = new AlignedBuffer<uint64_t>(words, AlignedBuffer<uint64_t>::kHugePageBytes);
  AdviseHugePages(buf->data(), buf->bytes());
  buf_ = buf;
  const uint64_t chunks = bytes_ / kChunkBytes;
  const size_t chunk_words = kChunkBytes / sizeof(uint64_t);
  // Write every page first, from the pool's threads (first touch places pages near their users),
  // so the timed reads never fault.
  pool_.ParallelFor(chunks, [&](uint64_t c, int) {
    uint64_t* p = buf->data() + c * chunk_words;
    for (size_t i = 0; i < chunk_words; ++i) p[i] = c + i;
  });
}

DramProbe::~DramProbe() { delete static_cast<AlignedBuffer<uint64_t>*>(buf_); }

std::vector<DramProbe::Reading> DramProbe::MeasureEach() {
  const AlignedBuffer<uint64_t>& buf = *static_cast<const AlignedBuffer<uint64_t>*>(buf_);
  const uint64_t chunks = bytes_ / kChunkBytes;
  const size_t chunk_words = kChunkBytes / sizeof(uint64_t);
  // Workers take runs of kRunChunks chunks (the last run may be shorter) from the pool's counter,
  // so a slow worker does not stall the others, and each run is one stream long enough for the
  // prefetchers to get going (the kernels' work items stream 100 KiB and more per row set).
  // (Do not cache the dispatch pointer before the first call: until then the table holds
  // Highway's CPU-detecting stub, which runs cpuid on every call and, under a hypervisor, costs
  // microseconds each time.)
  const uint64_t runs = (chunks + kRunChunks - 1) / kRunChunks;
  struct Pattern {
    const char* name;
    int streams;
    size_t l1, l2;
  };
  static constexpr Pattern kPatterns[] = {{"1 stream, hardware prefetch only", 1, 0, 0},
                                          {"1 stream, prefetch 2 KiB ahead", 1, 2048, 0},
                                          {"1 stream, prefetch 4 KiB ahead", 1, 4096, 0},
                                          {"2 streams, prefetch 4 KiB (L1) + 8 KiB (L2) ahead", 2,
                                           4096, 8192}};
  std::vector<Reading> out;
  for (const Pattern& pat : kPatterns) {
    std::atomic<uint64_t> total{0};
    const auto t0 = std::chrono::steady_clock::now();
    pool_.ParallelFor(runs, [&](uint64_t r, int) {
      const uint64_t c0 = r * kRunChunks, c1 = std::min<uint64_t>(chunks, c0 + kRunChunks);
      const uint64_t* p = buf.data() + c0 * chunk_words;
      const size_t words = (c1 - c0) * chunk_words;
      uint64_t sum;
      if (pat.streams == 2) {
        // Halves of whole chunks; an odd chunk left over is read alone.
        const size_t half = (c1 - c0) / 2 * chunk_words;
        sum = HWY_DYNAMIC_DISPATCH(SumWordsTwoStreams)(p, half, pat.l1, pat.l2);
        if (2 * half < words) {
          sum += HWY_DYNAMIC_DISPATCH(SumWords)(p + 2 * half, words - 2 * half, pat.l1);
        }
      } else {
        sum = HWY_DYNAMIC_DISPATCH(SumWords)(p, words, pat.l1);
      }
      total.fetch_add(sum, std::memory_order_relaxed);
    });
    const auto t1 = std::chrono::steady_clock::now();
    g_sink.fetch_add(total.load(), std::memory_order_relaxed);
    const double s = std::chrono::duration<double>(t1 - t0).count();
    out.push_back({pat.name, static_cast<double>(bytes_) / s / 1e9});
  }
  return out;
}

double DramProbe::Measure(int reps) {
  reps = std::max(1, reps);
  // Each round reads the buffer once per pattern and keeps the fastest: the limit is the best
  // streaming read this machine does.
  std::vector<double> gbps;
  for (int r = 0; r < reps; ++r) {
    double best = 0.0;
    for (const Reading& reading : MeasureEach()) best = std::max(best, reading.gbps);
    gbps.push_back(best);
  }
  std::sort(gbps.begin(), gbps.end());
  const size_t m = gbps.size() / 2;
  return gbps.size() % 2 ? gbps[m] : (gbps[m - 1] + gbps[m]) / 2;
}

double MeasureDramReadGBps(ThreadPool& pool, size_t bytes, int reps) {
  DramProbe probe(pool, bytes);
  return probe.Measure(reps);
}

size_t LastLevelCacheBytes() {
  int best_level = 0;
  size_t best_bytes = 0;
  for (int index = 0; index < 16; ++index) {
    const std::string dir =
        "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    std::ifstream level_file(dir + "level"), type_file(dir + "type"), size_file(dir + "size");
    int level = 0;
    std::string type, size;
    if (!(level_file >> level) || !(type_file >> type) || !(size_file >> size)) continue;
    if (type == "Instruction" || size.empty()) continue;
    size_t value = std::stoull(size);  // "491520K": digits, then a unit
    switch (size.back()) {
      case 'K': value <<= 10; break;
      case 'M': value <<= 20; break;
      case 'G': value <<= 30; break;
      default: break;
    }
    if (level > best_level || (level == best_level && value > best_bytes)) {
      best_level = level;
      best_bytes = value;
    }
  }
  return best_bytes;
}

}  // namespace moe::common
#endif  // HWY_ONCE
