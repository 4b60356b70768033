#!/usr/bin/env bash
# Session 8 final: dedup side by side (uniform and the real trace), and one core's hot rates.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 250 $B --benchmark_filter='BM_CpuMoeSpeedup/' --benchmark_repetitions=3 --benchmark_format=json --benchmark_out=$OUT/speedup.json --benchmark_out_format=json > $OUT/speedup.txt 2>&1; echo speedup rc=$? $(date)
timeout 150 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy --benchmark_filter='BM_CpuMoeTrace/' --benchmark_repetitions=3 --benchmark_format=json --benchmark_out=$OUT/trace.json --benchmark_out_format=json > $OUT/trace.txt 2>&1; echo trace rc=$? $(date)
for L in panels row; do timeout 60 $B --layout=$L --threads=1 --benchmark_filter='BM_CpuMoeHot/(q4_0|mxfp4|nvfp4)/' --benchmark_repetitions=3 --benchmark_report_aggregates_only=true --benchmark_format=json --benchmark_out=$OUT/hot_$L.json --benchmark_out_format=json > $OUT/hot_$L.txt 2>&1; done; echo hot $(date)
