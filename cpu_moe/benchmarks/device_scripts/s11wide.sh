#!/usr/bin/env bash
# Session 11 A/B (temporary code, not committed as a default): PanelDotWide, which decodes each
# panel block once for all of an expert's routes (accumulators in memory), against PanelDotMany
# (a decode per group of 4 routes), for experts with at least MOE_CPU_PANEL_WIDE_MIN routes
# (1000 = off). Side by side in DRAM (round $2), then the cache-hot rates per variant.
set -u
OUT=$1
R=${2:-1}
B="/tmp/moe_gpu/run cpu_moe_bench"
CASES='trace:q4_0/64,trace:nvfp4/64,trace:mxfp4/32,q4_0/128/64/1,nvfp4/128/64/1,mxfp4/256/64/1,q4_0/128/32/1,bal:q4_0/128/128'
for r in $R; do
  timeout 300 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy --ab=$CASES --variant=def:MOE_CPU_PANEL_WIDE_MIN=1000 \
    --variant=wide5:MOE_CPU_PANEL_WIDE_MIN=5 --variant=wide3:MOE_CPU_PANEL_WIDE_MIN=3 --ab_reps=7 > $OUT/ab_$r.txt 2>&1
  echo ab $r rc=$? $(date)
done
i=0; for v in 1000 5 3 1000 5 3; do i=$((i+1))
  MOE_CPU_PANEL_WIDE_MIN=$v timeout 40 $B --benchmark_filter='BM_CpuMoeHot/(q4_0|nvfp4|mxfp4)/[48]/' --benchmark_repetitions=3 \
    --benchmark_report_aggregates_only=true --benchmark_format=json > $OUT/hot_${i}_$v.json 2>/dev/null
  echo hot $v rc=$? $(date)
done
