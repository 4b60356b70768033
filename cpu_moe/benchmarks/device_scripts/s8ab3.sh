#!/usr/bin/env bash
# Session 8: panel banks' prefetch distances and pass-1 item size, side by side (final kernels).
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 300 $B --ab=q4_0/256/1/1,mxfp4/128/8/1,nvfp4/256/16/1,q4_0/128/64/1 --ab_reps=9 \
  --variant=def: --variant=pf4k:MOE_CPU_PREFETCH_BYTES=4096 \
  --variant=pf4k_l2_12k:MOE_CPU_PREFETCH_BYTES=4096\;MOE_CPU_PREFETCH_L2_BYTES=12288 \
  --variant=l2_4k:MOE_CPU_PREFETCH_L2_BYTES=4096 \
  --variant=p1_256:MOE_CPU_PASS1_ROWS=256 > $OUT/ab3.txt 2>&1; echo rc=$? $(date)
