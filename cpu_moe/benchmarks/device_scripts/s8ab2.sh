#!/usr/bin/env bash
# Session 8: panel banks' tuning side by side (defaults now: L1 1024 + L2 8192 ahead).
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 300 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy --ab=q4_0/256/1/1,nvfp4/128/8/1,mxfp4/256/16/1,q4_0/128/64/1,trace:mxfp4/32 --ab_reps=7 \
  --variant=row:MOE_BENCH_LAYOUT=row --variant=pan:MOE_BENCH_LAYOUT=panels \
  --variant=pan_pf2k:MOE_BENCH_LAYOUT=panels\;MOE_CPU_PREFETCH_BYTES=2048 \
  --variant=pan_l2_16k:MOE_BENCH_LAYOUT=panels\;MOE_CPU_PREFETCH_L2_BYTES=16384 \
  --variant=pan_p2_128:MOE_BENCH_LAYOUT=panels\;MOE_CPU_PASS2_ROWS=128 \
  --variant=pan_p1_64:MOE_BENCH_LAYOUT=panels\;MOE_CPU_PASS1_ROWS=64 > $OUT/ab2.txt 2>&1; echo ab rc=$? $(date)
