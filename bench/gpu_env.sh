# Sourced by the GPU scripts (bench/serve_vs_offline.sh, bench/cold_start.sh), from the repository root:
# installs what the GPU image lacks and jaxpaged itself outside the repository, exports the benchmark
# environment and leaves the shell in /tmp. Sets REPO and PY.
#   source bench/gpu_env.sh            (carry=[".whl", ".cache/gpu"]; bash bench/prepare_gpu_suite.sh here first)
REPO=$(pwd)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# Installed with their bytecode, as pip installs for users: the image sets PYTHONDONTWRITEBYTECODE, so without
# it every start of the server (and of its core process) compiles pydantic, FastAPI and jaxpaged from source
# again, ~15-20 s of each start-up to /health.
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.jaxpaged-compiled ]; then
  $PY -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.jaxpaged-compiled || echo "WARNING: wheel install failed"
fi
# The image's own site-packages miss part of their bytecode too (transformers' import took ~10 s of each
# API-process start): compile it once per machine, as any pip-installed environment has it.
if [ ! -f /tmp/site/.image-bytecode ]; then
  $PY -m compileall -q -j 0 "$($PY -c 'import os, transformers; print(os.path.dirname(os.path.dirname(transformers.__file__)))')" \
    >/dev/null 2>&1; mkdir -p /tmp/site && touch /tmp/site/.image-bytecode
fi
rm -rf /tmp/jp "$REPO/build"
$PY -m pip install -q --no-deps --no-index --no-build-isolation --target /tmp/jp "$REPO" \
  || { echo "ERROR: installing jaxpaged into /tmp/jp failed"; exit 1; }
export PYTHONPATH=/tmp/jp:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export JAXPAGED_BENCH_MODELS=${JAXPAGED_BENCH_MODELS:-$REPO/.cache/gpu/bench_models}
export JAXPAGED_BENCH_DATA=${JAXPAGED_BENCH_DATA:-$REPO/.cache/gpu/bench_data}
JAXPAGED_GIT_REV=${JAXPAGED_GIT_REV:-$(cat .cache/gpu/GIT_REV 2>/dev/null || echo unknown)}
export JAXPAGED_GIT_REV
cd /tmp || exit 1          # run outside the repository: its folders must not shadow the installed jaxpaged
