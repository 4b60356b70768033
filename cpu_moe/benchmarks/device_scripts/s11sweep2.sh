#!/usr/bin/env bash
# Session 11, a later grant (commit 0c28622, the same kernels as f9c2e45): the BM_CpuMoe sweep
# again with the cache-hot rates of all 16 workers, to see how much the tally moves between grants.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
lscpu > $OUT/lscpu.txt 2>&1
/tmp/moe_gpu/run membw_probe 1.25 3 > $OUT/membw_before.txt 2>&1
timeout 420 $B --benchmark_filter='BM_CpuMoe/' --benchmark_repetitions=3 --benchmark_format=json --benchmark_out=$OUT/sweep.json --benchmark_out_format=json > /dev/null 2>&1; echo sweep rc=$? $(date)
timeout 60 $B --benchmark_filter='BM_CpuMoeHot/' --benchmark_repetitions=3 --benchmark_report_aggregates_only=true --benchmark_format=json --benchmark_out=$OUT/hot16.json --benchmark_out_format=json > /dev/null 2>&1; echo hot rc=$? $(date)
/tmp/moe_gpu/run membw_probe 1.25 3 > $OUT/membw_after.txt 2>&1
