#!/usr/bin/env bash
# Concurrent streaming through `fornax serve`, one server configuration after another in one
# run: 32 concurrent chat streams (64 requests), ~128-token prompts, 128 output tokens each,
# EOS ignored. Prints each configuration's summary (output tok/s, TTFT and TPOT percentiles).
#
#   benchmarks/serve_streams.sh [concurrency] [--quantization auto] [--quantization int4] ...
#
# Each further argument is one server configuration (quote it to pass several flags); with
# none, dense bf16 and --quantization auto are compared.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
CONC=${1:-32}
shift || true
CONFIGS=("$@")
[ ${#CONFIGS[@]} -eq 0 ] && CONFIGS=("" "--quantization auto")
PORT=18601
KEY=sk-streams
OUT=${OUT:-/tmp/fornax-serve-streams}
mkdir -p "$OUT"
for cfg in "${CONFIGS[@]}"; do
  # shellcheck disable=SC2086  # cfg holds several flags on purpose
  $BIN/fornax serve --port $PORT --api-key $KEY --max-num-seqs 64 $cfg --log-level warning &
  pid=$!
  trap 'kill $pid 2>/dev/null' EXIT
  for _ in $(seq 120); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
  name=${cfg:-dense-bf16}
  echo "== fornax serve ${name} | concurrency ${CONC} =="
  $BIN/fornax bench serve --base-url http://127.0.0.1:$PORT --api-key $KEY --dataset random \
    --random-input-len 128 --random-output-len 128 --num-prompts $((CONC * 2)) --num-warmups 2 \
    --max-concurrency "$CONC" --seed 0 --no-progress --json "$OUT/${name// /_}.json"
  kill $pid; wait $pid 2>/dev/null || true
done
