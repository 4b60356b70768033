#!/usr/bin/env bash
# Sweeps the memory-system knobs of cpu_moe (prefetch distance, rows per work item) on one
# machine, one benchmark process per setting, for bf16 / q4_0 / nvfp4 at E=256, T=1 and T=64
# (dedup on). Usage: host_sweep.sh BENCH_BINARY_RUNNER OUT_DIR
#   e.g. host_sweep.sh "/tmp/moe_gpu/run cpu_moe_bench" $OUT
set -u
bench=$1
out=$2
filter='BM_CpuMoe/(bf16|q4_0|nvfp4)/256/(1|64)/1/'
common="--benchmark_filter=$filter --benchmark_repetitions=3 --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true"
# Warm-up process: the VM's memory grows on first use, which depresses the first DRAM probe.
$bench --benchmark_filter='BM_CpuMoe/q4_0/256/1/1/' >/dev/null 2>&1
for setting in "1024 16 16" "0 16 16" "512 16 16" "2048 16 16" "4096 16 16" "1024 8 8" "1024 32 32" "1024 64 64" "2048 64 64"; do
  set -- $setting
  echo "== prefetch_bytes=$1 pass1_rows=$2 pass2_rows=$3"
  MOE_CPU_PREFETCH_BYTES=$1 MOE_CPU_PASS1_ROWS=$2 MOE_CPU_PASS2_ROWS=$3 $bench $common 2>&1 |
    grep -E '^DRAM|_median' | sed -E 's/min_time:0.300\/real_time_median//; s/ +/ /g' |
    awk '{ if ($1 == "DRAM") print "   " $0; else { for (i = 1; i <= NF; i++) if ($i ~ /^(bw_fraction|gbps|ms_per_step)=/) printf "%s ", $i; print "  " $1 } }'
done
