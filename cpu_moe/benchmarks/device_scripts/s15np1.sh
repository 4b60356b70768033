#!/usr/bin/env bash
# Session 15: the 4-bit panel kernels run an expert with more than 4 routes as several two-panel
# PanelDot calls of 4 routes each, decoding every block once per call; at 8 routes per expert
# the library streamed 81 GB/s against the instruction-mix probe's 108-111 (s15mimic.sh).
# MOE_CPU_PANEL_NP1=1 (a temporary switch) takes such experts one panel at a time with up to 8
# routes per decode. Side by side, two processes with the variants' order swapped.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
CASES="--ab=bal:q4_0/128/128,bal:q4_0/128/192,bal:q4_0/128/96,q4_0/128/64/1,nvfp4/128/64/1,mxfp4/128/64/1,trace:q4_0/64,trace:nvfp4/64,trace:q4_0/32,bal:q4_0/128/64"
timeout 280 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy --probe_rounds=2 $CASES \
  --variant=auto: --variant=np1:MOE_CPU_PANEL_NP1=1 --ab_reps=5 > $OUT/ab1.txt 2>&1
echo ab1 rc=$? $(date)
timeout 280 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy --probe_rounds=2 $CASES \
  --variant=np1:MOE_CPU_PANEL_NP1=1 --variant=auto: --ab_reps=5 > $OUT/ab2.txt 2>&1
echo ab2 rc=$? $(date)
grep -h "case\|ms_per" $OUT/ab1.txt $OUT/ab2.txt
