#!/usr/bin/env bash
# Run HERE (not on the GPU machine), from anywhere, right before an A/B run (bench/ab_compare.sh):
#   bash bench/prepare_ab.sh [BASE]          BASE: a git revision, default the tag base-s14
# Makes what the A/B carries, all git-ignored (/.whl/, /.cache/):
#   .whl/ and .cache/gpu/   bench/prepare_gpu_suite.sh's wheels, tokenizer sources, ShareGPT samples, GIT_REV
#   .cache/ab/base/         BASE's tree (git archive, without bench/results), its full hash in AB_REV
# The ShareGPT samples are also cached with BASE's own bench/datasets.py (a no-op where its cache key is the
# working tree's). Then, on the device: carry=[".whl", ".cache/gpu", ".cache/ab"], bash bench/ab_compare.sh PART.
set -eu
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
BASE=${1:-base-s14}
rev=$(git rev-parse --verify "$BASE^{commit}")
bash bench/prepare_gpu_suite.sh >/dev/null
rm -rf .cache/ab/base
mkdir -p .cache/ab/base
git archive "$rev" -- . ':(exclude)bench/results' | tar -x -C .cache/ab/base
echo "$rev" > .cache/ab/base/AB_REV
for m in qwen2-0.5b llama3-8b; do
  (cd .cache/ab/base && JAXPAGED_BENCH_DATA=$REPO/.cache/gpu/bench_data \
    $PY -m bench.datasets --dataset sharegpt --model $m --num-prompts 1000 | tr -d '\n' | cut -c1-100; echo)
done
du -sh .whl .cache/gpu .cache/ab
tracked=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
echo "base $BASE = $rev; new = $(cat .cache/gpu/GIT_REV). Tracked files: $tracked bytes"
echo "Device: carry [\".whl\", \".cache/gpu\", \".cache/ab\"]; run: bash bench/ab_compare.sh qwen | serve | llama"
