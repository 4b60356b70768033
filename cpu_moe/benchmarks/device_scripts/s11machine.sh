#!/usr/bin/env bash
# Session 11: what kind of host this grant is. lscpu, steal time (vmstat) while the cache-hot
# benchmark runs on all 16 workers and on one, and the plain DRAM probe.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
lscpu > $OUT/lscpu.txt 2>&1
grep MHz /proc/cpuinfo > $OUT/mhz_before.txt
/tmp/moe_gpu/run membw_probe 1.25 3 > $OUT/membw.txt 2>&1
(vmstat 1 40 > $OUT/vmstat.txt 2>&1 &)
for th in 0 1; do
  timeout 60 $B --threads=$th --benchmark_filter='BM_CpuMoeHot/(bf16|q4_0)/' --benchmark_repetitions=3 \
    --benchmark_report_aggregates_only=true --benchmark_format=json > $OUT/hot_t$th.json 2>/dev/null
  echo hot $th rc=$? $(date)
done
grep MHz /proc/cpuinfo > $OUT/mhz_after.txt
sleep 2
