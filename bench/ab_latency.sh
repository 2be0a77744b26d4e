#!/usr/bin/env bash
# A/B of one request's decode latency (the engine alone, no HTTP): base (.cache/ab/base) against this tree,
# alternating, on the device after bench/ab_compare.sh's set-up (carry .whl, .cache/gpu, .cache/ab).
#   bash bench/ab_latency.sh [ROUNDS]
# The server's program for qwen2-0.5b (layer scan, one step per program); 1 x 28 in / 300 out, --decode-step.
set -u
cd "$(dirname "$0")/.." || exit 1
REPO=$(pwd)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 JAXPAGED_BENCH_MODELS=$REPO/.cache/gpu/bench_models JAXPAGED_BENCH_DATA=$REPO/.cache/gpu/bench_data
$PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
for rev in base new; do
  src=$REPO; [ $rev = base ] && src=$REPO/.cache/ab/base
  rm -rf /tmp/ab-lat/$rev "$src/build"
  $PY -m pip install -q --no-deps --no-index --no-build-isolation --no-compile --target /tmp/ab-lat/$rev "$src" || exit 1
done
for round in $(seq 1 "${1:-3}"); do
  for rev in base new; do
    src=$REPO; [ $rev = base ] && src=$REPO/.cache/ab/base
    echo "== round $round $rev"
    PYTHONPATH=/tmp/ab-lat/$rev:/tmp/site JAXPAGED_CACHE_ROOT=/tmp/ab-lat/cache $PY "$src/bench/latency.py" \
      --model qwen2-0.5b --batch-size 1 --input-len 28 --output-len 300 --num-iters-warmup 2 --num-iters 5 \
      --decode-step --num-scheduler-steps 1 --max-num-seqs 16 --max-num-batched-tokens 512 \
      --engine-kwargs '{"layer_dispatch": "scan"}' 2>&1 | grep -E "Avg latency|decode step|Error|error"
  done
done
