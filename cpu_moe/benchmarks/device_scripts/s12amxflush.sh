#!/usr/bin/env bash
# Session 12 timing probe: fp8's AMX tiles without the C flush after every 128-column block
# (temporary MOE_CPU_AMX_NOFLUSH=1, wrong results: the block scales are not applied), to see what
# the flushes cost before building scaled activation tiles that would not need them.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
for v in 0 1; do
  MOE_CPU_AMX_NOFLUSH=$v timeout 40 $B --benchmark_filter='BM_CpuMoeHot/fp8_block/8/' --benchmark_repetitions=3 --benchmark_report_aggregates_only=true --benchmark_format=json > $OUT/hot8_noflush$v.json 2>/dev/null
  echo hot noflush=$v rc=$? $(date)
done
timeout 150 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy --ab=trace:fp8_block/64,fp8_block/128/64/1,trace:fp8_block/32 \
  --variant=def: --variant=noflush:MOE_CPU_AMX_NOFLUSH=1 --variant=noamx:MOE_CPU_AMX=0 --ab_reps=5 > $OUT/amxflush.txt 2>&1
echo ab rc=$? $(date)
