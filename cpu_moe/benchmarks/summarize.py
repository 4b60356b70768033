#!/usr/bin/env python3
"""Summarizes a cpu_moe_bench JSON file against cpu_moe's speed targets.

The targets: at T=1 a step reads at least 0.85 (bf16) or 0.70 (quantized) of the DRAM bandwidth
measured beside it; at T=8-64 a step with dedup takes at most 1.15x the time its distinct experts'
bytes take at that bandwidth, and dedup's speedup is at least 0.9x the reuse factor (routes over
distinct experts).

Usage: summarize.py RESULT.json [MORE.json ...]  (the files' benchmarks are read together)
       summarize.py --compare --old OLD.json [...] --new NEW.json [...] [--slower_than=R]
Prints, per (format, E, T): ms per step with dedup off/on, reuse, speedup (off/on) and its
fraction of the reuse factor, bw_fraction of both arms, and the step time with dedup over the
time unique bytes take at the measured DRAM bandwidth (target <= 1.15 for T >= 8), and the
rate of the dedup-off arm counted in the bytes it reads (every route its own expert: bw_frac off
x reuse): above 1 it exceeds the DRAM probe, so part of its repeated experts came from the
last-level cache, and no dedup kernel can then reach a speedup of the whole reuse factor.
Then, where the file has BM_CpuMoeSpeedup or BM_CpuMoeTrace cases, the same speedup measured
with both arms alternated step by step in one case (the arms of the first table run minutes
apart, at DRAM readings that can differ by 10-20%). Last, which cases meet the targets and
which do not.

Where the files also hold BM_CpuMoeHot with all workers (cpu_moe_bench
--benchmark_filter=BM_CpuMoeHot/, the weights in cache: what the cores compute with no DRAM
traffic at all), each dedup case also gets its compute floor: the time its experts take at the
cache-hot rates, with each expert's routes drawn as in the case (uniform top-8 routing: routes
per expert binomial(T, 8/E)) and the time per byte interpolated linearly between the measured 1,
4 and 8 routes (proportional to the routes beyond 8). Interpolation is optimistic where a kernel
takes routes in passes (5 routes cost two passes), so the floor is a lower bound. A case whose
floor exceeds the step target, or whose dedup-off time over the larger of its floor and its
DRAM time stays below 0.9 x reuse, cannot meet that target with these kernels on that machine,
whatever the memory system does.

The floor-rule table closes the summary, one row per format, in the layout of cpu_moe/README.md:
T=1 GB/s (fraction of DRAM) at E=256 / 128; for T=8/16/32/64 the dedup step over the DRAM time,
the step over max(DRAM time, compute floor), and speedup / reuse from the side-by-side cases.
BM_CpuMoePrefillPark rows (the prefill path with the pool parked and not) are listed per file.

--compare: two builds of cpu_moe_bench run on the same cases (alternating processes). Per case
its step time (ms_per_step, else the real time per iteration), the median over each build's
files, and new / old; then the geometric mean of new / old over the cases both builds ran, the
worst case, and the cases more than 10% slower (the targets: a geometric mean of at most 1.03,
and no case more than 10% slower in a confirming rerun). With --slower_than=R only the full
names of the cases whose new / old exceeds R are printed, worst first, one a line: the cases to
rerun.
"""
import json
import math
import sys


