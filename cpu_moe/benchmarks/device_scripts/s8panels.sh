#!/usr/bin/env bash
# Session 8: q4_0 / mxfp4 / nvfp4 in 16-row panels (Layout::kPanels) against row-major, side by
# side; then the speedup and step cases of the int8 formats with panels.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
lscpu > $OUT/lscpu.txt 2>&1
/tmp/moe_gpu/run interleave_probe 2048 200 > $OUT/probe.txt 2>&1; /tmp/moe_gpu/run interleave_probe 768 300 >> $OUT/probe.txt 2>&1
for L in panels row; do $B --layout=$L --threads=1 --benchmark_filter='BM_CpuMoeHot/(q4_0|mxfp4|nvfp4)/' --benchmark_repetitions=3 --benchmark_report_aggregates_only=true > $OUT/hot_$L.txt 2>&1; done
echo hot done $(date)
timeout 200 $B --trace=.gpu/qwen3_30b_a3b_top6_expert_ids.npy --ab=q4_0/256/1/1,q4_0/128/8/1,q4_0/128/64/1,mxfp4/128/32/1,nvfp4/256/64/1,trace:q4_0/64 --ab_reps=7 \
  --variant=row:MOE_BENCH_LAYOUT=row --variant=panels:MOE_BENCH_LAYOUT=panels \
  --variant=pan_pf2k:MOE_BENCH_LAYOUT=panels\;MOE_CPU_PREFETCH_BYTES=2048 \
  --variant=pan_l2_8k:MOE_BENCH_LAYOUT=panels\;MOE_CPU_PREFETCH_L2_BYTES=8192 > $OUT/ab.txt 2>&1; echo ab rc=$? $(date)
timeout 150 $B --benchmark_filter='BM_CpuMoeSpeedup/(q4_0|nvfp4|mxfp4)/' --benchmark_repetitions=3 --benchmark_format=json --benchmark_out=$OUT/speedup.json --benchmark_out_format=json > $OUT/speedup.txt 2>&1; echo speedup rc=$? $(date)
timeout 150 $B --benchmark_filter='BM_CpuMoe/(q4_0|nvfp4|mxfp4)/.*/1$' --benchmark_repetitions=3 --benchmark_format=json --benchmark_out=$OUT/sweep.json --benchmark_out_format=json > $OUT/sweep.txt 2>&1; echo sweep rc=$? $(date)
