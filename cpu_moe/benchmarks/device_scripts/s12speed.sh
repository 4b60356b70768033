#!/usr/bin/env bash
# Session 12, the kept code (1e996db): dedup on and off side by side (BM_CpuMoeSpeedup), every
# format.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 300 $B --benchmark_filter='BM_CpuMoeSpeedup/' --benchmark_repetitions=3 --benchmark_format=json --benchmark_out=$OUT/speedup.json --benchmark_out_format=json > $OUT/speedup.txt 2>&1; echo speedup rc=$? $(date)
