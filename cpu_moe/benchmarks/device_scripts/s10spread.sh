#!/usr/bin/env bash
# Session 10: panel prefetches spread over a group's blocks (default of the experiment) or issued
# in one burst at the group's start (MOE_CPU_PANEL_PF_BURST=1, a temporary switch): in DRAM side
# by side, and cache-hot (alternating processes, two rounds).
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
timeout 300 $B --ab=q4_0/256/1/1,q4_0/128/8/1,mxfp4/256/16/1,nvfp4/128/32/1,q4_0/128/64/1 --ab_reps=7 \
  --variant=spread: --variant=burst:MOE_CPU_PANEL_PF_BURST=1 > $OUT/ab_spread.txt 2>&1; echo ab rc=$? $(date)
for r in 1 2; do
  for v in spread burst; do
    if [ $v = burst ]; then export MOE_CPU_PANEL_PF_BURST=1; else unset MOE_CPU_PANEL_PF_BURST; fi
    timeout 60 $B --benchmark_filter='BM_CpuMoeHot/(q4_0|mxfp4)/' --benchmark_repetitions=3 --benchmark_report_aggregates_only=true --benchmark_format=json > $OUT/hot_${v}_$r.json 2>/dev/null; echo hot $v $r rc=$?
  done
done
unset MOE_CPU_PANEL_PF_BURST
python3 - $OUT <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + '/hot_*.json')):
    d = json.load(open(f))
    print(f.split('/')[-1], ' '.join('%s=%.1f' % (b['name'].split('/')[1] + '/' + b['name'].split('/')[2], b['gbps_hot']) for b in d['benchmarks'] if b.get('aggregate_name') == 'median'))
PY
