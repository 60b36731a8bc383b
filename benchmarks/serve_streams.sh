#!/usr/bin/env bash
# Concurrent streaming through `fornax serve`, one server configuration after another in one
# run: 32 concurrent chat streams (64 requests), ~128-token prompts, 128 output tokens each,
# EOS ignored. Prints each configuration's summary (output tok/s, TTFT and TPOT percentiles).
#
#   benchmarks/serve_streams.sh [concurrency] [--quantization auto] [--quantization int4] ...
#
# Each further argument is one server configuration (quote it to pass several flags); with
# none, dense bf16 and --quantization auto are compared. ROUNDS=n repeats the comparison n
# times, every other round in reverse order (A B, B A, ...): on this machine the first of
# two configurations read slower than the second in each of three runs, whichever it was.
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
ROUNDS=${ROUNDS:-1}
mkdir -p "$OUT"
ORDER=()
for ((round = 1; round <= ROUNDS; round++)); do
  if ((round % 2)); then
    for ((i = 0; i < ${#CONFIGS[@]}; i++)); do ORDER+=("$round:${CONFIGS[$i]}"); done
  else
    for ((i = ${#CONFIGS[@]} - 1; i >= 0; i--)); do ORDER+=("$round:${CONFIGS[$i]}"); done
  fi
done
for entry in "${ORDER[@]}"; do
  round=${entry%%:*}
  cfg=${entry#*:}
  # shellcheck disable=SC2086  # cfg holds several flags on purpose
  $BIN/fornax serve --port $PORT --api-key $KEY --max-num-seqs 64 $cfg --log-level warning &
  pid=$!
  trap 'kill $pid 2>/dev/null' EXIT
  for _ in $(seq 120); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
  name=${cfg:-dense-bf16}
  echo "== fornax serve ${name} | concurrency ${CONC} | round ${round} of ${ROUNDS} =="
  $BIN/fornax bench serve --base-url http://127.0.0.1:$PORT --api-key $KEY --dataset random \
    --random-input-len 128 --random-output-len 128 --num-prompts $((CONC * 2)) --num-warmups 2 \
    --max-concurrency "$CONC" --seed 0 --no-progress --json "$OUT/${name// /_}.round${round}.json"
  kill $pid; wait $pid 2>/dev/null || true
done
