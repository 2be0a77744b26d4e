#!/usr/bin/env bash
# A/B of the base revision against this working tree on one machine (bench/ab_compare.py says what runs).
# On the device machine, from the repository root, after bash bench/prepare_ab.sh here:
#   bash bench/ab_compare.sh qwen|serve|llama [--rounds N] [--deadline-s S]   carry=[".whl", ".cache/gpu", ".cache/ab"]
# On the CPU: bash bench/ab_compare.sh --smoke qwen serve llama --rounds 1   (tiny-llama, 8 prompts)
set -u
cd "$(dirname "$0")/.." || exit 1
REPO=$(pwd)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export AB_ROOT=${AB_ROOT:-/tmp/jaxpaged-ab}
if [ ! -f .cache/ab/base/AB_REV ]; then
  echo "ERROR: no .cache/ab/base: run bash bench/prepare_ab.sh first, carry .cache/ab"; exit 1
fi
# Carried wheels (fastapi, uvicorn, ...) -> /tmp/site, as bench/run_gpu_suite.sh does (not for --smoke: the
# wheels are for the device's Python 3.12).
case " $* " in *" --smoke "*) SMOKE=1 ;; *) SMOKE=0 ;; esac
if [ $SMOKE = 0 ] && [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.jaxpaged-done ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.jaxpaged-done || echo "WARNING: wheel install failed"
fi
[ $SMOKE = 0 ] && [ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# Each revision into its own folder (jaxpaged's subpackages live in top-level folders: PYTHONPATH alone
# cannot map them); bench/ab_compare.py puts the right one first on each run's PYTHONPATH.
for rev in base new; do
  src=$REPO; [ $rev = base ] && src=$REPO/.cache/ab/base
  rm -rf "$AB_ROOT/$rev/site" "$src/build"     # setuptools would install a stale build/lib's deleted modules too
  $PY -m pip install -q --no-deps --no-index --no-build-isolation --no-compile --target "$AB_ROOT/$rev/site" "$src" \
    || { echo "ERROR: installing $rev ($src) into $AB_ROOT/$rev/site failed"; exit 1; }
done
if [ $SMOKE = 0 ]; then   # the carried inputs (--smoke: bench/common.py's defaults, so .cache/gpu stays small)
  export JAXPAGED_BENCH_MODELS=${JAXPAGED_BENCH_MODELS:-$REPO/.cache/gpu/bench_models}
  export JAXPAGED_BENCH_DATA=${JAXPAGED_BENCH_DATA:-$REPO/.cache/gpu/bench_data}
fi
if [ -z "${JAXPAGED_GIT_REV:-}" ]; then   # the new revision; GIT_REV first (a .git in the device's copy may be stale)
  JAXPAGED_GIT_REV=$(cat .cache/gpu/GIT_REV 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
  export JAXPAGED_GIT_REV
fi
exec $PY "$REPO/bench/ab_compare.py" "$@"
