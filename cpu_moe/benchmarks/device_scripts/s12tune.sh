#!/usr/bin/env bash
# Session 12: fp8_block's item and prefetch settings with the fp16 kernels, side by side:
# pass-1 rows 128 / 256 (default 64), and with 128 rows an L2 prefetch stream 8192 bytes ahead
# or an L1 prefetch 4096 bytes ahead (default 2048, no L2 stream).
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 300 $B --ab=fp8_block/128/1/1,fp8_block/256/8/1,fp8_block/256/32/1,fp8_block/128/64/1,bal:fp8_block/128/64 \
  --variant=def: --variant=p128:MOE_CPU_PASS1_ROWS=128 --variant=p256:MOE_CPU_PASS1_ROWS=256 \
  --variant='p128l2:MOE_CPU_PASS1_ROWS=128;MOE_CPU_PREFETCH_L2_BYTES=8192' \
  --variant='p128pf4k:MOE_CPU_PASS1_ROWS=128;MOE_CPU_PREFETCH_BYTES=4096' --ab_reps=7 > $OUT/tune.txt 2>&1
echo tune rc=$? $(date)
