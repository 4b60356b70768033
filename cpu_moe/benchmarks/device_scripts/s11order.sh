#!/usr/bin/env bash
# Session 11 A/B (temporary code, not committed): pass-2 items claimed H-block-major
# (MOE_CPU_P2_ORDER=1: concurrent items read different experts) against group-major, with the
# passes overlapped (default) and in separate fork-joins (MOE_CPU_OVERLAP=0).
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 150 $B --ab=bal:bf16/128/64,bal:q4_0/128/64,q4_0/128/64/1 --variant=def: --variant=ord:MOE_CPU_P2_ORDER=1 \
  --variant=sep:MOE_CPU_OVERLAP=0 --variant=seport:MOE_CPU_OVERLAP=0\;MOE_CPU_P2_ORDER=1 --ab_reps=5 > $OUT/order.txt 2>&1
echo order rc=$? $(date)
