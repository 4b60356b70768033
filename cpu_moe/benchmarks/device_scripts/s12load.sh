#!/usr/bin/env bash
# Session 12: the fp8 kernels after the shared code load (LoadFp8Codes) against the bundle before
# it (cb637e6), processes alternated prev new new prev: cache-hot rates of the fp16 and the
# vdpbf16ps kernels (AMX off), to catch a codegen change (session 11 saw one from a shared helper).
set -u
OUT=$1
i=0
for b in prev new new prev; do
  i=$((i + 1))
  B="/tmp/$b/moe_gpu/run cpu_moe_bench"
  for v in 1 0; do
    MOE_CPU_AMX=0 MOE_CPU_FP8_FP16=$v timeout 40 $B --benchmark_filter='BM_CpuMoeHot/fp8_block/' \
      --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
      --benchmark_format=json > $OUT/hot_${i}_${b}_fp16$v.json 2>/dev/null
  done
  echo $i $b $(date)
done
