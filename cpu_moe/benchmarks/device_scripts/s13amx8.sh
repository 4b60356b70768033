#!/usr/bin/env bash
# Session 13: 4-bit panels through AMX int8 tiles (PanelAmx, MOE_CPU_AMX_INT8_MIN_ROUTES) against
# the vpdpbusd kernels: cache-hot rates with the tiles off and for every expert, then steps side
# by side at 1 / 4 / 8 / 16 routes per expert (bal:), uniform T=64 and the real trace, with the
# tiles from 4, 8 and 12 routes.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
for v in 0 1 0 1; do
  MOE_CPU_AMX_INT8_MIN_ROUTES=$v timeout 40 $B --benchmark_filter='BM_CpuMoeHot/(q4_0|nvfp4)/' --benchmark_repetitions=3 \
    --benchmark_report_aggregates_only=true >> $OUT/hot_$v.txt 2>&1
  echo hot $v rc=$? $(date)
done
timeout 250 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy \
  --ab=bal:q4_0/128/16,bal:q4_0/128/64,bal:q4_0/128/128,bal:q4_0/128/256,q4_0/128/64/1,trace:q4_0/64,bal:nvfp4/128/128,trace:nvfp4/64 \
  --variant=def: --variant='a4:MOE_CPU_AMX_INT8_MIN_ROUTES=4' --variant='a8:MOE_CPU_AMX_INT8_MIN_ROUTES=8' \
  --variant='a12:MOE_CPU_AMX_INT8_MIN_ROUTES=12' --ab_reps=5 > $OUT/ab.txt 2>&1
echo ab rc=$? $(date)
