#!/usr/bin/env bash
# Session 14: bf16 at T=1 read 0.79-0.81 of DRAM in this session's sweep (0.87-0.94 in session
# 13's) though bf16's kernels did not change. Session 12's binary (b1609fd, cpu_moe_bench_s12)
# and HEAD's in alternating processes old new new old, 5 reps each, bf16 at T=1 and 8, q4_0
# at T=1.
set -u
OUT=$1
R=/tmp/moe_gpu/run
CASES="--ab=bf16/256/1/1 --ab=bf16/128/8/1 --ab=q4_0/256/1/1"
i=0
for b in cpu_moe_bench_s12 cpu_moe_bench cpu_moe_bench cpu_moe_bench_s12; do
  i=$((i+1))
  timeout 120 $R $b --probe_rounds=2 --ab_reps=5 $CASES --variant=def: > $OUT/oldnew_${i}_$b.txt 2>&1
  echo "$i $b rc=$?"
done
grep -H "ms_per_step" $OUT/oldnew_*.txt
