// Where a warp lane finds its q4_0 weights in one of cpu_moe's panels (cpu_moe::Layout::kPanels,
// see cpu_moe.h): shared by the GPU kernels and a CPU test that rebuilds whole matrices from
// PackPanels' bytes with it.
//
// A panel holds 16 rows. Per 32-column block b: 256 bytes of codes (byte 64v + 4j + i: row j's
// column 32b + 8v + i in the low nibble, 32b + 8v + 4 + i in the high one) and the 16 rows' fp16
// scales (32 bytes), in groups of two blocks (512 bytes of codes, then 64 of scales; a lone last
// block: 256, then 32). A kernel step is one group. Lane l takes block 2s + (l >> 4),
// v = (l >> 2) & 3 and rows 4q .. 4q+3 with q = l & 3: 16 bytes of codes (word r is row 4q + r)
// and 8 bytes of scales (fp16 r is row 4q + r). Plain header, usable from host and device code.
#ifndef MOE_ENGINE_CUDA_EXPERTS_Q4_PANELS_H_
#define MOE_ENGINE_CUDA_EXPERTS_Q4_PANELS_H_

#include <cstdint>

#if defined(__CUDACC__)
#define MOE_Q4_HD __host__ __device__ __forceinline__
#else
#define MOE_Q4_HD inline
#endif

namespace moe::engine::gpu::q4_panels {

inline constexpr int kRows = 16;          // rows per panel
inline constexpr int kBlockBytes = 288;   // codes and scales of one 32-column block
inline constexpr int kGroupBytes = 576;   // two blocks

// Bytes of one panel of `cols` columns.
MOE_Q4_HD uint64_t PanelBytes(int cols) { return static_cast<uint64_t>(cols / 32) * kBlockBytes; }
// Steps (groups) along a row of `cols` columns.
MOE_Q4_HD int Steps(int cols) { return (cols / 32 + 1) / 2; }
// The 32-column block lane `lane` reads at step `s` (may be past the end in a lone last block).
MOE_Q4_HD int Block(int s, int lane) { return 2 * s + (lane >> 4); }
// The first of the lane's 8 columns: codes' low nibbles are columns first + i, high nibbles
// first + 4 + i, for byte i of each word.
MOE_Q4_HD int FirstColumn(int s, int lane) { return 32 * Block(s, lane) + 8 * ((lane >> 2) & 3); }
// The first of the lane's 4 rows within the panel.
MOE_Q4_HD int FirstRow(int lane) { return 4 * (lane & 3); }
// Byte offsets within the panel of the lane's 16 bytes of codes and 8 bytes of scales at step
// s (for a valid block: Block(s, lane) < cols / 32).
MOE_Q4_HD uint32_t CodesOffset(int s, int lane) {
  return static_cast<uint32_t>(s) * kGroupBytes + (lane >> 4) * 256 + ((lane >> 2) & 3) * 64 +
         (lane & 3) * 16;
}
MOE_Q4_HD uint32_t ScalesOffset(int cols, int s, int lane) {
  const int left = cols / 32 - 2 * s;
  const int blocks = left < 2 ? left : 2;  // blocks in this group
  return static_cast<uint32_t>(s) * kGroupBytes + blocks * 256 + (lane >> 4) * 32 +
         (lane & 3) * 8;
}

}  // namespace moe::engine::gpu::q4_panels

#undef MOE_Q4_HD

#endif  // MOE_ENGINE_CUDA_EXPERTS_Q4_PANELS_H_
