#!/usr/bin/env bash
# Session 9: larger work items for panel banks (the limit raised to 512 rows): pass-2 items of
# 512 rows, pass-1 items of 384 (two per expert at I = 768), both, against the defaults (256 / 256).
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 400 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy --ab=q4_0/256/1/1,mxfp4/256/8/1,nvfp4/128/16/1,bal:q4_0/128/64,q4_0/128/64/1,trace:q4_0/32 --ab_reps=7 \
  --variant=def: --variant=p2_512:MOE_CPU_PASS2_ROWS=512 --variant=p1_384:MOE_CPU_PASS1_ROWS=384 \
  --variant=both:MOE_CPU_PASS1_ROWS=384\;MOE_CPU_PASS2_ROWS=512 > $OUT/ab_items.txt 2>&1; echo ab rc=$? $(date)
