#!/usr/bin/env bash
# decode_bench on the CPU, both families, at a few layers: it must run every case (prefill, then
# decode at each batch size, per format) and write them to its JSON with finite, positive speeds
# and a roofline it can be held against. qwen3_5_moe runs its Gated DeltaNet layers with the
# per-sequence state the engine keeps. Usage: decode_bench_cpu_test.sh DECODE_BENCH
set -u
bench=$1
out=${TEST_TMPDIR:-/tmp}
fails=0
run() {
  local name=$1
  shift
  if ! "$bench" --backend cpu --threads 2 --membw_mib 32 --batches 1,3 --context 20 \
      --decode_steps 2 --prefill_tokens 24 --json "$out/$name.json" "$@" >"$out/$name.log" 2>&1; then
    echo "FAIL: $name: decode_bench $* exited non-zero:"
    cat "$out/$name.log"
    fails=$((fails + 1))
    return
  fi
  if ! /usr/bin/python3 - "$out/$name.json" "$@" <<'PY'
import json, math, sys
doc = json.load(open(sys.argv[1]))
args = sys.argv[2:]
formats = args[args.index("--formats") + 1].split(",")
family = args[args.index("--family") + 1]
layers = int(args[args.index("--layers") + 1])
assert doc["family"] == family and doc["layers"] == layers, (doc["family"], doc["layers"])
want = [(f, k, b) for f in formats for k, b in (("prefill", 1), ("decode", 1), ("decode", 3))]
got = [(c["format"], c["kind"], c["batch"]) for c in doc["cases"]]
assert got == want, (got, want)
for c in doc["cases"]:
    for key in ("tok_s", "roofline_tok_s", "bytes_per_token", "dram_read_gbps",
                "fraction_of_roofline"):
        v = c[key]
        assert math.isfinite(v) and v > 0, (c["format"], c["kind"], c["batch"], key, v)
    assert c["tokens"] == (24 if c["kind"] == "prefill" else 2 * c["batch"]), c
print(f"ok: {family}, {len(got)} cases")
PY
  then
    echo "FAIL: $name: its JSON (above)"
    fails=$((fails + 1))
  fi
}
run qwen3 --family qwen3_moe --layers 2 --experts 16 --top_k 4 --vocab 512 --formats bf16,q4_0
# Three Gated DeltaNet layers and one gated full-attention layer of Qwen3.6-35B-A3B's shape.
run qwen35 --family qwen3_5_moe --layers 4 --formats nvfp4
[ "$fails" -eq 0 ] || exit 1
echo "all passed"
