#!/usr/bin/env bash
# cpu_moe_bench refuses bad arguments before it measures anything: exit status 2 and a message
# that starts with "bad " and names the argument. Usage: cpu_moe_bench_args_test.sh BENCH NOT_NPY
set -u
bench=$1
not_npy=$2
fails=0
expect_bad() {
  local out rc
  out=$("$bench" "$@" 2>&1)
  rc=$?
  if [ "$rc" -ne 2 ] || ! grep -q "^bad ${1%%=*}" <<<"$out"; then
    echo "FAIL: $* exited $rc, output: $out"
    fails=$((fails + 1))
  else
    echo "ok: $* -> $(grep -m1 '^bad ' <<<"$out")"
  fi
}
expect_bad --trace=/nonexistent/trace.npy --benchmark_filter=none
expect_bad --trace="$not_npy" --benchmark_filter=none
expect_bad --threads=-3 --benchmark_filter=none
expect_bad --layout=weird --benchmark_filter=none
expect_bad --ab=foo/1/2/3
expect_bad --ab=bal:q4_0/128/3
expect_bad --variant=novalue
# A good command line that selects nothing exits 0.
if ! "$bench" --benchmark_filter=none >/dev/null 2>&1; then
  echo "FAIL: --benchmark_filter=none exited $?"
  fails=$((fails + 1))
fi
[ "$fails" -eq 0 ] || exit 1
echo "all passed"
