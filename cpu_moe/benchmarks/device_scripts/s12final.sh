#!/usr/bin/env bash
# Session 12, the kept code (fp16 kernels, 128-row pass-1 items for them): fp8_block's sweep and
# dedup speedups, every format's cache-hot rates, and the fp16 kernels against the vdpbf16ps ones
# (MOE_CPU_FP8_FP16=0, each with its own default item size) side by side.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
/tmp/moe_gpu/run membw_probe 1.25 3 > $OUT/membw_before.txt 2>&1
timeout 200 $B --benchmark_filter='BM_CpuMoe/fp8_block/' --benchmark_repetitions=3 --benchmark_format=json --benchmark_out=$OUT/sweep_fp8.json --benchmark_out_format=json > /dev/null 2>&1; echo sweep rc=$? $(date)
timeout 120 $B --benchmark_filter='BM_CpuMoeSpeedup/fp8_block/' --benchmark_repetitions=3 --benchmark_format=json --benchmark_out=$OUT/speedup_fp8.json --benchmark_out_format=json > /dev/null 2>&1; echo speedup rc=$? $(date)
timeout 60 $B --benchmark_filter='BM_CpuMoeHot/' --benchmark_repetitions=3 --benchmark_report_aggregates_only=true --benchmark_format=json --benchmark_out=$OUT/hot16.json --benchmark_out_format=json > /dev/null 2>&1; echo hot rc=$? $(date)
timeout 150 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy --ab=fp8_block/128/1/1,fp8_block/256/8/1,fp8_block/128/16/1,fp8_block/256/32/1,fp8_block/128/64/1,fp8_block/256/64/1,bal:fp8_block/128/64,trace:fp8_block/64 \
  --variant=fp16: --variant=bf16dot:MOE_CPU_FP8_FP16=0 --ab_reps=5 > $OUT/ab.txt 2>&1; echo ab rc=$? $(date)
/tmp/moe_gpu/run membw_probe 1.25 3 > $OUT/membw_after.txt 2>&1
