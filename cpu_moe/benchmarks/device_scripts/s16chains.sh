#!/usr/bin/env bash
# Session 16: is the q4_0 panel mix bound by vpdpbusd latency, or by port 0? overlap_probe's rows with fewer
# accumulators (32c4, 32c2) show what latency costs a pure dot-product loop; P4c1 / P4c4 / P4i
# run the panel mix with 1 or 4 chains per route and stream, or two routes' chains interleaved.
# P4v / P4m / P4vm (added for the second run) move the nibble masks to vpermb (port 5) and the
# conversion to the magic-number trick (ports 0 and 5).
set -u
OUT=$1
R=/tmp/moe_gpu/run
timeout 200 $R overlap_probe 16 2 > $OUT/chains_1.txt 2>&1; echo probe1 rc=$?
timeout 200 $R overlap_probe 16 2 > $OUT/chains_2.txt 2>&1; echo probe2 rc=$?
cat $OUT/chains_1.txt $OUT/chains_2.txt
