#!/usr/bin/env bash
# Session 11 (commit f9c2e45, the branch-free inline-scale panels of 2934973): dedup side by side (uniform and the real trace), and the cache-hot
# rates with all 16 workers and with one.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 250 $B --benchmark_filter='BM_CpuMoeSpeedup/' --benchmark_repetitions=3 --benchmark_format=json --benchmark_out=$OUT/speedup.json --benchmark_out_format=json > $OUT/speedup.txt 2>&1; echo speedup rc=$? $(date)
timeout 150 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy --benchmark_filter='BM_CpuMoeTrace/' --benchmark_repetitions=3 --benchmark_format=json --benchmark_out=$OUT/trace.json --benchmark_out_format=json > $OUT/trace.txt 2>&1; echo trace rc=$? $(date)
for th in 0 1; do timeout 90 $B --threads=$th --benchmark_filter='BM_CpuMoeHot/' --benchmark_repetitions=3 --benchmark_report_aggregates_only=true --benchmark_format=json --benchmark_out=$OUT/hot_t$th.json --benchmark_out_format=json > $OUT/hot_t$th.txt 2>&1; echo hot $th rc=$? $(date); done
