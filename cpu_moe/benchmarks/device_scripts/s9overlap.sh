#!/usr/bin/env bash
# Session 9: how well the host hides compute under a DRAM stream (overlap_probe), 16 workers
# twice and 8 workers once (1 MiB runs, as the DRAM probe).
set -u
OUT=$1
R=/tmp/moe_gpu/run
for w in 16 8 16; do timeout 150 $R overlap_probe $w 2 > $OUT/overlap_w${w}_$(date +%s).txt 2>&1; echo w=$w rc=$?; done
