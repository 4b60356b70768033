#!/usr/bin/env bash
# Session 12, the kept code (1e996db): the full BM_CpuMoe sweep with the cache-hot rates of all 16
# workers in the same call (s11sweep2.sh's recipe).
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
lscpu > $OUT/lscpu.txt 2>&1
/tmp/moe_gpu/run membw_probe 1.25 3 > $OUT/membw_before.txt 2>&1
timeout 420 $B --benchmark_filter='BM_CpuMoe/' --benchmark_repetitions=3 --benchmark_format=json --benchmark_out=$OUT/sweep.json --benchmark_out_format=json > /dev/null 2>&1; echo sweep rc=$? $(date)
timeout 60 $B --benchmark_filter='BM_CpuMoeHot/' --benchmark_repetitions=3 --benchmark_report_aggregates_only=true --benchmark_format=json --benchmark_out=$OUT/hot16.json --benchmark_out_format=json > /dev/null 2>&1; echo hot rc=$? $(date)
/tmp/moe_gpu/run membw_probe 1.25 3 > $OUT/membw_after.txt 2>&1
