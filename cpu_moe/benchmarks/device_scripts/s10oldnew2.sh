#!/usr/bin/env bash
# Session 10, the second inline layout: panels before (commit 49a9c94, bench_old: each panel's
# scales after all its codes) and after (bench_new2: groups of blocks with their scales inline,
# each block's addresses computed without branches, 5 + 5 prefetches per block as before), in
# alternating processes, two rounds in rotated order: cache-hot rates and DRAM steps.
set -u
OUT=$1
for r in 1 2; do
  vs="old new2"; [ $r = 2 ] && vs="new2 old"
  for v in $vs; do
    B="/tmp/moe_gpu/run bench_$v"
    timeout 60 $B --benchmark_filter='BM_CpuMoeHot/(q4_0|mxfp4|nvfp4)/' --benchmark_repetitions=3 --benchmark_report_aggregates_only=true --benchmark_format=json > $OUT/hot_${v}_$r.json 2>/dev/null; echo hot $v $r rc=$?
    timeout 120 $B --ab=q4_0/256/1/1,q4_0/128/8/1,mxfp4/256/16/1,nvfp4/128/32/1,q4_0/128/64/1 --ab_reps=5 --variant=$v: > $OUT/ab_${v}_$r.txt 2>&1; echo ab $v $r rc=$?
  done
done
python3 - $OUT <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + '/hot_*.json')):
    d = json.load(open(f))
    print(f.split('/')[-1], ' '.join('%s=%.1f' % (b['name'].split('/')[1] + '/' + b['name'].split('/')[2], b['gbps_hot']) for b in d['benchmarks'] if b.get('aggregate_name') == 'median'))
PY
grep -h "ms_per_step\|^case" $OUT/ab_*.txt
