#!/usr/bin/env bash
# Session 11: pass 2 keeps less of the ideal than pass 1 at the balance point (tuning record §4).
# Does its item size matter there? MOE_CPU_PASS2_ROWS 128 / 256 (default) / 512, side by side.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 200 $B --ab=bal:q4_0/128/64,q4_0/128/64/1,bal:bf16/128/64,bal:nvfp4/128/64 --variant=def: \
  --variant=p2r128:MOE_CPU_PASS2_ROWS=128 --variant=p2r512:MOE_CPU_PASS2_ROWS=512 --ab_reps=7 > $OUT/p2rows.txt 2>&1
echo p2rows rc=$? $(date)
