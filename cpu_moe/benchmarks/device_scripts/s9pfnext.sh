#!/usr/bin/env bash
# Session 9: panel banks' prefetches running on into the next panel (MOE_CPU_PANEL_PF_NEXT=1)
# against the default, side by side (second run: the wrap across several short panels fixed;
# with a 4 KiB L2 distance too; third run: not past the last panel of an item).
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 400 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy --ab=q4_0/256/1/1,mxfp4/256/8/1,nvfp4/128/16/1,bal:q4_0/128/64,q4_0/128/64/1,mxfp4/128/32/1,trace:q4_0/32 --ab_reps=9 \
  --variant=def: --variant=next:MOE_CPU_PANEL_PF_NEXT=1 --variant=next_l2_4k:MOE_CPU_PANEL_PF_NEXT=1\;MOE_CPU_PREFETCH_L2_BYTES=4096 > $OUT/ab_pfnext.txt 2>&1; echo ab rc=$? $(date)
