#!/usr/bin/env bash
# Session 13: fp8's fp16 kernels with bf16's prefetch settings (4096 bytes into L1 and a second
# stream 8192 or 16384 bytes ahead into L2, both at once; session 12 tried each alone), side by
# side with the defaults (2048, no L2 stream).
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 300 $B --ab=fp8_block/256/1/1,fp8_block/256/8/1,fp8_block/128/8/1,fp8_block/128/16/1,fp8_block/256/32/1,fp8_block/128/64/1 \
  --variant=def: --variant='l4k8k:MOE_CPU_PREFETCH_BYTES=4096;MOE_CPU_PREFETCH_L2_BYTES=8192' \
  --variant='l4k16k:MOE_CPU_PREFETCH_BYTES=4096;MOE_CPU_PREFETCH_L2_BYTES=16384' \
  --variant='l2k16k:MOE_CPU_PREFETCH_L2_BYTES=16384' --ab_reps=7 > $OUT/ab.txt 2>&1
echo ab rc=$? $(date)
