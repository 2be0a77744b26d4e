#!/usr/bin/env bash
# A sampler variant's first request against a running server (bench/sampler_stall.py), one server per model:
#   bash bench/sampler_stall.sh [--offline] MODEL [MODEL ...]
# carry=[".whl", ".cache/gpu"] (bash bench/prepare_gpu_suite.sh here first). --offline first runs each model's
# offline ShareGPT 1000 (bench/throughput.py), which also fills the executable cache the server then loads.
# Each server: --load-format dummy, everything else default, its log in /tmp/server-MODEL.log. $OUT gets one
# archive per model: its results and its server's log.
set -u
cd "$(dirname "$0")/.." || exit 1
OFFLINE=0
[ "${1:-}" = --offline ] && { OFFLINE=1; shift; }
source bench/gpu_env.sh
echo "sampler_stall: rev $JAXPAGED_GIT_REV, $($PY -c 'import jax; print(jax.__version__, jax.devices()[0].device_kind)' 2>&1 | tail -1)"
PORT=8012
for MODEL in "$@"; do
  path=$(PYTHONPATH=$REPO:${PYTHONPATH:-} $PY -c "from bench.models import resolve_model; print(resolve_model('$MODEL')[0])")
  if [ $OFFLINE = 1 ]; then
    echo "== $MODEL: offline ShareGPT 1000"
    $PY "$REPO/bench/throughput.py" --no-tqdm --dataset sharegpt --model "$MODEL" 2>&1 | grep -E "Throughput|Run config|Compiled|Error|error" | tail -6
  fi
  echo "== $MODEL: server"
  t0=$(date +%s)
  $PY -m jaxpaged.server --port $PORT --model "$path" --load-format dummy --disable-log-requests \
    --uvicorn-log-level warning > /tmp/server-$MODEL.log 2>&1 &
  SRV=$!
  until $PY -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; do
    if ! kill -0 $SRV 2>/dev/null; then echo "server exited:"; tail -30 /tmp/server-$MODEL.log; continue 2; fi
    sleep 0.5
  done
  echo "   /health 200 after $(( $(date +%s) - t0 )) s"
  grep -E "Run config|Compiled [0-9]+ buckets" /tmp/server-$MODEL.log | sed 's/^/   /'
  timeout 420 $PY "$REPO/bench/sampler_stall.py" --base-url "http://127.0.0.1:$PORT" --server-log /tmp/server-$MODEL.log \
    --name "sampler-stall-$MODEL" 2>&1 | tail -8 | sed 's/^/   /'
  kill -TERM $SRV; wait $SRV; echo "   server exit status $?"
  grep -E "sampler variant|head and sampler|Traceback|Error|XLA compile seconds" /tmp/server-$MODEL.log | head -30 | sed 's/^/   log: /'
  # each model's files as soon as they are there: a call that runs past its limit keeps the earlier models'
  if [ -n "${OUT:-}" ]; then
    (cd "$REPO/bench/results" && tar -czf "$OUT/sampler_stall-$MODEL.tgz" sampler-stall-$MODEL.* \
       $(ls throughput-$MODEL-sharegpt.* 2>/dev/null) -C /tmp server-$MODEL.log)
  fi
done
