#!/usr/bin/env bash
# Session 12: fp8 through AVX512-FP16 (Options::fp8_fp16, MOE_CPU_FP8_FP16) against the
# vdpbf16ps kernels, side by side: cache-hot rates with AMX on and off, steps at T=1-64 and on
# the recorded trace, and AMX thresholds with the fp16 kernels below them.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
TR=.gpu/qwen3_30b_a3b_top6_expert_ids.npy
for v in 1 0; do
  for amx in 1 0; do
    MOE_CPU_FP8_FP16=$v MOE_CPU_AMX=$amx timeout 40 $B --benchmark_filter='BM_CpuMoeHot/fp8_block/' \
      --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
      --benchmark_format=json > $OUT/hot_fp16$v.amx$amx.json 2>/dev/null
    echo hot fp16=$v amx=$amx rc=$? $(date)
  done
done
timeout 240 $B --trace=$TR --ab=fp8_block/128/1/1,fp8_block/256/8/1,fp8_block/128/16/1,fp8_block/256/32/1,fp8_block/128/64/1,fp8_block/256/64/1,trace:fp8_block/64 \
  --variant=f16: --variant=bf16dot:MOE_CPU_FP8_FP16=0 --ab_reps=5 > $OUT/ab.txt 2>&1
echo ab rc=$? $(date)
timeout 200 $B --trace=$TR --ab=fp8_block/128/64/1,trace:fp8_block/64,bal:fp8_block/128/64 \
  --variant=amx5: --variant=amx8:MOE_CPU_AMX_MIN_ROUTES=8 --variant=amx12:MOE_CPU_AMX_MIN_ROUTES=12 \
  --variant=noamx:MOE_CPU_AMX=0 --ab_reps=5 > $OUT/amx.txt 2>&1
echo amx rc=$? $(date)
