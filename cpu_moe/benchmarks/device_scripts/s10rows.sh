#!/usr/bin/env bash
# Session 10: at T=1-4 a step has 8-30 experts, and pass 1's 256-row items give only 24-90 items
# for 16 workers: smaller pass-1 (and pass-2) items, on both panel layouts, side by side.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 500 $B --ab=q4_0/256/1/1,q4_0/128/1/1,mxfp4/256/1/1,nvfp4/128/1/1,q4_0/256/4/1,mxfp4/128/4/1 --ab_reps=7 \
  --variant=panels:MOE_BENCH_LAYOUT=panels --variant=p1_128:MOE_BENCH_LAYOUT=panels\;MOE_CPU_PASS1_ROWS=128 \
  --variant=p1_64:MOE_BENCH_LAYOUT=panels\;MOE_CPU_PASS1_ROWS=64 \
  --variant=p12_128:MOE_BENCH_LAYOUT=panels\;MOE_CPU_PASS1_ROWS=128\;MOE_CPU_PASS2_ROWS=128 \
  --variant=inline:MOE_BENCH_LAYOUT=inline --variant=in_p1_128:MOE_BENCH_LAYOUT=inline\;MOE_CPU_PASS1_ROWS=128 \
  > $OUT/ab_rows.txt 2>&1; echo ab rc=$? $(date)
