#!/usr/bin/env bash
# The chat page in headless Chromium: load /?q=..., which sends the question by itself; the
# streamed answer and the reasoning must appear in the DOM, apart. A screenshot is saved as a
# test output. Skips (passes with a message) when Chromium is not installed.
#
#   chat_page_test.sh SCRIPTED_SERVER TOKENIZER_JSON
set -euo pipefail

server=$1
model_dir=$(cd "$(dirname "$2")" && pwd)
chromium=$(command -v chromium || command -v chromium-browser || true)
if [[ -z "$chromium" ]]; then
  echo "SKIPPED: chromium is not installed (tools/bazel installs it from" \
       "third_party/debian_packages_optional.txt when it can)"
  exit 0
fi

work=$(mktemp -d "${TEST_TMPDIR:-/tmp}/chat_page.XXXXXX")
out_dir=${TEST_UNDECLARED_OUTPUTS_DIR:-$work}
cat >"$work/script.json" <<'JSON'
[{"match": "capital of France",
  "output": "<think>\nThe user asks about geography.\n</think>\n\nThe capital of France is Paris."}]
JSON

"$server" --model "$model_dir" --script_file "$work/script.json" --host 127.0.0.1 --port 0 \
  --http_port 0 --step_ms 1 >"$work/server.out" 2>"$work/server.err" &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true' EXIT

port=
for _ in $(seq 1 400); do
  port=$(sed -n 's|.*HTTP  http://127.0.0.1:\([0-9]*\)/v1.*|\1|p' "$work/server.out")
  [[ -n "$port" ]] && break
  kill -0 $pid 2>/dev/null || { cat "$work/server.err"; echo "FAIL: the server exited"; exit 1; }
  sleep 0.05
done
[[ -n "$port" ]] || { echo "FAIL: the server reported no HTTP port"; exit 1; }

url="http://127.0.0.1:$port/?q=What%20is%20the%20capital%20of%20France%3F"
browse() {
  timeout 60 "$chromium" --headless --no-sandbox --disable-gpu --disable-dev-shm-usage \
    --disable-background-networking --disable-component-update --disable-sync --no-first-run \
    --user-data-dir="$(mktemp -d "$work/profile.XXXXXX")" --window-size=900,600 \
    --virtual-time-budget=15000 "$@" "$url" 2>>"$work/chromium.err"
}

# Virtual time runs ahead while nothing is pending, so the scripted model steps fast (1 ms).
browse --dump-dom | tr -d '\n' >"$work/dom.html" || { tail -20 "$work/chromium.err"; echo "FAIL: chromium"; exit 1; }
fail=0
grep -q 'class="answer">The capital of France is Paris.</div>' "$work/dom.html" \
  || { echo "FAIL: the streamed answer is not in the page"; fail=1; }
grep -q 'class="reasoning">.*The user asks about geography.' "$work/dom.html" \
  || { echo "FAIL: the reasoning is not shown apart"; fail=1; }
grep -q 'data-done="1"' "$work/dom.html" || { echo "FAIL: the stream did not end"; fail=1; }
if ((fail)); then
  grep -o '<div id="log">.*</form>' "$work/dom.html" | head -c 3000
  exit 1
fi

browse --screenshot="$out_dir/chat_page.png" >/dev/null || true
[[ -s "$out_dir/chat_page.png" ]] || { echo "FAIL: no screenshot"; exit 1; }
echo "PASS: streamed answer and reasoning shown; screenshot in $out_dir/chat_page.png"
