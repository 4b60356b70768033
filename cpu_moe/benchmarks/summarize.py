#!/usr/bin/env python3
"""Summarizes a cpu_moe_bench JSON file against issue 3's targets.

Usage: summarize.py RESULT.json
Prints, per (format, E, T): ms per step with dedup off/on, reuse, speedup (off/on) and its
fraction of the reuse factor, bw_fraction of both arms, and the step time with dedup over the
time unique bytes take at the measured DRAM bandwidth (target <= 1.15 for T >= 8), and the
rate of the dedup-off arm counted in the bytes it reads (every route its own expert: bw_frac off
x reuse): above 1 it exceeds the DRAM probe, so part of its repeated experts came from the
last-level cache, and no dedup kernel can then reach a speedup of the whole reuse factor.
"""
import json
import sys


def main(path):
    data = json.load(open(path))
    # With --benchmark_repetitions each case appears several times: keep the run with the median
    # step time (aggregate rows are skipped).
    runs = {}
    for b in data["benchmarks"]:
        parts = b["name"].split("/")
        if parts[0] != "BM_CpuMoe" or "ms_per_step" not in b or b.get("run_type") == "aggregate":
            continue
        fmt, e, t, dedup = parts[1], int(parts[2]), int(parts[3]), int(parts[4])
        runs.setdefault((fmt, e, t, dedup), []).append(b)
    rows = {}
    for (fmt, e, t, dedup), bs in runs.items():
        bs.sort(key=lambda b: b["ms_per_step"])
        rows.setdefault((fmt, e, t), {})[dedup] = bs[len(bs) // 2]
    print("| format | E | T | ms off | ms on | reuse | speedup | speedup/reuse | bw_frac off | "
          "bw_frac on | on / (unique/DRAM) | off: route bytes / DRAM |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (fmt, e, t), r in rows.items():
        off, on = r.get(0), r.get(1)
        if not off or not on:
            continue
        sp = off["ms_per_step"] / on["ms_per_step"]
        ideal = on["unique_bytes"] / (on["dram_gbps"] * 1e9) * 1e3
        print(f"| {fmt} | {e} | {t} | {off['ms_per_step']:.2f} | {on['ms_per_step']:.2f} | "
              f"{on['reuse']:.2f} | {sp:.2f} | {sp / on['reuse']:.2f} | "
              f"{off['bw_fraction']:.2f} | {on['bw_fraction']:.2f} | "
              f"{on['ms_per_step'] / ideal:.2f} | {off['bw_fraction'] * on['reuse']:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1])
