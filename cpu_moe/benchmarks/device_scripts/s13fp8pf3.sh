#!/usr/bin/env bash
# Session 13: the kept rule (fp8's fp16 kernels read experts with 1-2 routes 4096 bytes ahead
# into L1 and 8192 into L2, others 2048 and 0; `def`) against the old defaults for every expert
# (`old`: explicit 2048 / 0, which turns the rule off) and the deep distances for every expert
# (`all`), side by side, 9 reps.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 300 $B --ab=fp8_block/256/1/1,fp8_block/128/1/1,fp8_block/256/8/1,fp8_block/128/8/1,fp8_block/256/16/1,fp8_block/128/16/1,fp8_block/256/32/1,fp8_block/128/32/1,fp8_block/256/64/1,fp8_block/128/64/1,bal:fp8_block/128/64 \
  --variant=def: --variant='old:MOE_CPU_PREFETCH_BYTES=2048;MOE_CPU_PREFETCH_L2_BYTES=0' \
  --variant='all:MOE_CPU_PREFETCH_BYTES=4096;MOE_CPU_PREFETCH_L2_BYTES=8192' --ab_reps=9 > $OUT/ab.txt 2>&1
echo ab rc=$? $(date)
