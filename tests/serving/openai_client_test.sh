#!/usr/bin/env bash
# Runs openai_client_test.mjs (the official OpenAI Node client) against a scripted server with an
# API key. Skips (passes with a message) when node or the `openai` npm package is not installed
# (`npm install -g openai` installs it).
#
#   openai_client_test.sh SCRIPTED_SERVER TOKENIZER_JSON TEST_MJS
set -euo pipefail

server=$1
model_dir=$(cd "$(dirname "$2")" && pwd)
script_mjs=$3
if ! command -v node >/dev/null; then echo "SKIPPED: node is not installed"; exit 0; fi
module=$(npm root -g 2>/dev/null)/openai
if [[ ! -f "$module/package.json" ]]; then
  echo "SKIPPED: the openai npm package is not installed (npm install -g openai)"
  exit 0
fi

work=$(mktemp -d "${TEST_TMPDIR:-/tmp}/openai_client.XXXXXX")
cat >"$work/script.json" <<'JSON'
[{"match": "capital of France",
  "output": "<think>\nEasy one.\n</think>\n\nThe capital of France is Paris."},
 {"match": "sunny", "output": "It is sunny in Paris."},
 {"match": "weather",
  "output": "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"}]
JSON
"$server" --model "$model_dir" --script_file "$work/script.json" --port 0 --http_port 0 \
  --api_key test-key >"$work/server.out" 2>"$work/server.err" &
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
timeout 60 node "$script_mjs" "http://127.0.0.1:$port/v1" test-key "$module"
