#!/usr/bin/env bash
# Session 9: the fp8 decode probe on one core (k = 2048 and 768), then the library's cache-hot
# rates with all 16 workers and with one (BM_CpuMoeHot; 4-bit formats in panels).
set -u
OUT=$1
R=/tmp/moe_gpu/run
for k in 2048 768; do
  timeout 120 $R fp8_decode_probe $k 200 > $OUT/fp8_probe_k$k.txt 2>&1; echo probe k=$k rc=$?
done
timeout 200 $R cpu_moe_bench --benchmark_filter='BM_CpuMoeHot/' --benchmark_repetitions=3 \
  --benchmark_report_aggregates_only=true --benchmark_format=json > $OUT/hot16.json 2> $OUT/hot16.err; echo hot16 rc=$?
timeout 200 $R cpu_moe_bench --threads=1 --benchmark_filter='BM_CpuMoeHot/' --benchmark_repetitions=3 \
  --benchmark_report_aggregates_only=true --benchmark_format=json > $OUT/hot1.json 2> $OUT/hot1.err; echo hot1 rc=$?
