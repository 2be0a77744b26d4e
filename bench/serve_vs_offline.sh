#!/usr/bin/env bash
# The server against the engine (issue "the server at the engine's speed"), one model per device call:
#   bash bench/serve_vs_offline.sh qwen2-0.5b|llama3-8b [--sweep] [--sweep-prompts N] [--cold-server]
#        [--server-only] [--py-spy] [--soak [--soak-args "FLAGS"]] [--api-server-counts 1,2,4] [--rinf-settled]
#        [--warm-restart]
# carry=[".whl", ".cache/gpu"] (bash bench/prepare_gpu_suite.sh here first). In order, in one call:
#   1. offline LLM.generate, ShareGPT 1000 (bench/throughput.py; compiles, fills the executable cache)
#   2. the server (--load-format dummy, everything else default): seconds to /health 200 (warm: step 1's
#      caches; --cold-server: a fresh cache root, so it compiles)
#   3. ShareGPT 1000 over HTTP at request rate inf (bench/serve.py)
#   4. openqa at concurrency 1 (28 in / 300 out, 20 requests): median TPOT
#   5. --sweep: ShareGPT N (--sweep-prompts, default 200) at Poisson rates 4, 16, 64 req/s (throughput,
#      p50/p99 TTFT/TPOT, goodput, plot); 1000 prompts take about 330 s
# --server-only skips step 1. --py-spy samples the server's processes (API and engine core, idle time
# included) with py-spy (its wheel in .whl/) through steps 3-5, into $OUT/pyspy-server.json.gz and its summary
# (bench/pyspy_summary.py) $OUT/pyspy-summary.txt. --py-spy-gil: the same with py-spy's --gil, only the samples of
# the thread that holds the GIL (what keeps the others waiting).
# --soak runs only step 2, then bench/soak.py against that server (its RSS through --server-pid, its log
# checked) with FLAGS (default: --request-rate 64), and returns soak-MODEL.{json,md,png} in $OUT. Its 12000
# ShareGPT prompts are in .cache/gpu_soak (prepare_gpu_suite.sh): carry [".whl", ".cache/gpu_soak",
# ".cache/gpu/bench_models", ".cache/gpu/GIT_REV"] (with all of .cache/gpu the carry passes 64 MiB).
# --api-server-counts N,M,...: steps 2-5 once per --api-server-count, a fresh server each, the results named
# ...-apiN, or ...-apiN-rK for the K-th of a count given more than once (2,4,2,4: an alternating A/B); default:
# one server at its own default count, results unsuffixed. --client-loops asyncio,uvloop: step 3 once per client event
# loop (bench/serve.py --event-loop; default asyncio, as vLLM's client), uvloop's results named ...-uvloop;
# each (count, loop) gets a fresh server. --client-processes K: step 3 sends from K processes (bench/serve.py
# --client-processes), its results named ...-cpK.
# --server-args "FLAGS": more server flags (e.g. "--num-scheduler-steps 16 --max-num-seqs 4"); --c1-only skips
# step 3 (the server's c1 figure under other flags without a ShareGPT run). --c1-settled: step 4 again once the
# server's background compiles (the common sampler variants' heads, logged when done) have finished, results
# named ...-settled: a cold server's first requests against its settled speed, on one machine. --rinf-settled:
# step 3 starts only once those compiles are done (a cold server's burst otherwise runs inside them; a second
# burst on the same server would find its prompts in the prefix cache), its results named ...-rinf-settled.
# --core-step-log: the server's engine core logs its steps and arrivals (JAXPAGED_STEP_LOG), and the burst's
# first steps are printed (bench/core_steps.py) after the server stops; the CSVs go to $OUT.
# --warm-restart: after the rest, the server started once more on the same cache root (a warm start-up: its
# executables loaded, nothing compiled), its seconds to /health 200, then stopped.
# Results (JSON with device, JAX version, revision) go to bench/results/ and, when set, $OUT.
set -u
cd "$(dirname "$0")/.." || exit 1
MODEL=${1:?model: qwen2-0.5b or llama3-8b}; shift
SWEEP=0; COLD=0; SWEEP_PROMPTS=200; OFFLINE=1; PYSPY=0; SOAK=0; SOAK_ARGS="--request-rate 64"; COUNTS=default; LOOPS=asyncio; CPROCS=1
SERVER_ARGS=""; C1_ONLY=0; C1_SETTLED=0; RINF_SETTLED=0; SPY_GIL=(); WARM_RESTART=0; CORE_LOG=0
while [ $# -gt 0 ]; do
  case $1 in --sweep) SWEEP=1 ;; --cold-server) COLD=1 ;; --sweep-prompts) SWEEP_PROMPTS=$2; shift ;;
             --server-only) OFFLINE=0 ;; --py-spy) PYSPY=1 ;; --py-spy-gil) PYSPY=1; SPY_GIL=(--gil) ;; --soak) SOAK=1; OFFLINE=0 ;;
             --soak-args) SOAK_ARGS=$2; shift ;; --api-server-counts) COUNTS=$2; shift ;;
             --client-loops) LOOPS=$2; shift ;; --client-processes) CPROCS=$2; shift ;;
             --server-args) SERVER_ARGS=$2; shift ;; --c1-only) C1_ONLY=1 ;; --c1-settled) C1_SETTLED=1 ;;
             --rinf-settled) RINF_SETTLED=1 ;; --warm-restart) WARM_RESTART=1 ;; --core-step-log) CORE_LOG=1 ;; esac
  shift
