"""Copts shared by moe-offload's targets.

Warnings (-Wall -Wextra -Werror) come from .bazelrc's per_file_copt, which applies them to our own
packages only, so generated and external code is not held to them.
"""

# Highway: compile SSE4 as the baseline (the oldest target we ship) and let foreach_target.h add
# AVX2, AVX3 and AVX3_DL, chosen at run time by HWY_DYNAMIC_DISPATCH. Highway 1.0.3's SCALAR target
# lacks a bf16 LoadU, and disabling it needs a baseline above it. HWY_WANT_AVX3_DL is needed for
# AVX3_DL (VNNI, BF16) to be generated at all. No -march: it would fight the per-target pragmas.
HWY_COPTS = [
    "-msse4.2",
    "-mpclmul",
    "-maes",
    "-DHWY_DISABLED_TARGETS=(HWY_SCALAR|HWY_SSSE3)",
    "-DHWY_WANT_AVX3_DL",
]
