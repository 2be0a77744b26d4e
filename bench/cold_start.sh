#!/usr/bin/env bash
# Cold start-ups of the server, one per variant, in one device call: where a cold start-up's time goes and
# what XLA's options do to it.
#   bash bench/cold_start.sh MODEL [--variant NAME "VAR=VALUE ..."]... [--offline NAME,NAME] [--warm NAME,NAME]
#        [--deadline-s S]
# carry=[".whl", ".cache/gpu"] (bash bench/prepare_gpu_suite.sh here first). Each variant starts
# `python -m jaxpaged.server --load-format dummy` on a fresh cache root with its environment (e.g.
# "XLA_FLAGS=--xla_gpu_autotune_level=0", or "JAXPAGED_STARTUP_THREADS=16") and reports the seconds to
# /health 200 and the engine's start-up lines (lowering, XLA compile
# seconds by program kind). --offline NAME,...: after that variant's start-up, bench/throughput.py (ShareGPT
# 1000) with the same environment on its now warm cache, so an option's run-time cost is measured beside
# its compile time. --warm NAME,...: after that variant's cold start-up, a second server start on the same
# cache root (a warm start-up: the executable cache loaded, nothing compiled), its seconds to /health 200.
# Without --variant: one default start-up. Stops starting variants past --deadline-s.
set -u
cd "$(dirname "$0")/.." || exit 1
MODEL=${1:?model: qwen2-0.5b or llama3-8b}; shift
NAMES=(); ENVS=(); OFFLINE=","; WARM=","; DEADLINE=560
while [ $# -gt 0 ]; do
  case $1 in --variant) NAMES+=("$2"); ENVS+=("$3"); shift 2 ;; --offline) OFFLINE=",$2,"; shift ;;
             --warm) WARM=",$2,"; shift ;;
             --deadline-s) DEADLINE=$2; shift ;; *) echo "unknown argument $1"; exit 2 ;; esac
  shift
done
[ ${#NAMES[@]} = 0 ] && { NAMES=(default); ENVS=(""); }
START=$(date +%s)
source bench/gpu_env.sh
rm -rf /tmp/jp0; mv /tmp/jp /tmp/jp0          # each variant starts from a fresh copy
echo "cold_start $MODEL: rev $JAXPAGED_GIT_REV, $(PYTHONPATH=/tmp/jp0:$PYTHONPATH $PY -c 'import jax; print(jax.__version__, jax.devices()[0].device_kind)' 2>&1 | tail -1), $(nproc) cores"
path=$(PYTHONPATH=/tmp/jp0:$REPO:$PYTHONPATH $PY -c "from bench.models import resolve_model; print(resolve_model('$MODEL')[0])")
ms() { echo $(( $(date +%s%N) / 1000000 )); }
secs() { local d=$(( $(ms) - $1 )); printf "%d.%03d" $((d / 1000)) $((d % 1000)); }
PORT=8011
wait_health() {   # until /health answers 200, or the server ($SRV) exits (then its log's tail, and 1)
  until $PY -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; do
    if ! kill -0 $SRV 2>/dev/null; then echo "   server exited:"; tail -20 "$1"; return 1; fi
    sleep 0.2
  done
}
for i in "${!NAMES[@]}"; do
  name=${NAMES[$i]}; assign=${ENVS[$i]}
  if [ $(( $(date +%s) - START )) -gt "$DEADLINE" ]; then echo "== $name: skipped (deadline)"; continue; fi
  rm -rf /tmp/jp; cp -r /tmp/jp0 /tmp/jp
  root=/tmp/cold-$name; rm -rf "$root"
  echo "== $name: ${assign:-(no extra environment)}"
  t0=$(ms)
  # shellcheck disable=SC2086  # assign is a list of VAR=VALUE words
  env JAXPAGED_CACHE_ROOT="$root" $assign $PY -m jaxpaged.server --port $PORT --model "$path" --load-format dummy \
    --disable-log-requests --uvicorn-log-level warning > "/tmp/server-$name.log" 2>&1 &
  SRV=$!
  ok=1
  wait_health "/tmp/server-$name.log" || ok=0
  [ $ok = 1 ] && echo "   /health 200 after $(secs $t0) s (cold)"
  tr '\r' '\n' < "/tmp/server-$name.log" | grep -E "Run config|KV cache:|XLA compile seconds|Compiled|engine core ready|Lowering buckets.*100%|unusable" \
    | sed 's/^/   /' | cut -c1-400
  echo "   rematerialization warnings: $(grep -c "rematerialization" "/tmp/server-$name.log"), autotuner timer warnings: $(grep -c "Delay kernel timed out" "/tmp/server-$name.log")"
  kill -TERM $SRV 2>/dev/null; wait $SRV 2>/dev/null
  [ -n "${OUT:-}" ] && cp "/tmp/server-$name.log" "$OUT/"
  if [ $ok = 1 ] && [[ $WARM == *",$name,"* ]]; then
    t0=$(ms)
    # shellcheck disable=SC2086
    env JAXPAGED_CACHE_ROOT="$root" $assign $PY -m jaxpaged.server --port $PORT --model "$path" --load-format dummy \
      --disable-log-requests --uvicorn-log-level warning > "/tmp/server-$name-warm.log" 2>&1 &
    SRV=$!
    wait_health "/tmp/server-$name-warm.log" && echo "   /health 200 after $(secs $t0) s (warm, the same cache root)"
    tr '\r' '\n' < "/tmp/server-$name-warm.log" | grep -E "Compiled|Loaded|engine core ready" | sed 's/^/   /' | cut -c1-300
    kill -TERM $SRV 2>/dev/null; wait $SRV 2>/dev/null
  fi
  if [ $ok = 1 ] && [[ $OFFLINE == *",$name,"* ]]; then
    echo "   offline ShareGPT 1000 on this variant's warm cache:"
    # shellcheck disable=SC2086
    env JAXPAGED_CACHE_ROOT="$root" $assign $PY "$REPO/bench/throughput.py" --no-tqdm --dataset sharegpt \
      --model "$MODEL" --result-name "throughput-$MODEL-sharegpt-$name" 2>&1 \
      | grep -E "Throughput|startup|Error|error" | tail -4 | sed 's/^/   /'
    [ -n "${OUT:-}" ] && cp "$REPO/bench/results/throughput-$MODEL-sharegpt-$name.json" "$OUT/" 2>/dev/null
  fi
done
echo "== done in $(( $(date +%s) - START )) s"
