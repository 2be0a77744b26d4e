"""Where a small decode's time goes on the GPU: one profiled jit of N decode calls per variant.

  python3 bench/decode_trace.py --out DIR [--shapes 16x1024,16x4096] [--layouts qwen2-0.5b] [-n 16]

For each shape and variant (our default; the same with every request empty, the floor of launch, length
and q loads and stores; JAX's own paged_attention) it runs one jitted call of n ops on n different block
tables, under jax.profiler, and reports from the device's events: the kernels by name (count, mean us), the device-busy
time per op, and the span per op (first kernel's start to last kernel's end, divided by n): the second
includes the gaps between kernels in the stream, what bench_kernels' paired timing sees.
Writes decode_trace.json under --out and prints it.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from bench import trace_analysis as ta  # noqa: E402
from bench.bench_kernels import BLOCK, LAYOUTS, POOL_MIN_BYTES, make_pool, random_tables  # noqa: E402
from bench.common import stamp  # noqa: E402


def variants(d):
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

    def ours(zero_lens=False, **kw):
        # zero_lens: every request empty, so each program loads q and its length and stores: the floor
        return lambda i, q, pool, kp, vp, tables, lens: pk.paged_decode_attention(
            q, pool, jnp.int32(0), tables[i], lens * 0 if zero_lens else lens, scale=d ** -0.5, **kw)
    return {"ours": ours(), "ours_empty_requests": ours(zero_lens=True),
            "jax_paged_attention": lambda i, q, pool, kp, vp, tables, lens: jax_pa.paged_attention(
                q, kp, vp, tables[i], lens)}


def profile_one(fn, args, n, tag):
    f = jax.jit(lambda *a: [fn(i, *a) for i in range(n)])
    for _ in range(3):
        jax.block_until_ready(f(*args))
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            jax.block_until_ready(f(*args))
        events = ta.load_events(tmp) or []
    trace = ta.analyze_events(events)
    if trace is None:
        return {"variant": tag, "error": "no device events"}
    return {"variant": tag, "ops": n, "span_per_op_us": trace["span_ms"] * 1e3 / n,
            "busy_per_op_us": trace["device_busy_ms"] * 1e3 / n,
            "kernels": [{"name": k["name"], "count": k["count"], "mean_us": k["mean_us"]}
                        for k in ta.top_kernels(events)]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--shapes", default="16x1024,16x4096")
    ap.add_argument("--layouts", default="qwen2-0.5b,llama3-8b")
    ap.add_argument("-n", type=int, default=16)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for layout in args.layouts.split(","):
        nh, k, d = LAYOUTS[layout]
        for shape in args.shapes.split(","):
            r, ctx = (int(x) for x in shape.split("x"))
            m = ctx // BLOCK
            block_bytes = 2 * k * BLOCK * d * 2
            pool_blocks = max(r * m, POOL_MIN_BYTES // block_bytes) + 1
            pool = make_pool(rng, pool_blocks, k, d)
            tables = random_tables(rng, args.n, r, m, pool_blocks)
            lens = jnp.full((r,), ctx, jnp.int32)
            q = jax.random.normal(jax.random.PRNGKey(r + ctx), (r, nh, d)).astype(jnp.bfloat16)
            kp, vp = pool[0, 0].transpose(1, 0, 2, 3), pool[0, 1].transpose(1, 0, 2, 3)
            data = (q, pool, kp, vp, tables, lens)
            for tag, fn in variants(d).items():
                try:
                    row = profile_one(fn, data, args.n, tag)
                except Exception as e:  # noqa: BLE001 - report and go on
                    row = {"variant": tag, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                row.update(layout=layout, seqs=r, ctx=ctx)
                print(json.dumps(row), flush=True)
                rows.append(row)
            del pool, kp, vp
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_trace.json").write_text(json.dumps({**stamp(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
