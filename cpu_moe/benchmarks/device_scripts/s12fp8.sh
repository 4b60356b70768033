#!/usr/bin/env bash
# Session 12: fp8_block's sweep with the fp16 kernels (uniform dedup steps, dedup speedups), the
# cache-hot rates of every format (to place the grant), fp16_dot_probe on one core, and pass-1 /
# pass-2 item sizes for the fp16 kernels side by side.
set -u
OUT=$1
B="/tmp/moe_gpu/run cpu_moe_bench"
lscpu > $OUT/lscpu.txt 2>&1
/tmp/moe_gpu/run fp16_dot_probe > $OUT/probe.txt 2>&1; echo probe rc=$? $(date)
/tmp/moe_gpu/run membw_probe 1.25 3 > $OUT/membw_before.txt 2>&1
timeout 200 $B --benchmark_filter='BM_CpuMoe/fp8_block/' --benchmark_repetitions=3 --benchmark_format=json --benchmark_out=$OUT/sweep_fp8.json --benchmark_out_format=json > /dev/null 2>&1; echo sweep rc=$? $(date)
timeout 120 $B --benchmark_filter='BM_CpuMoeSpeedup/fp8_block/' --benchmark_repetitions=3 --benchmark_format=json --benchmark_out=$OUT/speedup_fp8.json --benchmark_out_format=json > /dev/null 2>&1; echo speedup rc=$? $(date)
timeout 60 $B --benchmark_filter='BM_CpuMoeHot/' --benchmark_repetitions=3 --benchmark_report_aggregates_only=true --benchmark_format=json --benchmark_out=$OUT/hot16.json --benchmark_out_format=json > /dev/null 2>&1; echo hot rc=$? $(date)
timeout 120 $B --ab=fp8_block/128/64/1,fp8_block/256/32/1,bal:fp8_block/128/64 --variant=def: --variant=p1_128:MOE_CPU_PASS1_ROWS=128 --variant=p2_256:MOE_CPU_PASS2_ROWS=256 --ab_reps=5 > $OUT/rows.txt 2>&1; echo rows rc=$? $(date)
/tmp/moe_gpu/run membw_probe 1.25 3 > $OUT/membw_after.txt 2>&1
