#!/usr/bin/env bash
# Session 12: session 11's open lead, pass 2's activations (written by other cores' pass-1 items)
# prefetched at each pass-2 item's start, behind the temporary MOE_CPU_P2_ACTPF (4-bit panels and
# fp8's fp16 kernels), side by side with the default, with the grant's cache-hot rates.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 300 $B --ab=bal:q4_0/128/64,q4_0/128/64/1,q4_0/256/32/1,bal:nvfp4/128/64,fp8_block/128/64/1,bal:fp8_block/128/64 \
  --variant=def: --variant=apf:MOE_CPU_P2_ACTPF=1 --ab_reps=7 > $OUT/actpf.txt 2>&1
echo actpf rc=$? $(date)
timeout 40 $B --benchmark_filter='BM_CpuMoeHot/(q4_0|fp8_block)/4/' --benchmark_repetitions=3 --benchmark_report_aggregates_only=true --benchmark_format=json > $OUT/hot16.json 2>/dev/null
