#!/usr/bin/env bash
# Session 16: two cuts to the q4_0 panel kernel's instruction mix, behind a temporary switch
# (MOE_CPU_PANEL_V, read per call):
#   1: each route's two int32 chains start from the block's two -8 x code sums, broadcast from
#      memory, instead of their sum broadcast from a general register and a zero (one scalar
#      add and one port-5 broadcast fewer per route and panel);
#   2: the high nibbles by one GFNI affine (vgf2p8affineqb) instead of shift and mask;
#   3: both.
# Side by side, twice (two processes, order reversed), then cache-hot rates 0 3 3 0.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
CASES="--ab=q4_0/256/1/1,q4_0/128/8/1,q4_0/128/16/1,q4_0/256/32/1,q4_0/128/64/1,bal:q4_0/128/64,bal:q4_0/128/128,trace:q4_0/64"
timeout 240 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy --probe_rounds=2 $CASES --ab_reps=5 \
  --variant=v0:MOE_CPU_PANEL_V=0 --variant=v1:MOE_CPU_PANEL_V=1 --variant=v2:MOE_CPU_PANEL_V=2 \
  --variant=v3:MOE_CPU_PANEL_V=3 > $OUT/ab1.txt 2>&1
echo ab1 rc=$? $(date)
timeout 240 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy --probe_rounds=2 $CASES --ab_reps=5 \
  --variant=v3:MOE_CPU_PANEL_V=3 --variant=v2:MOE_CPU_PANEL_V=2 --variant=v1:MOE_CPU_PANEL_V=1 \
  --variant=v0:MOE_CPU_PANEL_V=0 > $OUT/ab2.txt 2>&1
echo ab2 rc=$? $(date)
grep -h "case\|ms_per" $OUT/ab1.txt $OUT/ab2.txt
i=0
for v in 0 3 3 0; do
  i=$((i + 1))
  MOE_CPU_PANEL_V=$v timeout 60 $B --benchmark_filter='BM_CpuMoeHot/q4_0/' --benchmark_repetitions=2 \
    --benchmark_report_aggregates_only=true > $OUT/hot_${i}_v$v.txt 2>&1
  echo hot $i v$v rc=$?; grep median $OUT/hot_${i}_v$v.txt
done
