#!/usr/bin/env bash
# Two commits served side by side, alternating: the check a change on the hot path owes.
#
#   benchmarks/serve_commits.sh BASE [HEAD] [ROUNDS]
#
# Each commit is checked out into its own worktree under $OUT and served by this checkout's
# venv with PYTHONPATH pointing at that worktree, on make run's flags; 32 concurrent chat
# streams (64 requests, ~128-token prompts, 128 output tokens, EOS ignored) are timed with
# `fornax bench serve`. Rounds alternate the order (A B, B A, ...), since the machine drifts
# within a run. Prints each run's output tok/s and TTFT p50, then the median ratio HEAD/BASE.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${1:?usage: serve_commits.sh BASE [HEAD] [ROUNDS]}
HEAD=${2:-HEAD}
ROUNDS=${3:-3}
CONC=${CONC:-32}
PORT=18602
OUT=${OUT:-/tmp/fornax-serve-commits}
PY=$PWD/.venv/bin/python
FLAGS=${FLAGS-"--quantization auto --large-step-quantization w8a8"}  # FLAGS="" for dense bf16
mkdir -p "$OUT"
declare -A TREE
for rev in "$BASE" "$HEAD"; do
  sha=$(git rev-parse --short "$rev")
  TREE[$rev]=$OUT/tree-$sha
  [ -d "${TREE[$rev]}" ] || git worktree add --detach -f "${TREE[$rev]}" "$sha" >/dev/null
done
serve_and_bench() {  # $1: revision, $2: round
  local rev=$1 round=$2 tree=${TREE[$1]} pid json
  json="$OUT/$(git rev-parse --short "$rev").round$round.json"
  # shellcheck disable=SC2086  # FLAGS holds several flags on purpose
  (cd "$tree" && PYTHONPATH="$tree" exec "$PY" -m fornax.cli serve --port $PORT --max-num-seqs 64 $FLAGS \
    --log-level warning --no-access-log) &
  pid=$!
  for _ in $(seq 180); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
  "$PY" -m fornax.cli bench serve --base-url http://127.0.0.1:$PORT --dataset random \
    --random-input-len 128 --random-output-len 128 --num-prompts $((CONC * 2)) --num-warmups 2 \
    --max-concurrency "$CONC" --seed 0 --no-progress --json "$json" >/dev/null
  kill $pid; wait $pid 2>/dev/null || true
  "$PY" -c "import json,sys; r=json.load(open(sys.argv[1]))['summary']
print(f\"{sys.argv[2]:>10} round {sys.argv[3]}: {r['output_throughput']:.1f} out tok/s, TTFT p50 {r['ttft_ms']['median']:.0f} ms\")" \
    "$json" "$rev" "$round"
}
for ((round = 1; round <= ROUNDS; round++)); do
  if ((round % 2)); then order=("$BASE" "$HEAD"); else order=("$HEAD" "$BASE"); fi
  for rev in "${order[@]}"; do serve_and_bench "$rev" "$round"; done
done
"$PY" - "$OUT" "$(git rev-parse --short "$BASE")" "$(git rev-parse --short "$HEAD")" "$ROUNDS" <<'EOF'
import json, statistics, sys
out, base, head, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def tps(sha, r):
    return json.load(open(f"{out}/{sha}.round{r}.json"))["summary"]["output_throughput"]
ratios = [tps(head, r) / tps(base, r) for r in range(1, rounds + 1)]
print(f"{head} / {base} output tok/s per round: {', '.join(f'{x:.3f}' for x in ratios)}; "
      f"median {statistics.median(ratios):.3f}")
EOF
