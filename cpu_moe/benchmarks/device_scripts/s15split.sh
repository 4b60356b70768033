#!/usr/bin/env bash
# Session 15: a T=1 step loses about 10% to its size (the last items end 13-23 us after the
# first worker runs out of work, session 10). MOE_CPU_P2_SPLIT=1 (a temporary switch) runs the
# pass-2 items of the last groups, the last ~2 x workers items of a call, as two halves each.
# Side by side, two processes with the variants' order swapped.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
CASES="--ab=bf16/256/1/1,bf16/128/1/1,q4_0/256/1/1,q4_0/128/1/1,fp8_block/128/1/1,nvfp4/128/1/1,mxfp4/128/1/1,q4_0/256/8/1,bf16/128/8/1,q4_0/128/64/1"
timeout 280 $B --probe_rounds=2 $CASES --variant=auto: --variant=split:MOE_CPU_P2_SPLIT=1 \
  --ab_reps=7 > $OUT/ab1.txt 2>&1
echo ab1 rc=$? $(date)
timeout 280 $B --probe_rounds=2 $CASES --variant=split:MOE_CPU_P2_SPLIT=1 --variant=auto: \
  --ab_reps=7 > $OUT/ab2.txt 2>&1
echo ab2 rc=$? $(date)
grep -h "case\|ms_per" $OUT/ab1.txt $OUT/ab2.txt
