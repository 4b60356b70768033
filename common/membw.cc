// Highway's foreach_target re-includes this file once per SIMD target.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "common/membw.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace moe::common {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Sum of n 64-bit words at p (aligned to the vector size, n a multiple of 8 * lanes). Four
// independent accumulators keep several loads in flight; the sum is returned so the loads cannot
// be optimized away.
uint64_t SumWords(const uint64_t* HWY_RESTRICT p, size_t n) {
  const hn::ScalableTag<uint64_t> d;
  const size_t lanes = hn::Lanes(d);
  auto s0 = hn::Zero(d), s1 = hn::Zero(d), s2 = hn::Zero(d), s3 = hn::Zero(d);
  size_t i = 0;
  for (; i + 4 * lanes <= n; i += 4 * lanes) {
    s0 = hn::Add(s0, hn::Load(d, p + i));
    s1 = hn::Add(s1, hn::Load(d, p + i + lanes));
    s2 = hn::Add(s2, hn::Load(d, p + i + 2 * lanes));
    s3 = hn::Add(s3, hn::Load(d, p + i + 3 * lanes));
  }
  uint64_t sum = hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(s0, s1), hn::Add(s2, s3))));
  for (; i < n; ++i) sum += p[i];
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

namespace {

constexpr size_t kChunkBytes = 64 << 10;  // unit of work split across workers

// Keeps the sums observable so the reads are not dead code.
std::atomic<uint64_t> g_sink{0};

}  // namespace

double MeasureDramReadGBps(ThreadPool& pool, size_t bytes, int reps) {
  bytes = std::max(kChunkBytes, bytes / kChunkBytes * kChunkBytes);
  reps = std::max(1, reps);
  const size_t words = bytes / sizeof(uint64_t);
  // On huge pages (best effort), as the experts a kernel is held against should be.
  AlignedBuffer<uint64_t> buf(words, AlignedBuffer<uint64_t>::kHugePageBytes);
  AdviseHugePages(buf.data(), buf.bytes());
  const uint64_t chunks = bytes / kChunkBytes;
  const size_t chunk_words = kChunkBytes / sizeof(uint64_t);
  // Write every page first, from the pool's threads (first touch places pages near their users),
  // so the timed reads never fault.
  pool.ParallelFor(chunks, [&](uint64_t c, int) {
    uint64_t* p = buf.data() + c * chunk_words;
    for (size_t i = 0; i < chunk_words; ++i) p[i] = c + i;
  });
  // Chunks are handed out by the pool's counter, so a slow worker does not stall the others.
  // Dispatch per 64 KiB chunk costs nothing measurable. (Do not cache the pointer before the
  // first call: until then the table holds Highway's CPU-detecting stub, which runs cpuid on
  // every call and, under a hypervisor, costs microseconds each time.)
  std::vector<double> gbps;
  for (int r = 0; r < reps; ++r) {
    std::atomic<uint64_t> total{0};
    const auto t0 = std::chrono::steady_clock::now();
    pool.ParallelFor(chunks, [&](uint64_t c, int) {
      const uint64_t* p = buf.data() + c * chunk_words;
      total.fetch_add(HWY_DYNAMIC_DISPATCH(SumWords)(p, chunk_words), std::memory_order_relaxed);
    });
    const auto t1 = std::chrono::steady_clock::now();
    g_sink.fetch_add(total.load(), std::memory_order_relaxed);
    const double s = std::chrono::duration<double>(t1 - t0).count();
    gbps.push_back(static_cast<double>(bytes) / s / 1e9);
  }
  std::sort(gbps.begin(), gbps.end());
  const size_t m = gbps.size() / 2;
  return gbps.size() % 2 ? gbps[m] : (gbps[m - 1] + gbps[m]) / 2;
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
