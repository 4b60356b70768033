#!/usr/bin/env bash
# Session 11 A/B (temporary code, not committed): at a work item's start, also prefetch each
# panel stream's lines from the L1 distance up to the L2 distance into L2 (MOE_CPU_PF_RAMP: 1 pass
# 2, 3 both passes), so the stream does not start with only 2 KiB prefetched. Two processes.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
for r in 1 2; do
  timeout 150 $B --ab=bal:q4_0/128/64,q4_0/128/64/1,q4_0/128/16/1,nvfp4/256/32/1,mxfp4/128/32/1,q4_0/256/1/1 \
    --variant=def:MOE_CPU_PF_RAMP=0 --variant=r2:MOE_CPU_PF_RAMP=1 --variant=r12:MOE_CPU_PF_RAMP=3 --ab_reps=7 > $OUT/ramp_$r.txt 2>&1
  echo ramp $r rc=$? $(date)
done
