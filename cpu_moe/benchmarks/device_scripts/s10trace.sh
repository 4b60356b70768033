#!/usr/bin/env bash
# Session 10: item timelines (temporary MOE_CPU_ITEM_TRACE: start and end of every work item,
# and its worker, for calls 300-305 of a process) of a few cases, one process each.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
for c in q4_0/256/1/1 q4_0/128/8/1 bf16/256/1/1 mxfp4/256/16/1 q4_0/128/64/1 bf16/128/8/1; do
  n=$(echo $c | tr '/' '_')
  timeout 100 $B --ab=$c --ab_reps=9 --variant=t:MOE_CPU_ITEM_TRACE=$OUT/$n > $OUT/log_$n.txt 2>&1; echo $c rc=$?
done
cd $OUT && tar czf traces.tgz *_1.30* *_1.txt 2>/dev/null; rm -f $OUT/*.30?; ls
