#!/usr/bin/env bash
# Session 13: s13fp8pf.sh's best variant (fp8 with 4096 bytes into L1 and 8192 into L2) against
# the defaults again, two processes, more cases, 9 reps each.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
for run in 1 2; do
  timeout 250 $B --ab=fp8_block/256/1/1,fp8_block/128/1/1,fp8_block/256/8/1,fp8_block/128/8/1,fp8_block/256/16/1,fp8_block/128/16/1,fp8_block/256/32/1,fp8_block/128/32/1,fp8_block/256/64/1,fp8_block/128/64/1,bal:fp8_block/128/64 \
    --variant=def: --variant='l4k8k:MOE_CPU_PREFETCH_BYTES=4096;MOE_CPU_PREFETCH_L2_BYTES=8192' --ab_reps=9 > $OUT/ab_$run.txt 2>&1
  echo ab $run rc=$? $(date)
done
