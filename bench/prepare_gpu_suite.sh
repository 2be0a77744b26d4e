#!/usr/bin/env bash
# Run HERE (not on the GPU machine), from anywhere, right before a GPU run: makes what the suite carries.
#   .whl/        wheels the GPU image lacks (server stack, gguf, pytest for tests/kernels), Python 3.12
#                manylinux x86_64; names already there are kept (one version of each: two stop the whole install)
#   .cache/gpu/  bench_models/_sources/  the tiktoken files the tokenizers are built from (5 MB, not 36 MB
#                                        of tokenizer.json); bench/models.py builds the folders there
#                bench_data/             the tokenized ShareGPT samples (the 125 MB dataset stays here)
#                GIT_REV                 the revision (the GPU copy has no .git)
# Both folders are git-ignored (/.whl/, /.cache/); name them in the device call's carry:
#   carry=[".whl", ".cache/gpu"], command="bash bench/run_gpu_suite.sh qwen"   (then llama, then serve)
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .whl .cache/gpu/bench_models/_sources .cache/gpu/bench_data
WHEELS="fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.3 pydantic-core==2.50.4 uvicorn==0.54.0
annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 gguf==0.19.0 opentelemetry-api==1.45.2
pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 pytest-timeout==2.4.0 pyzmq==27.3.0 msgspec==0.22.0 httptools==0.9.0 uvloop==0.23.0"
for spec in $WHEELS; do
  name=${spec%%==*}; stem=$(echo "$name" | tr '-' '_')
  if ls .whl/ 2>/dev/null | grep -qi "^${stem}-"; then continue; fi
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$spec" || echo "WARNING: could not download $spec"
done
# Tokenizer sources (bench/models.py TIKTOKEN_SOURCES), found in the installed packages.
$PY - <<'PY'
import shutil
from pathlib import Path
from bench.models import TIKTOKEN_SOURCES, tiktoken_file
root = Path(".cache/gpu/bench_models/_sources")
for kind, (pkg, rel) in TIKTOKEN_SOURCES.items():
    dst = root / pkg / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(tiktoken_file(kind), dst)
    print("tokenizer source:", dst)
PY
# The ShareGPT samples, tokenized with each model's tokenizer (the cache key the GPU run looks up).
# 1000 prompts for the throughput runs, 64 for the profiled run (its trace stays small), 200 spare; 12000
# for qwen2-0.5b's soak (bench/soak.py's default phases, 10000 + 2000), in .cache/gpu_soak: at 27 MB it would take
# the everyday carry past the device's 64 MiB (bench/serve_vs_offline.sh --soak says what to carry instead).
for m in qwen2-0.5b llama3-8b; do
  for n in 1000 200 64; do
    JAXPAGED_BENCH_DATA=.cache/gpu/bench_data $PY -m bench.datasets --dataset sharegpt --model $m --num-prompts $n \
      | tr -d '\n' | cut -c1-160; echo
  done
done
JAXPAGED_BENCH_DATA=.cache/gpu_soak/bench_data $PY -m bench.datasets --dataset sharegpt --model qwen2-0.5b \
  --num-prompts 12000 | tr -d '\n' | cut -c1-160; echo
rev=$(git rev-parse HEAD)
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then rev="$rev-dirty"; fi
echo "$rev" > .cache/gpu/GIT_REV
du -sh .whl .cache/gpu .cache/gpu_soak
echo "GIT_REV $rev. Carry [\".whl\", \".cache/gpu\"]; run: bash bench/run_gpu_suite.sh qwen | llama | serve"
