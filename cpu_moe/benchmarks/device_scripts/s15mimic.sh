#!/usr/bin/env bash
# Session 15: how much of the panel kernels' shortfall at 1-8 routes per expert is the kernel's
# instruction mix, and how much the library around it. overlap_probe's P<R> rows run q4_0
# PanelDot's own mix (decode, two vpdpbusd chains per route, conversion, scale) over two
# streams in 1 MiB runs (address order) and in 128 KiB runs (random order, like pass 2's
# items); the library runs the same routes per expert with every expert at exactly R routes
# (bal:q4_0/128/T, R = T/16), with the passes overlapped (default) and joined.
set -u
OUT=$1
R=/tmp/moe_gpu/run
lscpu > $OUT/lscpu.txt 2>&1
timeout 120 $R membw_probe > $OUT/membw_before.txt 2>&1; echo membw rc=$?
timeout 150 $R overlap_probe 16 2 > $OUT/mimic_1m.txt 2>&1; echo mimic1 rc=$?
timeout 150 $R overlap_probe 16 2 128 1 > $OUT/mimic_128k_rand.txt 2>&1; echo mimic2 rc=$?
timeout 200 $R cpu_moe_bench --probe_rounds=2 --ab_reps=5 \
  --ab=q4_0/256/1/1,bal:q4_0/128/16,bal:q4_0/128/64,bal:q4_0/128/128 \
  --variant=auto: --variant=noov:MOE_CPU_OVERLAP=0 > $OUT/lib_ab.txt 2>&1; echo lib rc=$?
timeout 100 $R cpu_moe_bench --benchmark_filter='BM_CpuMoeHot/q4_0/' --benchmark_repetitions=2 \
  > $OUT/lib_hot.txt 2>&1; echo hot rc=$?
timeout 150 $R overlap_probe 16 2 > $OUT/mimic_1m_again.txt 2>&1; echo mimic3 rc=$?
timeout 120 $R membw_probe > $OUT/membw_after.txt 2>&1
grep -h "" $OUT/mimic_1m.txt $OUT/mimic_128k_rand.txt
grep -h "case\|ms_per" $OUT/lib_ab.txt
grep -h "BM_" $OUT/lib_hot.txt
timeout 200 $R cpu_moe_test > $OUT/cpu_moe_test.txt 2>&1; echo cpu_moe_test rc=$?; tail -3 $OUT/cpu_moe_test.txt
