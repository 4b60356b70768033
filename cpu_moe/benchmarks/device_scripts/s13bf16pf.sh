#!/usr/bin/env bash
# Session 13: does bf16 at 2-4 routes per expert want shallower prefetches (as fp8 does)?
# Defaults (4096 into L1, 8192 into L2) against 2048 / 8192, 2048 / none and 4096 / none, side by
# side, 9 reps.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 300 $B --ab=bf16/256/32/1,bf16/128/32/1,bf16/256/64/1,bf16/128/64/1,bal:bf16/128/64 \
  --variant=def: --variant='p2k:MOE_CPU_PREFETCH_BYTES=2048' --variant='p2k0:MOE_CPU_PREFETCH_BYTES=2048;MOE_CPU_PREFETCH_L2_BYTES=0' \
  --variant='p4k0:MOE_CPU_PREFETCH_L2_BYTES=0' --ab_reps=9 > $OUT/ab.txt 2>&1
echo ab rc=$? $(date)
