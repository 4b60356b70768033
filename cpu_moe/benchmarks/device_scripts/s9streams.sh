#!/usr/bin/env bash
# Session 9: panel banks with four streams (two gate/up panel pairs, or four down panels) for
# experts with at most two routes (auto) against two streams, side by side.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
nproc > $OUT/nproc.txt; lscpu > $OUT/lscpu.txt
timeout 400 $B --ab=q4_0/256/1/1,nvfp4/256/8/1,mxfp4/128/8/1,q4_0/256/16/1,nvfp4/128/16/1,q4_0/128/64/1,trace:mxfp4/16 \
  --ab_reps=7 --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy \
  --variant=s2:MOE_CPU_ROW_STREAMS=2 --variant=auto: --variant=s4:MOE_CPU_ROW_STREAMS=4 \
  > $OUT/ab_streams.txt 2>&1; echo rc=$? $(date)
