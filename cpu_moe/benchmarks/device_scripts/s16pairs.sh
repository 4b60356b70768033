#!/usr/bin/env bash
# Session 16: the panel kernels with two routes' chains interleaved in program order
# (MOE_CPU_PANEL_PAIRS=1, a temporary switch read per call), which overlap_probe's P4i row ran
# 3-7% faster cache-hot than the kernel's route-by-route order (s16chains.sh). Side by side,
# twice (order reversed), then cache-hot rates 0 1 1 0.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
CASES="--ab=q4_0/128/16/1,q4_0/128/64/1,bal:q4_0/128/64,bal:q4_0/128/128,trace:q4_0/64,nvfp4/128/64/1,mxfp4/128/64/1,trace:mxfp4/64"
timeout 240 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy --probe_rounds=2 $CASES --ab_reps=5 \
  --variant=route:MOE_CPU_PANEL_PAIRS=0 --variant=pairs:MOE_CPU_PANEL_PAIRS=1 > $OUT/ab1.txt 2>&1
echo ab1 rc=$? $(date)
timeout 240 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy --probe_rounds=2 $CASES --ab_reps=5 \
  --variant=pairs:MOE_CPU_PANEL_PAIRS=1 --variant=route:MOE_CPU_PANEL_PAIRS=0 > $OUT/ab2.txt 2>&1
echo ab2 rc=$? $(date)
grep -h "case\|ms_per" $OUT/ab1.txt $OUT/ab2.txt
i=0
for v in 0 1 1 0; do
  i=$((i + 1))
  MOE_CPU_PANEL_PAIRS=$v timeout 60 $B --benchmark_filter='BM_CpuMoeHot/(q4_0|mxfp4)/' --benchmark_repetitions=2 \
    --benchmark_report_aggregates_only=true > $OUT/hot_${i}_v$v.txt 2>&1
  echo hot $i v$v rc=$?; grep median $OUT/hot_${i}_v$v.txt | sed 's/min_time:0.300.real_time_median//' | awk '{print $1, $8, $11, $12}'
done
