#!/usr/bin/env bash
# Session 10: panels with their scales inline (Layout::kPanelsInline: one sequential stream per
# panel, groups of blocks each followed by their scales' 64-byte line) against Layout::kPanels
# (each panel's scales after all its codes: two streams per panel), side by side, then the
# cache-hot rates of both layouts.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 420 $B --ab=q4_0/256/1/1,q4_0/256/8/1,mxfp4/256/16/1,nvfp4/128/16/1,bal:q4_0/128/64,q4_0/128/64/1,mxfp4/128/32/1,nvfp4/256/64/1 --ab_reps=7 \
  --variant=panels:MOE_BENCH_LAYOUT=panels --variant=inline:MOE_BENCH_LAYOUT=inline > $OUT/ab_inline.txt 2>&1; echo ab rc=$? $(date)
for L in panels inline; do
  timeout 60 $B --layout=$L --benchmark_filter='BM_CpuMoeHot/q4_0/' --benchmark_repetitions=3 --benchmark_report_aggregates_only=true --benchmark_format=json > $OUT/hot_$L.json 2>/dev/null; echo hot $L rc=$?
done
