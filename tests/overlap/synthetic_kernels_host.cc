// Host-side reference of the checksum consumer (compiled with and without CUDA).
#include "tests/overlap/synthetic_kernels.h"

#include <cstring>

namespace moe::overlap_test {

uint32_t HostChecksum(const uint8_t* row, uint64_t bytes) {
  uint32_t acc = 0;
  for (uint64_t i = 0; i < bytes / 4; ++i) {
    uint32_t w;
    std::memcpy(&w, row + 4 * i, 4);
    acc += w * static_cast<uint32_t>(2 * i + 1);
  }
  return acc;
}

}  // namespace moe::overlap_test
