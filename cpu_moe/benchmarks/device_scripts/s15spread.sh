#!/usr/bin/env bash
# Session 15: experts with more routes than one PanelDot call takes (NP = 2: more than 4) run
# several calls over the same panels, and only the first call's prefetches fetch new lines, so
# the stream idles during the others (the host's library streamed 81 GB/s at 8 routes per expert
# against its cache-hot 115 and the instruction-mix probe's 110). MOE_CPU_PANEL_PF_SPREAD=1 (a
# temporary switch) spreads each panel's L2 prefetches over all the calls. Side by side, twice
# (two processes, the variants' order swapped).
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
CASES="--ab=bal:q4_0/128/128,bal:q4_0/128/192,bal:q4_0/128/64,q4_0/128/64/1,nvfp4/128/64/1,mxfp4/128/64/1,trace:q4_0/64,trace:nvfp4/64"
timeout 280 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy --probe_rounds=2 $CASES \
  --variant=auto: --variant=spread:MOE_CPU_PANEL_PF_SPREAD=1 --ab_reps=5 > $OUT/ab1.txt 2>&1
echo ab1 rc=$? $(date)
timeout 280 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy --probe_rounds=2 $CASES \
  --variant=spread:MOE_CPU_PANEL_PF_SPREAD=1 --variant=auto: --ab_reps=5 > $OUT/ab2.txt 2>&1
echo ab2 rc=$? $(date)
grep -h "case\|ms_per" $OUT/ab1.txt $OUT/ab2.txt
