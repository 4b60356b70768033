#!/usr/bin/env bash
# Session 8: panel kernel variants side by side (temporary MOE_CPU_EXP_PANEL: bit 0 vpermb fp4
# decode, bit 1 one int32 chain per route instead of two).
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 300 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy --ab=mxfp4/256/1/1,nvfp4/128/8/1,q4_0/128/64/1,mxfp4/128/64/1,trace:nvfp4/32 --ab_reps=7 \
  --variant=base:MOE_CPU_EXP_PANEL=0 --variant=vpermb:MOE_CPU_EXP_PANEL=1 --variant=chain1:MOE_CPU_EXP_PANEL=2 --variant=both:MOE_CPU_EXP_PANEL=3 > $OUT/exp.txt 2>&1; echo rc=$? $(date)
