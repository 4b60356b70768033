#!/usr/bin/env bash
# Session 13: on real (skewed) routing, groups claimed busiest first (MOE_CPU_GROUP_ORDER=1, a
# temporary switch; default: expert order) and smaller pass-1 items (MOE_CPU_PASS1_ROWS=128
# against the 4-bit panels' 256), side by side, with uniform cases as a check.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 400 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy \
  --ab=trace:q4_0/64,trace:q4_0/32,trace:nvfp4/64,trace:bf16/64,trace:fp8_block/64,q4_0/128/64/1,bf16/256/64/1 \
  --variant=def: --variant='ord:MOE_CPU_GROUP_ORDER=1' --variant='p128:MOE_CPU_PASS1_ROWS=128' \
  --variant='ordp128:MOE_CPU_GROUP_ORDER=1;MOE_CPU_PASS1_ROWS=128' --ab_reps=7 > $OUT/ab.txt 2>&1
echo ab rc=$? $(date)
