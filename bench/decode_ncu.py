"""The decode attention kernels under Nsight Compute: what bounds the e4m3 pool's decode (issue 26's 1.6x).

  bash bench/ncu_profile.sh decode 'kernel|mosaic' 4 bench/decode_ncu.py [--reqs 256] [--ctx 4096] [--set M.N=V]
  python3 bench/decode_ncu.py --time-only [--set M.N=V]

Runs decode attention as pallas_kernels.attention routes it (backend "mosaic", outside loops) at llama3-8b's layout
(32 query heads, 8 kv heads, head size 128, 16-token blocks), `--reqs` requests of `--ctx` tokens each, over a bf16
pool and then over the same values in e4m3 (scales 1.0), each twice (the first call compiles), so that a profiler
filtering on kernel names sees two launches of each; with --time-only, each one's time instead (no profiler).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.step_kernels import apply_sets  # noqa: E402
from jaxpaged.pallas_kernels import FP8_CACHE_DTYPE, attention  # noqa: E402
from jaxpaged.pallas_kernels._checks import to_cache  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reqs", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--time-only", action="store_true", help="time each pool's call and stop (no profiled calls)")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="set a module constant first (an A/B of a kernel switch; bench/step_kernels.py's --set)")
    args = ap.parse_args()
    for name, value in apply_sets(args.set):
        print(f"set {name} = {value!r}", flush=True)
    per_req = args.ctx // BLOCK
    blocks = args.reqs * per_req + 1
    key = jax.random.PRNGKey(0)
    q = jax.random.normal(key, (args.reqs, HEADS, HEAD_DIM), jnp.float32).astype(jnp.bfloat16)
    pool = jax.random.normal(jax.random.fold_in(key, 1), (1, 2, blocks, KV_HEADS, BLOCK, HEAD_DIM),
                             jnp.float32).astype(jnp.bfloat16)
    tables = jnp.asarray(np.random.default_rng(0).permutation(np.arange(1, blocks)).reshape(args.reqs, per_req),
                         jnp.int32)
    lens = jnp.full((args.reqs,), args.ctx, jnp.int32)
    qsl = jnp.arange(args.reqs + 1, dtype=jnp.int32)
    ones = (jnp.float32(1.0), jnp.float32(1.0))
    calls = {}
    for name, kv, scales in (("bf16", pool, None), ("e4m3", to_cache(pool, FP8_CACHE_DTYPE), ones)):
        calls[name] = (jax.jit(lambda q, kv, t, s, l, scales=scales: attention(
            q, kv, 0, t, s, l, scale=HEAD_DIM ** -0.5, decode_only=True, backend="mosaic", kv_scales=scales)), kv)
    for name, (fn, kv) in calls.items():
        jax.block_until_ready(fn(q, kv, tables, lens, qsl))
        if not args.time_only:       # under the profiler: the compiling call, then one more
            print(f"profiled: {name}", flush=True)
            jax.block_until_ready(fn(q, kv, tables, lens, qsl))
            continue
        t0 = time.perf_counter()
        for _ in range(20):
            out = fn(q, kv, tables, lens, qsl)
        jax.block_until_ready(out)
        kv_bytes = args.reqs * args.ctx * KV_HEADS * HEAD_DIM * 2 * kv.dtype.itemsize
        us = (time.perf_counter() - t0) / 20 * 1e6
        print(f"{name}: {us:.1f} us a call ({kv_bytes / us / 1e6:.2f} TB/s of K/V)", flush=True)


if __name__ == "__main__":
    main()
