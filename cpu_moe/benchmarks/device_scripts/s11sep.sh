#!/usr/bin/env bash
# Session 11: the passes' own fractions at the balance point, with the passes in separate
# fork-joins (MOE_CPU_OVERLAP=0), where each pass's time covers only its own items.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 150 $B --ab=bal:q4_0/128/64,bal:bf16/128/64,q4_0/128/64/1 --variant=def: --variant=sep:MOE_CPU_OVERLAP=0 --ab_reps=7 > $OUT/sep.txt 2>&1
echo sep rc=$? $(date)
timeout 40 $B --benchmark_filter='BM_CpuMoeHot/(q4_0|bf16)/4/' --benchmark_repetitions=3 --benchmark_report_aggregates_only=true --benchmark_format=json > $OUT/hot16.json 2>/dev/null
