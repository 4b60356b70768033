#!/usr/bin/env bash
# Session 8, final code: the 4-bit formats' sweep and side-by-side speedups again (panels,
# vpermb fp4 decode, 256-row pass-1 items).
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 240 $B --benchmark_filter='BM_CpuMoe/(q4_0|nvfp4|mxfp4)/' --benchmark_repetitions=3 --benchmark_format=json --benchmark_out=$OUT/sweep4.json --benchmark_out_format=json > $OUT/sweep4.txt 2>&1; echo sweep rc=$? $(date)
timeout 150 $B --benchmark_filter='BM_CpuMoeSpeedup/(q4_0|nvfp4|mxfp4)/' --benchmark_repetitions=3 --benchmark_format=json --benchmark_out=$OUT/speedup4.json --benchmark_out_format=json > $OUT/speedup4.txt 2>&1; echo speedup rc=$? $(date)
