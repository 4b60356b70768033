#!/usr/bin/env bash
# Session 13: s13bf16pf.sh's candidates for bf16 at 4 routes per expert again (2048 into L1 with
# and without the 8192-byte L2 stream, against the defaults 4096 / 8192), two processes, 9 reps.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
for run in 1 2; do
  timeout 200 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy --ab=bf16/128/64/1,bal:bf16/128/64,trace:bf16/64 \
    --variant=def: --variant='p2k:MOE_CPU_PREFETCH_BYTES=2048' --variant='p2k0:MOE_CPU_PREFETCH_BYTES=2048;MOE_CPU_PREFETCH_L2_BYTES=0' \
    --ab_reps=9 > $OUT/ab_$run.txt 2>&1
  echo ab $run rc=$? $(date)
done
