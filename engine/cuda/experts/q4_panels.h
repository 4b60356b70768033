// Where a warp lane finds its q4_0 or nvfp4 weights in one of cpu_moe's panels
// (cpu_moe::Layout::kPanels, see cpu_moe.h), and how a lane turns nvfp4's e2m1 codes into fp16
// bits: shared by the GPU kernels and a CPU test that rebuilds whole matrices from PackPanels'
// bytes with it.
//
// A panel holds 16 rows. Per 32-column block b: 256 bytes of codes (byte 64v + 4j + i: row j's
// column 32b + 8v + i in the low nibble, 32b + 8v + 4 + i in the high one) and the 16 rows' fp16
// scales (32 bytes), in groups of two blocks (512 bytes of codes, then 64 of scales; a lone last
// block: 256, then 32). A kernel step is one group. Lane l takes block 2s + (l >> 4),
// v = (l >> 2) & 3 and rows 4q .. 4q+3 with q = l & 3: 16 bytes of codes (word r is row 4q + r)
// and 8 bytes of scales (fp16 r is row 4q + r). nvfp4 panels have the same codes (e2m1 codes in
// the nibbles) and groups; their 32 bytes of scales per block are the 16 rows' e4m3 scales of
// columns [32b, 32b + 16), then of [32b + 16, 32b + 32), so a lane's 8 columns share one scale
// per row and it reads 4 bytes (byte r is row 4q + r). Plain header, usable from host and device
// code.
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

// nvfp4: the lane's 4 bytes of e4m3 scales at step s (their 16 columns hold the lane's 8).
MOE_Q4_HD uint32_t Nvfp4ScalesOffset(int cols, int s, int lane) {
  const int left = cols / 32 - 2 * s;
  const int blocks = left < 2 ? left : 2;
  return static_cast<uint32_t>(s) * kGroupBytes + blocks * 256 + (lane >> 4) * 32 +
         ((lane >> 3) & 1) * 16 + (lane & 3) * 4;
}

// Two e2m1 codes of a word of codes as fp16x2 bits: the nibbles at bits [shift, shift + 4)
// (low half) and [shift + 16, shift + 20) (high half), each as sign << 15 | (exponent and
// mantissa) << 9, which is the code's value times 2^-14 exactly (e2m1's one subnormal, 0.5,
// becomes the fp16 subnormal 2^-15). Shifts 0, 8, 4 and 12 give the columns (0, 2), (1, 3),
// (4, 6) and (5, 7) of the word's 8 (see above: byte i holds columns i and 4 + i).
MOE_Q4_HD uint32_t E2m1PairAsHalf2Bits(uint32_t word, int shift) {
  const uint32_t v = word >> shift;
  return ((v & 0x00070007u) << 9) | ((v & 0x00080008u) << 12);
}

}  // namespace moe::engine::gpu::q4_panels

#undef MOE_Q4_HD

#endif  // MOE_ENGINE_CUDA_EXPERTS_Q4_PANELS_H_
