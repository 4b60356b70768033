#!/usr/bin/env bash
# Session 10: with panels now one stream each (scales inline), do the panel defaults still hold?
# Four panel streams per item (MOE_CPU_ROW_STREAMS=4), L1 prefetch distance 1024 / 3072 (default
# 2048), L2 distance 4096 / 12288 (default 8192), side by side.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 500 $B --ab=q4_0/256/1/1,q4_0/128/8/1,mxfp4/256/16/1,nvfp4/128/16/1,q4_0/128/32/1,bal:q4_0/128/64 --ab_reps=7 \
  --variant=def: --variant=rs4:MOE_CPU_ROW_STREAMS=4 --variant=pf1k:MOE_CPU_PREFETCH_BYTES=1024 \
  --variant=pf3k:MOE_CPU_PREFETCH_BYTES=3072 --variant=l2_4k:MOE_CPU_PREFETCH_L2_BYTES=4096 \
  --variant=l2_12k:MOE_CPU_PREFETCH_L2_BYTES=12288 > $OUT/ab_tune.txt 2>&1; echo ab rc=$? $(date)
