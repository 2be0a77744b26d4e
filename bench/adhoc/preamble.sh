# Sourced by the one-off GPU scripts here, from the repository root on the device: the carried wheels and
# jaxpaged installed under /tmp, the bench inputs from .cache/gpu, a work folder outside the repository
# (so the installed jaxpaged is imported), R = the repository, and `el WHAT` printing the elapsed time.
R=$(pwd); source bench/gpu_setup.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/jp:/tmp/site JAXPAGED_BENCH_MODELS=$R/.cache/gpu/bench_models JAXPAGED_BENCH_DATA=$R/.cache/gpu/bench_data JAXPAGED_GIT_REV=$(cat .cache/gpu/GIT_REV)
mkdir -p /tmp/w && cd /tmp/w || exit 1
T0=$(date +%s); el() { echo "== t=$(( $(date +%s) - T0 ))s $*"; }
