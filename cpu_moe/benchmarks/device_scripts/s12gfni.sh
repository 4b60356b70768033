#!/usr/bin/env bash
# Session 12: fp8's fp16 kernels with the GFNI e4m3 decode (new bundle, /tmp/new/moe_gpu) against the
# shift-and-mask decode (the previous bundle, /tmp/prev/moe_gpu: the same code otherwise), processes
# alternated prev new new prev: cache-hot rates (AMX off, so 8 routes run the fp16 kernels too)
# and steps; and fp16_dot_probe (one core) with both decodes.
set -u
OUT=$1
/tmp/new/moe_gpu/run fp16_dot_probe > $OUT/probe.txt 2>&1
i=0
for b in prev new new prev; do
  i=$((i + 1))
  B="/tmp/$b/moe_gpu/run cpu_moe_bench"
  MOE_CPU_AMX=0 timeout 40 $B --benchmark_filter='BM_CpuMoeHot/fp8_block/' --benchmark_repetitions=3 \
    --benchmark_report_aggregates_only=true --benchmark_format=json > $OUT/hot_${i}_$b.json 2>/dev/null
  timeout 100 $B --ab=fp8_block/128/1/1,fp8_block/256/8/1,fp8_block/256/32/1,fp8_block/128/64/1,bal:fp8_block/128/64 \
    --variant=def: --ab_reps=5 > $OUT/ab_${i}_$b.txt 2>&1
  echo $i $b rc=$? $(date)
done
