#!/usr/bin/env bash
# The AVX3_DL code must run on every CPU that Highway's AVX3_DL check accepts, which asks for
# AVX512_VNNI but not AVX-VNNI (AMD Zen 4 and Intel Ice Lake have no AVX-VNNI). Highway 1.0.3's
# AVX3_DL target string enables avxvnni, and GCC then encodes 256- and 128-bit dot products as
# {vex} vpdpbusd: an AVX-VNNI instruction, SIGILL on those CPUs. This test disassembles the
# binaries and fails on any VEX-encoded VNNI instruction; it also requires EVEX vpdpbusd to be
# present, so that it cannot pass by reading the wrong file.
# Usage: isa_encoding_test.sh BINARY...
set -u
if ! command -v objdump >/dev/null; then
  echo "FAIL: objdump (binutils) not found"
  exit 1
fi
fails=0
for bin in "$@"; do
  dis=$(objdump -d --no-show-raw-insn "$bin") || { echo "FAIL: objdump $bin"; fails=$((fails + 1)); continue; }
  vex=$(grep -cE '\{vex\} *vpdp(bus|ws)ds?' <<<"$dis")
  all=$(grep -cE 'vpdpbusd' <<<"$dis")
  if [ "$vex" -ne 0 ]; then
    echo "FAIL: $bin holds $vex VEX-encoded (AVX-VNNI) dot products, e.g.:"
    grep -m3 -E '\{vex\} *vpdp' <<<"$dis"
    fails=$((fails + 1))
  elif [ "$all" -eq 0 ]; then
    echo "FAIL: $bin holds no vpdpbusd at all: not the AVX3_DL code this test is for"
    fails=$((fails + 1))
  else
    echo "ok: $bin: $all vpdpbusd, none VEX-encoded"
  fi
done
exit $((fails > 0))
