#!/usr/bin/env bash
# Session 9 (commit 83a5d5f): fp8's arithmetic decode (MOE_CPU_FP8_ARITH=1) against the tables, all
# 16 workers, side by side; then the cache-hot fp8 rates both ways.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 300 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy --ab=fp8_block/256/1/1,fp8_block/128/1/1,fp8_block/256/8/1,fp8_block/128/16/1,fp8_block/256/64/1,trace:fp8_block/32 --ab_reps=9 \
  --variant=table: --variant=arith:MOE_CPU_FP8_ARITH=1 > $OUT/ab_fp8.txt 2>&1; echo ab rc=$? $(date)
for v in 0 1; do MOE_CPU_FP8_ARITH=$v timeout 60 $B --benchmark_filter='BM_CpuMoeHot/fp8' --benchmark_repetitions=3 --benchmark_report_aggregates_only=true --benchmark_format=json > $OUT/hot_fp8_arith$v.json 2>/dev/null; echo hot $v rc=$?; done
