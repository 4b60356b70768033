#!/usr/bin/env bash
# Session 16: does the host VM expose hardware counters, and if so what bounds the q4_0 panel
# kernels (frequency, IPC, ports, memory stalls) cache-hot and streaming from DRAM? perf is
# Debian's /usr/bin/perf (linux-perf 6.1), bundled with the benchmark.
set -u
OUT=$1
R=/tmp/moe_gpu/run
P="$R perf"
{ ls /sys/bus/event_source/devices/; cat /proc/sys/kernel/perf_event_paranoid; id; uname -r; } > $OUT/pmu.txt 2>&1
$P stat -e cycles,instructions,ref-cycles,task-clock -- sleep 0.2 > $OUT/stat_sleep.txt 2>&1
$P list > $OUT/perf_list.txt 2>&1
cat $OUT/pmu.txt $OUT/stat_sleep.txt; wc -l $OUT/perf_list.txt
if grep -q 'not supported\|not counted\|Permission\|No permission' $OUT/stat_sleep.txt; then
  echo "no usable PMU"; exit 0
fi
G=cycles,instructions,ref-cycles,task-clock
PORTS=uops_dispatched.port_0,uops_dispatched.port_1,uops_dispatched.port_5_11,uops_dispatched.port_6
MEM=cycle_activity.stalls_total,cycle_activity.stalls_l1d_miss,cycle_activity.stalls_l2_miss,cycle_activity.stalls_l3_miss
EXE=exe_activity.1_ports_util,exe_activity.2_ports_util,exe_activity.bound_on_loads,resource_stalls.sb
B="$R cpu_moe_bench"
for ev in "$G" "$PORTS" "$MEM" "$EXE"; do
  for c in "BM_CpuMoeHot/q4_0/4/" "BM_CpuMoeHot/q4_0/8/" "BM_CpuMoe/q4_0/128/64/1/"; do
    n=$(echo "$c$ev" | md5sum | cut -c1-6)
    timeout 90 $P stat -I 1000 -e "$ev" -o $OUT/perf_$n.txt -- $B --benchmark_filter="$c" \
      --benchmark_repetitions=12 --probe_rounds=1 > $OUT/bench_$n.txt 2>&1
    echo "== $c | $ev -> perf_$n.txt rc=$?"
  done
done
timeout 60 $P stat -I 1000 -e "$G" -o $OUT/perf_membw_g.txt -- $R membw_probe > $OUT/membw.txt 2>&1
timeout 60 $P stat -I 1000 -e "$MEM" -o $OUT/perf_membw_mem.txt -- $R membw_probe > $OUT/membw2.txt 2>&1
echo done
