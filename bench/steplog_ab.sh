#!/usr/bin/env bash
# A base revision against this tree by their step logs, one device call: offline ShareGPT 1000 with
# --step-log for each, in turn (new, base, new, base ... while --rounds and --deadline-s allow), then each
# run's seconds in mixed steps (those with prompt tokens) and in decode steps, and its throughput.
#   bash bench/steplog_ab.sh MODEL [--rounds N] [--deadline-s S] [--pre "COMMAND"]
# carry=[".whl", ".cache/gpu", ".cache/ab"] (bash bench/prepare_ab.sh BASE here first). --pre runs COMMAND
# first (a kernel probe, the GPU kernel tests), from /tmp with the new tree installed there and $PY, $REPO set:
#   --pre '$PY $REPO/bench/mixed_attention_probe.py --out $OUT'   (single quotes: expanded here, not by the caller)
# Step logs and results: $OUT/steps-{new,base}-rK.csv and the table steplog_ab.md.
set -u
cd "$(dirname "$0")/.." || exit 1
MODEL=${1:?model}; shift
ROUNDS=2; DEADLINE=560; PRE=""
while [ $# -gt 0 ]; do
  case $1 in --rounds) ROUNDS=$2; shift ;; --deadline-s) DEADLINE=$2; shift ;; --pre) PRE=$2; shift ;;
             *) echo "unknown argument $1"; exit 2 ;; esac
  shift
done
START=$(date +%s)
source bench/gpu_env.sh          # the new tree in /tmp/jp, the wheels in /tmp/site; cwd /tmp
[ -f "$REPO/.cache/ab/base/AB_REV" ] || { echo "no .cache/ab/base: bash bench/prepare_ab.sh BASE here first"; exit 1; }
rm -rf /tmp/jp-base "$REPO/.cache/ab/base/build"
$PY -m pip install -q --no-deps --no-index --no-build-isolation --target /tmp/jp-base "$REPO/.cache/ab/base" \
  || { echo "installing the base failed"; exit 1; }
echo "steplog_ab $MODEL: new $JAXPAGED_GIT_REV, base $(cat "$REPO/.cache/ab/base/AB_REV"), \
$($PY -c 'import jax; print(jax.__version__, jax.devices()[0].device_kind)' 2>&1 | tail -1)"
if [ -n "$PRE" ]; then
  echo "== pre: $PRE"
  eval "$PRE" 2>&1 | grep -v -i "warning" | tail -30
fi
OUTDIR=${OUT:-/tmp/steplog_ab}; mkdir -p "$OUTDIR"
for r in $(seq "$ROUNDS"); do
  for arm in new base; do
    if [ $(( $(date +%s) - START )) -gt "$DEADLINE" ]; then echo "deadline: $arm round $r not run"; continue; fi
    site=/tmp/jp; [ $arm = base ] && site=/tmp/jp-base
    t0=$(date +%s)
    PYTHONPATH=$site:/tmp/site JAXPAGED_GIT_REV=$JAXPAGED_GIT_REV $PY "$REPO/bench/throughput.py" --no-tqdm \
      --dataset sharegpt --model "$MODEL" --step-log "$OUTDIR/steps-$arm-r$r.csv" --result-name "steplog-$arm-r$r" \
      2>&1 | grep -E "Throughput|Error" | sed "s/^/   $arm r$r: /"
    echo "   ($(( $(date +%s) - t0 )) s)"
  done
done
$PY - "$OUTDIR" <<'PYEOF' | tee "$OUTDIR/steplog_ab.md"
import sys
from pathlib import Path
import numpy as np
rows = []
for f in sorted(Path(sys.argv[1]).glob("steps-*.csv")):
    a = np.loadtxt(f, delimiter=",", ndmin=2)            # seconds, tokens, requests, context, gc, gc2
    mixed = a[:, 1] > a[:, 2]                            # more tokens than requests: prompt tokens in the step
    later = mixed.copy(); later[np.argmax(mixed)] = False   # the first step also holds the run's start
    rows.append((f.stem, a[:, 0].sum(), a[mixed, 0].sum(), int(mixed.sum()), np.median(a[later, 0]) * 1e3,
                 a[~mixed, 0].sum(), int((~mixed).sum())))
print("| run | seconds | mixed steps s (count) | median mixed step after the first, ms | decode steps s (count) |")
print("|---|---|---|---|---|")
for name, total, ms, mn, med, ds, dn in rows:
    print(f"| {name} | {total:.3f} | {ms:.3f} ({mn}) | {med:.1f} | {ds:.3f} ({dn}) |")
PYEOF
