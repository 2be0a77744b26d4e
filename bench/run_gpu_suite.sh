#!/usr/bin/env bash
# The GPU benchmark suite (issue 6). On the device machine, from the repository root:
#   bash bench/run_gpu_suite.sh [qwen|llama|serve|all ...] [--smoke] [--deadline-s S]
# Needs what bench/prepare_gpu_suite.sh made here: .whl/ (server wheels) and .cache/gpu/ (tokenizer
# sources, the tokenized ShareGPT samples, GIT_REV); carry both: carry=[".whl", ".cache/gpu"].
# Each part fits one 10-minute device command; all three take ~25 min.
set -u
cd "$(dirname "$0")/.." || exit 1
REPO=$(pwd)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# 1. Carried wheels (fastapi, starlette, pydantic, uvicorn, gguf, ...) -> /tmp/site.
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.jaxpaged-done ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.jaxpaged-done || echo "WARNING: wheel install failed"
fi
# 2. jaxpaged itself -> /tmp/jp: its subpackages live in top-level folders (models/ -> jaxpaged.models,
#    via pyproject's package-dir), which PYTHONPATH alone cannot map.
rm -rf /tmp/jp
$PY -m pip install -q --no-deps --no-index --no-build-isolation --no-compile --target /tmp/jp "$REPO" \
  || { echo "ERROR: installing jaxpaged into /tmp/jp failed"; exit 1; }
export PYTHONPATH=/tmp/jp:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# 3. Where the carried, pre-built inputs are; results stay in bench/results/.
export JAXPAGED_BENCH_MODELS=${JAXPAGED_BENCH_MODELS:-$REPO/.cache/gpu/bench_models}
export JAXPAGED_BENCH_DATA=${JAXPAGED_BENCH_DATA:-$REPO/.cache/gpu/bench_data}
if [ -z "${JAXPAGED_GIT_REV:-}" ]; then
  # GIT_REV (written by prepare_gpu_suite.sh here) first: a .git in the device's copy may be stale
  JAXPAGED_GIT_REV=$(cat "$REPO/.cache/gpu/GIT_REV" 2>/dev/null || git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)
  export JAXPAGED_GIT_REV
fi
echo "jaxpaged suite: rev $JAXPAGED_GIT_REV, $($PY -c 'import jax; print(jax.__version__, jax.devices()[0].device_kind)' 2>&1 | tail -1)"
exec $PY "$REPO/bench/run_gpu_suite.py" "$@"
