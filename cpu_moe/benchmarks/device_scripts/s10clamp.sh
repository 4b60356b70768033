#!/usr/bin/env bash
# Session 10: inline-scale panels with their prefetches stopped at the end of each stream
# (default) and running on past it (MOE_CPU_PANEL_PF_CLAMP=0, a temporary switch), against
# Layout::kPanels, side by side.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 500 $B --ab=q4_0/256/1/1,q4_0/256/8/1,mxfp4/256/16/1,nvfp4/128/16/1,bal:q4_0/128/64,q4_0/128/64/1,mxfp4/128/32/1,nvfp4/256/64/1 --ab_reps=7 \
  --variant=panels:MOE_BENCH_LAYOUT=panels --variant=inline:MOE_BENCH_LAYOUT=inline \
  --variant=noclamp:MOE_BENCH_LAYOUT=inline\;MOE_CPU_PANEL_PF_CLAMP=0 > $OUT/ab_clamp.txt 2>&1; echo ab rc=$? $(date)
