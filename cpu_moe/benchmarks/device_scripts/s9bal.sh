#!/usr/bin/env bash
# Session 9: the kernels in DRAM with every expert at exactly r routes (bal:, r = 1, 4, 8) beside
# uniform random routing of the same T, then the cache-hot rates and the overlap probe in the
# same run: how far each is from min(DRAM, hot).
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 300 $B --ab=bal:q4_0/128/16,bal:q4_0/128/64,q4_0/128/64/1,bal:q4_0/128/128,bal:bf16/128/16,bal:bf16/128/64,bf16/128/64/1,bal:bf16/128/128 \
  --ab_reps=5 --variant=def:MOE_CPU_ONEDNN_MIN_TOKENS=0 > $OUT/ab_bal.txt 2>&1; echo ab rc=$? $(date)
timeout 100 $B --benchmark_filter='BM_CpuMoeHot/(q4_0|bf16)/' --benchmark_repetitions=3 --benchmark_report_aggregates_only=true --benchmark_format=json > $OUT/hot.json 2>/dev/null; echo hot rc=$?
timeout 60 /tmp/moe_gpu/run overlap_probe 16 2 > $OUT/overlap.txt 2>&1; echo overlap rc=$?
