"""The W4A16 GEMV under Nsight Compute: what bounds it (issue 26's one-request target).

  ncu --clock-control none -k regex:'int4_matmul|load_probe' ... python3 bench/gemv_ncu.py [--layers gate_up,down]

Runs, at one row and llama3-8b's shapes, each named layer's int4 GEMV (AWQ layout, group 128, the op's own
tiling and form, as a model runs it) and then the weight-loads-only probe at the same tiling
(bench_matmul.load_probe), once each after a warm-up, so that a profiler filtering on the kernel names sees
one launch of each. Without a profiler it prints each kernel's time (bench_kernels.time_op) as a check.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.bench_matmul import LINEARS, load_probe  # noqa: E402
from pallas_kernels.int4_matmul import choose_int4_tiling, int4_matmul, pack_int4  # noqa: E402

GROUP = 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="qkv,o,gate_up,down")
    ap.add_argument("--time", action="store_true", help="also time each kernel (no profiler)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    wanted = args.layers.split(",")
    for name, k, n in LINEARS["llama3-8b"]:
        if name not in wanted:
            continue
        qweight = jnp.asarray(pack_int4(rng.integers(0, 16, (k, n), dtype=np.uint8)))
        scales = jnp.asarray(rng.uniform(0.001, 0.01, (k // GROUP, n)), jnp.bfloat16)
        zeros = jnp.asarray(rng.integers(0, 16, (k // GROUP, n)), jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((1, k)), jnp.bfloat16)
        _, block_n, splits = choose_int4_tiling(1, k, n, f16x2=True)
        gemv = jax.jit(int4_matmul)
        probe = jax.jit(lambda w, bn=block_n, ns=splits: load_probe(w, block_n=bn, num_splits=ns))
        jax.block_until_ready(gemv(x, qweight, scales, zeros))                      # compile
        jax.block_until_ready(probe(qweight))
        print(f"{name}: K {k} N {n} block_n {block_n} splits {splits} int4 bytes {k * n // 2 / 1e6:.1f} MB",
              flush=True)
        jax.block_until_ready(gemv(x, qweight, scales, zeros))                      # the profiled launches
        jax.block_until_ready(probe(qweight))
        if args.time:
            from bench.bench_kernels import time_op
            t, _ = time_op(lambda i, *a: gemv(*a), (x, qweight, scales, zeros), 8)
            tp, _ = time_op(lambda i, w: probe(w), (qweight,), 8)
            print(f"  gemv {t * 1e6:.1f} us, probe {tp * 1e6:.1f} us (L2-warm: one weight copy)", flush=True)


if __name__ == "__main__":
    main()
