#!/usr/bin/env bash
# Session 13: PanelDot variants (MOE_CPU_PANEL_V, a temporary switch): 1 converts each block's
# int32 sums to float by the magic-number trick (a seed of 0x4B400000 and a vsubps) instead of
# vcvtdq2ps, 2 takes q4_0's high nibbles by one GFNI affine transform instead of a shift and an
# AND, 3 both. Cache-hot rates in alternating processes, then steps side by side.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
for v in 0 1 3 0 1 3; do
  MOE_CPU_PANEL_V=$v timeout 40 $B --benchmark_filter='BM_CpuMoeHot/(q4_0|nvfp4|mxfp4)/' --benchmark_repetitions=3 \
    --benchmark_report_aggregates_only=true >> $OUT/hot_$v.txt 2>&1
  echo hot $v rc=$? $(date)
done
timeout 300 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy \
  --ab=bal:q4_0/128/64,q4_0/128/64/1,q4_0/256/64/1,q4_0/128/32/1,q4_0/128/8/1,trace:q4_0/64,nvfp4/128/64/1,nvfp4/128/32/1,mxfp4/128/64/1 \
  --variant=def: --variant='m:MOE_CPU_PANEL_V=1' --variant='g:MOE_CPU_PANEL_V=2' --variant='mg:MOE_CPU_PANEL_V=3' \
  --ab_reps=5 > $OUT/ab.txt 2>&1
echo ab rc=$? $(date)
