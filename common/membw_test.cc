#include "common/membw.h"

#include <cmath>
#include <cstdio>
#include <vector>

#include "common/thread_pool.h"
#include "gtest/gtest.h"

namespace moe::common {
namespace {

TEST(MembwTest, LastLevelCacheIsPlausibleOrUnknown) {
  const size_t llc = LastLevelCacheBytes();
  std::printf("last-level cache: %zu bytes\n", llc);
  if (llc != 0) {
    EXPECT_GE(llc, size_t{64} << 10);
    EXPECT_LE(llc, size_t{16} << 30);
  }
}

TEST(MembwTest, ProbeKeepsItsBufferAndReadsRepeatedly) {
  ThreadPool pool(2);
  DramProbe probe(pool, (32 << 20) + 12345);  // rounded down to whole 64 KiB chunks
  EXPECT_EQ(probe.bytes(), size_t{32} << 20);
  for (int i = 0; i < 3; ++i) {
    const double gbps = probe.Measure(1 + i);
    EXPECT_TRUE(std::isfinite(gbps));
    EXPECT_GT(gbps, 0.1);
    EXPECT_LT(gbps, 10000.0);
  }
}

TEST(MembwTest, EveryReadPatternReportsARate) {
  ThreadPool pool(2);
  // 17 chunks: one full 16-chunk run and a run of one chunk, which the two-stream pattern
  // cannot split into halves and reads as one stream.
  DramProbe probe(pool, 17 << 16);
  const std::vector<DramProbe::Reading> readings = probe.MeasureEach();
  ASSERT_EQ(readings.size(), 4u);
  for (const DramProbe::Reading& r : readings) {
    EXPECT_NE(r.name, nullptr);
    EXPECT_TRUE(std::isfinite(r.gbps)) << r.name;
    EXPECT_GT(r.gbps, 0.1) << r.name;
    EXPECT_LT(r.gbps, 10000.0) << r.name;
  }
}

TEST(MembwTest, SmallMeasurementGivesAFinitePositiveRate) {
  // Not a bandwidth claim (the buffer is small and the machine shared): only that the probe runs,
  // reads everything and returns a sane number. membw_probe measures the real figure.
  ThreadPool pool(2);
  const double gbps = MeasureDramReadGBps(pool, 32 << 20, 3);
  std::printf("32 MiB read: %.1f GB/s\n", gbps);
  EXPECT_TRUE(std::isfinite(gbps));
  EXPECT_GT(gbps, 0.1);
  EXPECT_LT(gbps, 10000.0);
  // Degenerate arguments are clamped, not fatal.
  EXPECT_GT(MeasureDramReadGBps(pool, 1, 0), 0.0);
}

}  // namespace
}  // namespace moe::common
