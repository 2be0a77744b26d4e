"""Latency of one batch, as vLLM's benchmarks/benchmark_latency.py.

`--batch-size` prompts of `--input-len` random token ids each generate exactly `--output-len` tokens
(ignore_eos); after `--num-iters-warmup` untimed runs, `--num-iters` timed runs give the average and
percentiles. `--decode-step` also times the batch with output length 1 (prefill + one token), so that
  decode step ~= (latency(output_len) - latency(1)) / (output_len - 1)
which is set against the bandwidth floor: (bf16 weights + live KV bytes) / 2.53 TB/s (BENCHMARKS.md).

Example:
  python -m bench.latency --model llama3-8b --batch-size 256 --input-len 128 --output-len 128 --decode-step
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):   # run as a file: see bench/common.py add_repo_to_path
    _bench = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _bench]
    sys.path.append(str(_bench.parent))

from bench.llm_args import add_engine_args  # noqa: E402

H100_HBM_BYTES_PER_S = 2.53e12     # measured elementwise read+write ceiling (BENCHMARKS.md)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters-warmup", type=int, default=3)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--decode-step", action="store_true", help="also time output length 1 and derive the step")
    p.add_argument("--result-name", default=None)
    add_engine_args(p)
    return p.parse_args(argv)


def bandwidth_floor_s(config: dict[str, Any], batch_size: int, context_len: float, dtype_bytes: int = 2,
                      bytes_per_s: float = H100_HBM_BYTES_PER_S) -> dict[str, float]:
    """Bytes one decode step must read (all weights once + the live KV of every sequence) and the time
    that takes at `bytes_per_s`. Llama-3-8B: 8.03e9 params -> 16.1 GB -> 6.3 ms at 2.53 TB/s, plus
    KV: 2 (K, V) * 32 layers * 8 heads * 128 dims * 2 bytes = 128 KiB per token of context."""
    h, L, v = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // heads
    per_layer = h * heads * d + 2 * h * kv_heads * d + heads * d * h + 3 * h * config["intermediate_size"] + 2 * h
    params = L * per_layer + v * h * (1 if config.get("tie_word_embeddings") else 2) + h
    weight_bytes = params * dtype_bytes
    kv_bytes = 2 * L * kv_heads * d * dtype_bytes * batch_size * context_len
    return {"params": float(params), "weight_bytes": float(weight_bytes), "kv_bytes": float(kv_bytes),
            "floor_s": (weight_bytes + kv_bytes) / bytes_per_s}


def _time_batch(llm, prompts, params, iters: int, desc: str) -> list[float]:
    from tqdm import tqdm
    out = []
    for _ in tqdm(range(iters), desc=desc):
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        out.append(time.perf_counter() - t0)
    return out


def run(args: argparse.Namespace, argv: list[str] | None = None) -> dict[str, Any]:
    from jaxpaged import SamplingParams
    from bench.common import stamp, write_result
    from bench.llm_args import make_llm
    from bench.models import vocab_size

    llm, kw, short, startup_s = make_llm(args)
    rng = np.random.default_rng(args.seed)
    vocab = vocab_size(args.model)
    # vLLM uses ids below 10000; these are spread over the vocabulary, away from special tokens.
    prompts = [{"prompt_token_ids": rng.integers(100, min(vocab - 200, 100_000), args.input_len).tolist()}
               for _ in range(args.batch_size)]
    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=args.output_len, ignore_eos=True)
    _time_batch(llm, prompts, params, args.num_iters_warmup, "warm-up")
    lat = np.array(_time_batch(llm, prompts, params, args.num_iters, "timed"))
    metrics: dict[str, Any] = {
        "model": short, "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
        "avg_latency": float(lat.mean()), "median_latency": float(np.median(lat)),
        "p99_latency": float(np.percentile(lat, 99)), "latencies": lat.tolist(),
        "percentiles": {str(p): float(np.percentile(lat, p)) for p in (10, 25, 50, 75, 90, 99)},
        "output_tokens_per_second": args.batch_size * args.output_len / float(np.median(lat)),
        "engine_startup_s": startup_s}
    print(f"Avg latency: {metrics['avg_latency']:.4f} seconds")
    for p, v in metrics["percentiles"].items():
        print(f"{p}% percentile latency: {v:.4f} seconds")
    if args.decode_step and args.output_len > 1:
        p1 = params.clone(max_tokens=1)
        _time_batch(llm, prompts, p1, 1, "warm-up (1 token)")
        lat1 = float(np.median(_time_batch(llm, prompts, p1, args.num_iters, "timed (1 token)")))
        step = (metrics["median_latency"] - lat1) / (args.output_len - 1)
        config = json.loads((Path(kw["model"]) / "config.json").read_text()) if kw.get("model") else None
        metrics.update(prefill_latency=lat1, decode_step_ms=1000 * step)
        print(f"prefill + 1 token: {lat1:.4f} s; decode step: {1000 * step:.3f} ms at batch {args.batch_size}")
        if config is not None:
            floor = bandwidth_floor_s(config, args.batch_size, args.input_len + args.output_len / 2)
            metrics.update(bandwidth_floor_ms=1000 * floor["floor_s"], floor_bytes=floor,
                           decode_step_over_floor=step / floor["floor_s"])
            print(f"bandwidth floor: {1000 * floor['floor_s']:.3f} ms/step -> step is "
                  f"{step / floor['floor_s']:.2f}x the floor (target <= 1.5x)")
    name = args.result_name or f"latency-{short}-b{args.batch_size}-i{args.input_len}-o{args.output_len}"
    meta = stamp(sys.argv if argv is None else ["bench/latency.py"] + list(argv))
    print(f"results: {write_result(name, metrics, meta=meta, title=f'latency: {name}')}")
    return metrics


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv), argv)


if __name__ == "__main__":
    main()