def HotRates(benchmarks):
    """{format: {routes: GB/s}} from BM_CpuMoeHot medians (aggregate rows, else the median run)."""
    runs = {}
    for b in benchmarks:
        parts = b["name"].split("/")
        if parts[0] != "BM_CpuMoeHot" or "threads=1" in b.get("label", ""):
            continue
        key = (parts[1], int(parts[2]))
        if b.get("run_type") == "aggregate":
            if b.get("aggregate_name") == "median":
                runs[key] = [b]
        elif key not in runs or runs[key][0].get("run_type") != "aggregate":
            runs.setdefault(key, []).append(b)
    rates = {}
    for (fmt, routes), bs in runs.items():
        bs.sort(key=lambda b: b["gbps_hot"])
        g = bs[len(bs) // 2]["gbps_hot"]
        rates.setdefault(fmt, {})[routes] = g / 1e9 if g > 1e6 else g
    return {f: r for f, r in rates.items() if all(k in r for k in (1, 4, 8))}


def ComputeFloorGbps(rate, e, t, k=8):
    """Unique-expert bytes per second at the cache-hot rates for uniform top-k routing."""
    s = {r: 1.0 / g for r, g in rate.items()}  # seconds per GB at r routes
    def per_gb(r):
        if r <= 4:
            return s[1] + (r - 1) * (s[4] - s[1]) / 3
        if r <= 8:
            return s[4] + (r - 4) * (s[8] - s[4]) / 4
        return s[8] * r / 8
    p = k / e
    probs = [math.comb(t, r) * p ** r * (1 - p) ** (t - r) for r in range(t + 1)]
    used = 1.0 - probs[0]
    mean = sum(probs[r] * per_gb(r) for r in range(1, t + 1)) / used
    return 1.0 / mean


def main(paths):
    data = {"benchmarks": []}
    for path in paths:
        data["benchmarks"] += json.load(open(path))["benchmarks"]
    hot = HotRates(data["benchmarks"])
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
    if rows:
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

    side_by_side = {}
    # BM_CpuMoeSpeedup (uniform routing) and BM_CpuMoeTrace (a recorded trace's routing, E=128):
    # the two arms alternated step by step in one case (median repetition by speedup).
    for family, title in (("BM_CpuMoeSpeedup", "uniform routing"),
                          ("BM_CpuMoeTrace", "routing of the recorded trace, E=128")):
        sp_runs = {}
        for b in data["benchmarks"]:
            parts = b["name"].split("/")
            if parts[0] != family or "speedup" not in b or b.get("run_type") == "aggregate":
                continue
            key = (parts[1], int(parts[2]), int(parts[3])) if family == "BM_CpuMoeSpeedup" \
                else (parts[1], 128, int(parts[2]))
            sp_runs.setdefault(key, []).append(b)
        if not sp_runs:
            continue
        print()
        print(f"Side by side ({family}, {title}, dedup on and off alternated step by step):")
        print()
        print("| format | E | T | ms off | ms on | reuse | speedup | speedup/reuse | bw_frac on | "
              "off: route bytes / DRAM | DRAM GB/s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for (fmt, e, t), bs in sp_runs.items():
            bs.sort(key=lambda b: b["speedup"])
            b = bs[len(bs) // 2]
            if family == "BM_CpuMoeSpeedup":
                side_by_side[(fmt, e, t)] = b
            print(f"| {fmt} | {e} | {t} | {b['off_ms']:.2f} | {b['on_ms']:.2f} | {b['reuse']:.2f} | "
                  f"{b['speedup']:.2f} | {b['speedup_over_reuse']:.2f} | {b['on_bw_fraction']:.2f} | "
                  f"{b['off_bw_fraction']:.2f} | {b['dram_gbps']:.0f} |")
    if hot:
        Floors(rows, side_by_side, hot)
    Targets(rows, side_by_side)
    if hot:
        FloorRuleTable(rows, side_by_side, hot)
    PrefillPark(paths)


def FloorRuleTable(rows, side_by_side, hot):
    """The floor-rule table (module doc), one row per format, E=256 before E=128."""
    ts = (8, 16, 32, 64)
    fmts = []
    for (fmt, _, _) in list(rows) + list(side_by_side):
        if fmt not in fmts:
            fmts.append(fmt)
    if not fmts:
        return

    def on(fmt, e, t):
        return rows.get((fmt, e, t), {}).get(1)

    def step_dram(fmt, e, t):
        b = on(fmt, e, t)
        if not b:
            return None
        return b["ms_per_step"] / (b["unique_bytes"] / (b["dram_gbps"] * 1e9) * 1e3)

    def step_floor(fmt, e, t):
        b = on(fmt, e, t)
        if not b or fmt not in hot:
            return None
        limit = min(ComputeFloorGbps(hot[fmt], e, t), b["dram_gbps"])
        return b["ms_per_step"] / (b["unique_bytes"] / (limit * 1e9) * 1e3)

    def speed(fmt, e, t):
        b = side_by_side.get((fmt, e, t))
        return b["speedup_over_reuse"] if b else None

    def cell(v):
        return "-" if v is None else f"{v:.2f}"

    print()
    print("Floor-rule table (T=8 / 16 / 32 / 64 in each cell; the step target is <= 1.15 against "
          "max(DRAM time, compute floor), the speedup target >= 0.9):")
    print()
    print("| format | T=1 GB/s (of DRAM), E=256 / 128 | step / DRAM time, E=256 | same, E=128 | "
          "step / max(DRAM time, compute floor), E=256 | same, E=128 | speedup / reuse, E=256 | "
          "same, E=128 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    met = {"t1": [0, 0], "step": [0, 0], "speed": [0, 0]}

    def count(name, v, ok):
        if v is not None:
            met[name][1] += 1
            met[name][0] += ok

    for fmt in fmts:
        t1 = []
        for e in (256, 128):
            b = on(fmt, e, 1)
            t1.append(f"{b['gbps']:.0f} ({b['bw_fraction']:.2f})" if b else "-")
            if b:
                count("t1", b, b["bw_fraction"] >= (0.85 if fmt == "bf16" else 0.70))
            for t in ts:
                v = step_floor(fmt, e, t)
                count("step", v, v is not None and v <= 1.15)
                v = speed(fmt, e, t)
                count("speed", v, v is not None and v >= 0.9)
        cells = [" / ".join(t1)]
        for fn in (step_dram, step_floor, speed):
            for e in (256, 128):
                cells.append(" / ".join(cell(fn(fmt, e, t)) for t in ts))
        print(f"| {fmt} | " + " | ".join(cells) + " |")
    print()
    print(f"T=1 target {met['t1'][0]} of {met['t1'][1]}; step target (floor rule) "
          f"{met['step'][0]} of {met['step'][1]}; speedup target {met['speed'][0]} of "
          f"{met['speed'][1]}")


def PrefillPark(paths):
    """BM_CpuMoePrefillPark rows of each file: the prefill call with the pool parked and not."""
    lines = []
    for path in paths:
        for b in json.load(open(path))["benchmarks"]:
            if not b["name"].startswith("BM_CpuMoePrefillPark/") or "park_on_ms" not in b:
                continue
            lines.append(f"| {path} | {b['name'].split('/iterations')[0]} | {b.get('label', '')} | "
                         f"{b['park_on_ms']:.2f} | {b['park_off_ms']:.2f} | "
                         f"{b['off_over_on']:.3f} | {b.get('omp_threads', 0):.0f} |")
    if lines:
        print()
        print("Prefill through oneDNN with the pool parked and not (medians of alternating calls):")
        print()
        print("| file | case | label | parked ms | unparked ms | unparked / parked | OpenMP threads |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(lines))


def StepTimes(paths):
    """{case name: [step ms per file]} of the non-aggregate rows in `paths`."""
    out = {}
    for path in paths:
        for b in json.load(open(path))["benchmarks"]:
            if b.get("run_type") == "aggregate" or b.get("error_occurred"):
                continue
            if "ms_per_step" in b:
                ms = b["ms_per_step"]
            else:
                scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b.get("time_unit", "ns")]
                ms = b["real_time"] * scale
            out.setdefault(b["name"], []).append(ms)
    return out


def Median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def Compare(old_paths, new_paths, slower_than=None):
    """New build against old on the cases both ran (module doc, --compare)."""
    old, new = StepTimes(old_paths), StepTimes(new_paths)
    names = [n for n in new if n in old]
    ratios = {n: Median(new[n]) / Median(old[n]) for n in names}
    if slower_than is not None:
        for n in sorted(ratios, key=ratios.get, reverse=True):
            if ratios[n] > slower_than:
                print(n)
        return
    if not ratios:
        sys.exit("no case in common between the old and the new files")
    print("| case | old ms | new ms | new / old | old runs | new runs |")
    print("|---|---|---|---|---|---|")
    for n in names:
        print(f"| {n} | {Median(old[n]):.4f} | {Median(new[n]):.4f} | {ratios[n]:.3f} | "
              f"{len(old[n])} | {len(new[n])} |")
    geo = math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))
    worst = max(ratios, key=ratios.get)
    slow = sorted((n for n in ratios if ratios[n] > 1.10), key=ratios.get, reverse=True)
    print()
    print(f"{len(ratios)} cases; geometric mean of new / old: {geo:.4f} (target <= 1.03: "
          f"{'met' if geo <= 1.03 else 'MISSED'})")
    print(f"worst case: {worst} new / old {ratios[worst]:.3f}")
    print(f"cases more than 10% slower: {len(slow)}"
          + ("".join(f"\n  {n}: {ratios[n]:.3f}" for n in slow) if slow else ""))


def Floors(rows, side_by_side, hot):
    """The compute floor of each dedup case (see the module's doc) against both targets."""
    print()
    print("Compute floor (cache-hot rates, all workers): "
          + "; ".join(f"{f} {r[1]:.0f} / {r[4]:.0f} / {r[8]:.0f} GB/s at 1 / 4 / 8 routes"
                      for f, r in sorted(hot.items())))
    print("(BM_CpuMoeHot's 16 experts sit in L3: at one route its rate can be the L3's, not the "
          "cores', so the floor of cases with about one route per expert is an upper bound)")
    print()
    print("| format | E | T | DRAM GB/s | compute floor GB/s | floor / (unique/DRAM) | "
          "measured / max(floor, unique/DRAM) | max speedup / reuse (side by side) |")
    print("|---|---|---|---|---|---|---|---|")
    out_step, out_speed, relaxed, relaxed_missed = [], [], 0, []
    keys = sorted(set(rows) | set(side_by_side), key=lambda x: (x[0], -x[1], x[2]))
    for (fmt, e, t) in keys:
        if fmt not in hot or t < 8:
            continue
        floor = ComputeFloorGbps(hot[fmt], e, t)
        on = rows.get((fmt, e, t), {}).get(1)
        sb = side_by_side.get((fmt, e, t))
        dram = on["dram_gbps"] if on else sb["dram_gbps"]
        ratio = dram / floor
        measured = "-"
        if on:
            best = on["unique_bytes"] / (min(floor, dram) * 1e9) * 1e3
            over = on["ms_per_step"] / best
            measured = f"{over:.2f}"
            if over <= 1.15:
                relaxed += 1
            else:
                relaxed_missed.append(f"{fmt}/{e}/{t}: {measured}")
        max_sp = "-"
        if sb:
            unique = sb["on_bw_fraction"] * sb["dram_gbps"] * 1e9 * sb["on_ms"] * 1e-3
            best_on = unique / (min(floor, sb["dram_gbps"]) * 1e9) * 1e3
            msr = sb["off_ms"] / best_on / sb["reuse"]
            max_sp = f"{msr:.2f}"
            if msr < 0.9:
                out_speed.append(f"{fmt}/{e}/{t}: {msr:.2f}")
        if ratio > 1.15:
            out_step.append(f"{fmt}/{e}/{t}: {ratio:.2f}")
        print(f"| {fmt} | {e} | {t} | {dram:.0f} | {floor:.0f} | {ratio:.2f} | {measured} | {max_sp} |")
    print()
    print(f"Step target out of reach (compute floor > 1.15 x unique bytes / DRAM): {len(out_step)}"
          + (": " + "; ".join(out_step) if out_step else ""))
    print(f"Speedup target out of reach (dedup-off time / max(floor, DRAM time) < 0.9 x reuse): "
          f"{len(out_speed)}" + (": " + "; ".join(out_speed) if out_speed else ""))
    print(f"Step target held against max(compute floor, DRAM time) instead of the DRAM time alone: "
          f"{relaxed} of {relaxed + len(relaxed_missed)} cases within 1.15x"
          + ("; missed: " + "; ".join(relaxed_missed) if relaxed_missed else ""))


def Targets(rows, side_by_side):
    """The targets against the cases present: what is met and what is missed."""
    t1, step, speed = [], [], []
    for (fmt, e, t), r in rows.items():
        on = r.get(1)
        if on is None:
            continue
        if t == 1:
            need = 0.85 if fmt == "bf16" else 0.70
            t1.append((on["bw_fraction"] >= need, f"{fmt}/{e}: {on['bw_fraction']:.2f} (>= {need})"))
        elif t >= 8:
            ratio = on["ms_per_step"] / (on["unique_bytes"] / (on["dram_gbps"] * 1e9) * 1e3)
            step.append((ratio <= 1.15, f"{fmt}/{e}/{t}: {ratio:.2f}"))
    for (fmt, e, t), b in side_by_side.items():
        if t >= 8:
            speed.append((b["speedup_over_reuse"] >= 0.9,
                          f"{fmt}/{e}/{t}: {b['speedup_over_reuse']:.2f}"))
    for title, items in (("T=1 bw_fraction (bf16 >= 0.85, quantized >= 0.70)", t1),
                         ("dedup step / (unique bytes / DRAM) <= 1.15, T=8-64", step),
                         ("speedup / reuse >= 0.9, side by side, T=8-64", speed)):
        if not items:
            continue
        met = [text for ok, text in items if ok]
        missed = [text for ok, text in items if not ok]
        print()
        print(f"{title}: {len(met)} of {len(items)} cases met")
        if missed:
            print("  missed: " + "; ".join(missed))
    # A case that streamed faster than the DRAM reading beside it shows that the reading was not
    # the limit at the time (the host's probe under-read in a slow hour on 2026-11-30): its
    # fractions and step ratios, and those of its neighbours, are then no evidence either way.
    over = [f"{fmt}/{e}/{t}: {r[1]['bw_fraction']:.2f}" for (fmt, e, t), r in rows.items()
            if r.get(1) is not None and r[1]["bw_fraction"] > 1.05]
    if over:
        print()
        print(f"WARNING: {len(over)} dedup cases read more than 1.05x the DRAM reading beside them "
              "(the probe was not the limit; do not use this run's fractions against the "
              "targets): " + "; ".join(over))


USAGE = ("usage: summarize.py RESULT.json [MORE.json ...]\n"
         "       summarize.py --compare --old OLD.json [...] --new NEW.json [...] "
         "[--slower_than=R]")

if __name__ == "__main__":
    args = sys.argv[1:]
    if not args:
        sys.exit(USAGE)
    if args[0] == "--compare":
        old_paths, new_paths, slower, into = [], [], None, None
        for a in args[1:]:
            if a == "--old":
                into = old_paths
            elif a == "--new":
                into = new_paths
            elif a.startswith("--slower_than="):
                slower = float(a.split("=", 1)[1])
            elif into is not None:
                into.append(a)
            else:
                sys.exit(USAGE)
        if not old_paths or not new_paths:
            sys.exit(USAGE)
        Compare(old_paths, new_paths, slower)
    else:
        main(args)