done
RINF=rinf; [ $RINF_SETTLED = 1 ] && RINF=rinf-settled      # step 3's result name
source bench/gpu_env.sh
echo "serve_vs_offline $MODEL: rev $JAXPAGED_GIT_REV, $($PY -c 'import jax; print(jax.__version__, jax.devices()[0].device_kind)' 2>&1 | tail -1)"
path=$($PY -c "from bench.models import resolve_model; print(resolve_model('$MODEL')[0])" 2>/dev/null \
       || PYTHONPATH=$REPO:$PYTHONPATH $PY -c "from bench.models import resolve_model; print(resolve_model('$MODEL')[0])")
BENCH=$REPO/bench
ms() { echo $(( $(date +%s%N) / 1000000 )); }
secs() { local d=$(( $(ms) - $1 )); printf "%d.%03d" $((d / 1000)) $((d % 1000)); }

if [ $OFFLINE = 1 ]; then
  echo "== 1. offline ShareGPT 1000"
  t0=$(ms)
  $PY "$BENCH/throughput.py" --no-tqdm --dataset sharegpt --model "$MODEL" 2>&1 | grep -E "Throughput|Run config|Compiled|startup|Error|error" | tail -8
  echo "   ($(secs $t0) s)"
fi

[ $COLD = 1 ] && export JAXPAGED_CACHE_ROOT=/tmp/jaxpaged-cold-cache
PORT=8011
client() { $PY "$BENCH/serve.py" --base-url "http://127.0.0.1:$PORT" --model "$MODEL" --disable-tqdm "$@" 2>&1 \
  | grep -E "Successful|Failed|Benchmark duration|Output token throughput|Mean TTFT|Median TTFT|P99 TTFT|Median TPOT|P99 TPOT|Mean TPOT|Request goodput|rate|admitted|sent at|Server-side|First-token waves|first token:" | sed 's/^/   /'; }
