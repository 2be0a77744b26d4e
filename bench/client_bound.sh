#!/usr/bin/env bash
# Whether a rate-inf run is bound by the benchmark client or by the server's API processes, on this host (no GPU
# used): bench/api_capacity.py's 1000 streams of 256 tokens (16 a chunk, as a multi-step program hands them out)
#   1. from a bare ASGI app (--no-op-server: what the client alone can take), and
#   2. from the real server (2 API processes, the default on 8+ cores) over a stand-in core,
# each with the one-process client (vLLM's) and with 4 client processes.
#   bash bench/client_bound.sh          (carry=[".whl", ".cache/gpu"] on the GPU machine, as the other scripts)
set -u
cd "$(dirname "$0")/.." || exit 1
source bench/gpu_env.sh
echo "client_bound: rev $JAXPAGED_GIT_REV, $(nproc) cores"
for server in no-op api2; do
  for cp in 1 4; do
    flags=(); [ $server = no-op ] && flags=(--no-op-server) || flags=(--api-server-count 2 --model qwen2-0.5b)
    echo "== $server server, $cp client process(es)"
    $PY "$REPO/bench/api_capacity.py" --num-prompts 1000 "${flags[@]}" --client-flags "--client-processes $cp --disable-tqdm" \
      2>&1 | grep -E "Benchmark duration|Output token throughput|admitted|sent at|Median TTFT|Server-side|CPU time" | sed 's/^/   /'
    if [ -n "${OUT:-}" ]; then
      f=$(ls -t "$REPO"/bench/results/api-capacity*.json | head -1); cp "$f" "$OUT/$(basename "$f" .json)-cp$cp.json"
    fi
  done
done
