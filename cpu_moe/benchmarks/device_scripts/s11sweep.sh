#!/usr/bin/env bash
# Session 11 (commit f9c2e45, the branch-free inline-scale panels of 2934973): the BM_CpuMoe sweep (every format; 4-bit formats in panels, the
# default), with the plain DRAM probe before and after.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
lscpu > $OUT/lscpu.txt 2>&1
/tmp/moe_gpu/run membw_probe 1.25 3 > $OUT/membw_before.txt 2>&1
timeout 520 $B --benchmark_filter='BM_CpuMoe/' --benchmark_repetitions=3 --benchmark_format=json --benchmark_out=$OUT/sweep.json --benchmark_out_format=json > $OUT/sweep.txt 2>&1; echo sweep rc=$? $(date)
/tmp/moe_gpu/run membw_probe 1.25 3 > $OUT/membw_after.txt 2>&1