wait_health() {   # until /health answers 200 (0), or the server $SRV exits (its log's tail, 1)
  until $PY -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; do
    if ! kill -0 $SRV 2>/dev/null; then echo "server exited:"; tail -30 "$1"; return 1; fi
    sleep 0.2
  done
}
wait_settled() {   # until the server's log says its background compiles (the common variants' heads) are done
  for _ in $(seq 1200); do grep -q "common sampler variants" /tmp/server.log && break; sleep 0.5; done
  grep -E "in the background" /tmp/server.log | sed 's/^.*INFO[^:]*: */   /'
}
# A fresh server for each (count, client loop): a second run on one server would find its prompts in the
# prefix cache.
declare -A SEEN      # a count given more than once (alternating A/B): each repeat's results named ...-apiN-rK
for N in ${COUNTS//,/ }; do
SEEN[$N]=$(( ${SEEN[$N]:-0} + 1 ))
REP=$([ "$(echo ",$COUNTS," | grep -o ",$N," | wc -l)" -gt 1 ] && echo "-r${SEEN[$N]}")
for LOOP in ${LOOPS//,/ }; do
SUFFIX=$([ "$N" = default ] || echo "-api$N")$REP
APIFLAG=$([ "$N" = default ] || echo "--api-server-count $N")
LSUFFIX=$([ "$LOOP" = asyncio ] || echo "-$LOOP")$([ "$CPROCS" = 1 ] || echo "-cp$CPROCS")
echo "== 2. server start-up (--api-server-count $N)"
t0=$(ms)
SPY=()
if [ $PYSPY = 1 ]; then
  [ -x /tmp/site/bin/py-spy ] || $PY -m pip install -q --no-index --no-deps --target /tmp/site "$REPO"/.whl/py_spy-*.whl
  SPY=(/tmp/site/bin/py-spy record -r 200 -f speedscope --subprocesses --idle "${SPY_GIL[@]}" --nonblocking -o /tmp/pyspy-server.json --)
fi
STEPS_CSV=/tmp/core-steps$SUFFIX$LSUFFIX.csv
[ $CORE_LOG = 1 ] && export JAXPAGED_STEP_LOG=$STEPS_CSV
"${SPY[@]}" $PY -m jaxpaged.server --port $PORT --model "$path" --load-format dummy --disable-log-requests \
  --uvicorn-log-level warning $APIFLAG $SERVER_ARGS > /tmp/server.log 2>&1 &
SRV=$!
wait_health /tmp/server.log || { [ -n "${OUT:-}" ] && cp /tmp/server.log "$OUT/server-$MODEL-failed.log"; exit 1; }
echo "   /health 200 after $(secs $t0) s ($([ $COLD = 1 ] && echo cold || echo warm))"
grep -E "Run config|Compiled|engine core ready|API server processes" /tmp/server.log | sed 's/^/   /'
if [ $SOAK = 1 ]; then
  [ -d "$REPO/.cache/gpu_soak/bench_data" ] && export JAXPAGED_BENCH_DATA="$REPO/.cache/gpu_soak/bench_data"
  echo "== soak: bench/soak.py $SOAK_ARGS"
  # shellcheck disable=SC2086  # SOAK_ARGS is a list of flags
  $PY "$BENCH/soak.py" --base-url "http://127.0.0.1:$PORT" --server-pid $SRV --server-log /tmp/server.log \
    --model "$MODEL" --disable-tqdm $SOAK_ARGS 2>&1 | sed 's/^/   /'
  kill -TERM $SRV; wait $SRV; echo "   server exit status $?"
  if [ -n "${OUT:-}" ]; then
    cp "$REPO"/bench/results/soak-"$MODEL".{json,md,png} "$OUT/" 2>/dev/null; cp /tmp/server.log "$OUT/server-$MODEL.log"
  fi
  exit 0
fi
if [ $C1_ONLY = 0 ]; then
[ $RINF_SETTLED = 1 ] && wait_settled
echo "== 3. ShareGPT 1000 over HTTP, request rate inf (client: $CPROCS process(es) on $LOOP)"
client --dataset sharegpt --save-per-request --event-loop "$LOOP" --client-processes "$CPROCS" \
  --result-name "serve-$MODEL-sharegpt-$RINF$SUFFIX$LSUFFIX"
fi
echo "== 4. openqa, concurrency 1"
client --dataset openqa --max-concurrency 1 --num-prompts 20 --event-loop "$LOOP" \
  --result-name "serve-$MODEL-openqa-c1$SUFFIX$LSUFFIX"
if [ $C1_SETTLED = 1 ]; then
  echo "== 4b. openqa, concurrency 1, once the background compiles are done"
  wait_settled
  client --dataset openqa --max-concurrency 1 --num-prompts 20 --event-loop "$LOOP" \
    --result-name "serve-$MODEL-openqa-c1-settled$SUFFIX$LSUFFIX"
fi
if [ $SWEEP = 1 ]; then
  echo "== 5. ShareGPT $SWEEP_PROMPTS, Poisson rates 4, 16, 64"
  client --dataset sharegpt --num-prompts "$SWEEP_PROMPTS" --request-rates 4,16,64 \
    --event-loop "$LOOP" --result-name "serve-$MODEL-sharegpt$SWEEP_PROMPTS-sweep$SUFFIX$LSUFFIX"
fi
if [ $PYSPY = 1 ]; then    # py-spy writes its file on SIGINT; the server goes on, so stop it after
  kill -INT $SRV; wait $SRV; pkill -TERM -f "jaxpaged.server --port $PORT"; sleep 5
  $PY "$BENCH/pyspy_summary.py" /tmp/pyspy-server.json --window-s 0.1 > /tmp/pyspy-summary$SUFFIX$LSUFFIX.txt
  [ -n "${OUT:-}" ] && cp /tmp/pyspy-summary$SUFFIX$LSUFFIX.txt "$OUT/" \
    && gzip -c /tmp/pyspy-server.json > "$OUT/pyspy-server$SUFFIX$LSUFFIX.json.gz"
else
  kill -TERM $SRV; wait $SRV; echo "   server exit status $?"
fi
tail -5 /tmp/server.log | sed 's/^/   log: /'
if [ $CORE_LOG = 1 ]; then
  unset JAXPAGED_STEP_LOG
  echo "== the burst's first steps (bench/core_steps.py)"
  RINF_JSON="$REPO/bench/results/serve-$MODEL-sharegpt-$RINF$SUFFIX$LSUFFIX.json"
  # shellcheck disable=SC2046  # (no --client when the rate-inf run did not run)
  $PY "$BENCH/core_steps.py" "$STEPS_CSV" --steps 24 $([ -f "$RINF_JSON" ] && echo --client "$RINF_JSON") 2>&1 \
    | sed 's/^/   /'
  [ -n "${OUT:-}" ] && tar -czf "$OUT/core-steps$SUFFIX$LSUFFIX.tgz" -C /tmp "$(basename "$STEPS_CSV")" \
    "$(basename "${STEPS_CSV%.csv}")-arrivals.csv"
fi
[ -n "${OUT:-}" ] && cp /tmp/server.log "$OUT/server-$MODEL$SUFFIX$LSUFFIX.log"
done
done
if [ $WARM_RESTART = 1 ]; then
  echo "== 6. warm restart on the same cache root"
  t0=$(ms)
  $PY -m jaxpaged.server --port $PORT --model "$path" --load-format dummy --disable-log-requests \
    --uvicorn-log-level warning $SERVER_ARGS > /tmp/server-warm.log 2>&1 &
  SRV=$!
  if wait_health /tmp/server-warm.log; then
    echo "   /health 200 after $(secs $t0) s (warm)"
    grep -E "Compiled|engine core ready" /tmp/server-warm.log | sed 's/^/   /'
    kill -TERM $SRV; wait $SRV; echo "   server exit status $?"
  fi
  [ -n "${OUT:-}" ] && cp /tmp/server-warm.log "$OUT/server-$MODEL-warm.log"
fi
echo "== summary ($MODEL, rev $JAXPAGED_GIT_REV)"
$PY - "$REPO/bench/results" "$MODEL" "$COUNTS" "$LOOPS" "$CPROCS" "$RINF" <<'PYEOF'
import json, sys
from pathlib import Path
res, model, counts, loops = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(","), sys.argv[4].split(",")
cprocs = "" if sys.argv[5] == "1" else f"-cp{sys.argv[5]}"
rinf = sys.argv[6]
def load(name):
    p = res / f"{name}.json"
    return json.loads(p.read_text()).get("metrics", {}) if p.exists() else {}
o = load(f"throughput-{model}-sharegpt").get("output_tokens_per_second")
print(f"   offline output tok/s {o}")
for i, n in enumerate(counts):
    suffix = ("" if n == "default" else f"-api{n}") + (f"-r{counts[:i + 1].count(n)}" if counts.count(n) > 1 else "")
    for loop in loops:
        lsuffix = ("" if loop == "asyncio" else f"-{loop}") + cprocs
        inf = load(f"serve-{model}-sharegpt-{rinf}{suffix}{lsuffix}")
        c1 = load(f"serve-{model}-openqa-c1{suffix}{lsuffix}")
        s = inf.get("output_throughput")
        print(f"   --api-server-count {n}{suffix[len(f'-api{n}'):] if n != 'default' else ''}, client {loop}{cprocs}: "
              f"server rate inf{' (settled)' if rinf != 'rinf' else ''} {s}"
              + (f" ({s / o:.1%} of offline)" if o and s else "")
              + f", median TTFT {inf.get('median_ttft_ms')} ms (server-side mean {inf.get('server_mean_ttft_ms')}"
              f" ms), median TPOT {inf.get('median_tpot_ms')} ms; openqa c1 median TPOT {c1.get('median_tpot_ms')} ms")
PYEOF
if [ -n "${OUT:-}" ]; then     # one archive: the device returns a limited number of files
  (cd "$REPO/bench/results" && find . -maxdepth 1 -type f \( -name "throughput-$MODEL-sharegpt*" -o -name "serve-$MODEL*" \) \
     -mmin -30 -print0 | tar -czf "$OUT/serve_vs_offline-$MODEL.tgz" --null -T -)
fi
