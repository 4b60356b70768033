#!/usr/bin/env bash
# Session 10: when do the workers start a step? Per-call worker start / end times (temporary
# MOE_CPU_ITEM_TRACE, kept in memory, written at exit), with the pool's workers spinning with
# pause (default), without pause (MOE_POOL_NOPAUSE, temporary), or 2 ms (MOE_POOL_SPIN_US).
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
for v in def nopause spin2ms; do
  case $v in def) E="";; nopause) E="MOE_POOL_NOPAUSE=1;";; spin2ms) E="MOE_POOL_SPIN_US=2000;";; esac
  for c in q4_0/256/1/1 q4_0/128/8/1 bf16/256/1/1; do
    n=$(echo $c | tr '/' '_')_$v
    timeout 100 $B --ab=$c --ab_reps=5 --variant=t:${E}MOE_CPU_ITEM_TRACE=$OUT/$n > $OUT/log_$n.txt 2>&1; echo $c $v rc=$?
  done
done
timeout 200 $B --ab=q4_0/256/1/1,q4_0/128/8/1,bf16/256/1/1,mxfp4/256/16/1,q4_0/128/64/1 --ab_reps=7 \
  --variant=def: --variant=nopause:MOE_POOL_NOPAUSE=1 --variant=spin2ms:MOE_POOL_SPIN_US=2000 > $OUT/ab_wake.txt 2>&1; echo ab rc=$?
cd $OUT && tar czf wake.tgz *.calls *.items log_* && rm -f *.calls *.items log_*; ls
