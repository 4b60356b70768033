#!/usr/bin/env bash
# Session 12: fp8's fp16 kernels reading four rows at once (four weight streams) for experts with
# at most 2 routes, behind the temporary MOE_CPU_F16_STREAMS4, side by side with the default.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 200 $B --ab=fp8_block/128/1/1,fp8_block/256/1/1,fp8_block/256/8/1,fp8_block/256/16/1 \
  --variant=def: --variant=s4:MOE_CPU_F16_STREAMS4=1 --ab_reps=7 > $OUT/streams4.txt 2>&1
echo rc=$? $(date)
