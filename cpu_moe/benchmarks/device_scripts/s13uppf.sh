#!/usr/bin/env bash
# Session 13: fp8's fp16 pass 1 reads each 128-row block's gate rows (two streams), then its up
# rows (two new streams, cold). Temporary switch MOE_CPU_F16_UPPF=<bytes>: before the gate rows,
# the first <bytes> of both up streams are prefetched into L2. Side by side.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 300 $B --ab=fp8_block/256/1/1,fp8_block/128/1/1,fp8_block/256/8/1,fp8_block/128/16/1,fp8_block/256/32/1,fp8_block/128/64/1 \
  --variant=def: --variant='u2k:MOE_CPU_F16_UPPF=2048' --variant='u4k:MOE_CPU_F16_UPPF=4096' --ab_reps=7 > $OUT/ab.txt 2>&1
echo ab rc=$? $(date)
