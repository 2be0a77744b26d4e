#!/usr/bin/env bash
# A/B of models/decoder.py's kernel switches on one request's decode step, in one device call: for each
# MODEL:SWITCH, bench/step_kernels.py with the switch False, then True, then False again (one process each, the
# compile caches off in every arm), and a table of the untraced step and the kernels that changed.
#   bash bench/kernel_ab.sh MODEL:SWITCH [MODEL:SWITCH ...] [--ctx N] [--deadline-s S]
#   bash bench/kernel_ab.sh llama3-8b-awq:ROPE_WRITES_KV qwen3-8b-awq:ROPE_QK_NORM llama3-8b:DENSE_ROPE_KERNEL
# carry=[".whl", ".cache/gpu"] (bash bench/prepare_gpu_suite.sh here first). Each arm's table and log go to
# $OUT (or /tmp/kernel_ab) as MODEL-SWITCH-ARM-kernels.txt and -log.txt, one folder deep: the device tool returns
# no deeper files. Stops starting arms past --deadline-s (default 540).
set -u
cd "$(dirname "$0")/.." || exit 1
PAIRS=(); CTX=300; DEADLINE=540
while [ $# -gt 0 ]; do
  case $1 in --ctx) CTX=$2; shift ;; --deadline-s) DEADLINE=$2; shift ;; *:*) PAIRS+=("$1") ;;
             *) echo "unknown argument $1 (MODEL:SWITCH, --ctx, --deadline-s)"; exit 2 ;; esac
  shift
done
[ ${#PAIRS[@]} -gt 0 ] || { echo "give at least one MODEL:SWITCH"; exit 2; }
START=$(date +%s)
OUTDIR=${OUT:-/tmp/kernel_ab}
source bench/gpu_env.sh
echo "kernel_ab: rev $JAXPAGED_GIT_REV, $($PY -c 'import jax; print(jax.__version__, jax.devices()[0].device_kind)' 2>&1 | tail -1)"
for pair in "${PAIRS[@]}"; do
  model=${pair%%:*}; switch=${pair#*:}
  for arm in off on off2; do
    if [ $(( $(date +%s) - START )) -gt "$DEADLINE" ]; then echo "== $model $switch $arm: past the deadline, not run"; continue; fi
    value=False; [ $arm = on ] && value=True
    name=$OUTDIR/$model-$switch-$arm
    mkdir -p "$OUTDIR"
    timeout 240 $PY "$REPO/bench/step_kernels.py" --model "$model" --rows 1 --ctx "$CTX" \
      --set "jaxpaged.models.decoder.$switch=$value" --out "/tmp/kab-$model-$switch-$arm" > "$name-log.txt" 2>&1
    rc=$?
    cp "/tmp/kab-$model-$switch-$arm/kernels.txt" "$name-kernels.txt" 2>/dev/null
    echo "== $model $switch=$value ($arm) rc=$rc: $(grep -o 'untraced, back to back: [0-9.]* us' "$name-kernels.txt" 2>/dev/null \
      || tail -2 "$name-log.txt")"
  done
  # the kernels whose time a step moved by more than 1 us between the first off arm and the on arm
  $PY - "$OUTDIR/$model-$switch" <<'EOF'
import pathlib
import sys
base = sys.argv[1]
def load(arm):
    path = pathlib.Path(f"{base}-{arm}-kernels.txt")
    rows = {}
    for line in path.read_text().splitlines()[4:] if path.exists() else []:
        parts = line.split()
        if len(parts) >= 4:
            try:
                rows[parts[0]] = float(parts[3])
            except ValueError:
                pass
    return rows
off, on = load("off"), load("on")
for name in sorted(set(off) | set(on), key=lambda n: -abs(on.get(n, 0) - off.get(n, 0))):
    delta = on.get(name, 0) - off.get(name, 0)
    if abs(delta) > 1:
        print(f"   {name:<48} {off.get(name, 0):9.1f} -> {on.get(name, 0):9.1f} us a step")
EOF
done
