#!/usr/bin/env bash
# Session 11 (commit 26b6768, the kernels of f9c2e45): session 9's balance-point check again with
# the inline-scale panels. overlap_probe (a streaming loop with W vpdpbusd per line), then the
# library with every expert at exactly 8T/E routes (bal:) beside uniform routing, and the
# cache-hot rates of the same grant.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 100 /tmp/moe_gpu/run overlap_probe 16 2 > $OUT/overlap.txt 2>&1; echo overlap rc=$? $(date)
timeout 200 $B --ab=bal:q4_0/128/16,bal:q4_0/128/64,q4_0/128/64/1,bal:q4_0/128/128,bal:bf16/128/64 --ab_reps=5 > $OUT/bal.txt 2>&1; echo bal rc=$? $(date)
timeout 60 $B --benchmark_filter='BM_CpuMoeHot/(q4_0|bf16)/' --benchmark_repetitions=3 --benchmark_report_aggregates_only=true --benchmark_format=json > $OUT/hot16.json 2>/dev/null; echo hot rc=$? $(date)
