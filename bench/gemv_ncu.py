"""The W4A16 GEMV under Nsight Compute: what bounds it (issue 26's one-request target).

  ncu --clock-control none -k regex:'int4_matmul|load_probe' ... python3 bench/gemv_ncu.py [--layers gate_up,down]
      [--int4-kwargs prefetch=False ...]
  python3 bench/gemv_ncu.py --summarize sass.csv      (ncu -i REPORT --page source --print-source sass --csv)
  python3 bench/gemv_ncu.py --blocks sass.csv         (the basic blocks by stall samples)

Runs, at one row and llama3-8b's shapes, each named layer's int4 GEMV (AWQ layout, group 128, the op's own
tiling and form, as a model runs it; with --int4-kwargs, once more with each set of int4_matmul keywords) and
then the weight-loads-only probe at the same tiling
(bench_matmul.load_probe), twice each (the first call compiles), so that a profiler filtering on the kernel
names sees two launches of each (bench/gemv_ncu.sh runs it so). --summarize reads ncu's SASS page back: per
kernel, the instructions executed and the loop's body (the instructions run most often) by opcode.
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.bench_matmul import GROUP, LINEARS, load_probe, parse_int4_kwargs  # noqa: E402
from pallas_kernels.int4_matmul import choose_int4_tiling, int4_matmul, pack_int4  # noqa: E402


def summarize(path: str) -> None:
    """Per kernel of an ncu SASS page (CSV): warp instructions executed, and the loop's body (the instructions
    executed most often, by count) with its opcodes."""
    import collections
    import csv
    rows = list(csv.reader(open(path)))
    starts = [i for i, r in enumerate(rows) if r and r[0] == "Kernel Name"] + [len(rows)]
    for a, b in zip(starts, starts[1:]):
        header = {h: i for i, h in enumerate(rows[a + 1])}
        body = [r for r in rows[a + 2:b] if len(r) == len(header)]
        executed = [int(r[header["Instructions Executed"]] or 0) for r in body]
        trips = collections.Counter(executed).most_common(1)[0][0]
        ops = collections.Counter(r[1].split()[1 if r[1].split()[0].startswith("@") else 0]
                                  for r, n in zip(body, executed) if n == trips)
        print(f"{rows[a][1]}: {sum(executed):,} warp instructions; loop body {sum(ops.values())} instructions "
              f"x {trips:,}: " + ", ".join(f"{op} {n}" for op, n in ops.most_common(12)))


def blocks(path: str, min_share: float = 0.004) -> None:
    """Per kernel of an ncu SASS page (CSV): its basic blocks (split after each branch) that hold at least min_share
    of the kernel's stall samples, each with its instruction range, how often it ran, its share of the samples, its
    top stall reasons and opcodes: where a kernel's warps wait, and on what."""
    import collections
    import csv
    rows = list(csv.reader(open(path)))
    starts = [i for i, r in enumerate(rows) if r and r[0] == "Kernel Name"] + [len(rows)]
    for n, (a, b) in enumerate(zip(starts, starts[1:])):
        header = {h: i for i, h in enumerate(rows[a + 1])}
        body = [r for r in rows[a + 2:b] if len(r) == len(header)]
        stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
        samples = [int(r[header["Warp Stall Sampling (All Samples)"]] or 0) for r in body]
        total = sum(samples) or 1
        found, cur = [], []
        for i, r in enumerate(body):
            cur.append(i)
            if "BRA" in r[1] or "EXIT" in r[1]:
                found, cur = found + [cur], []
        print(f"kernel {n} ({rows[a][1]}): {total:,} stall samples")
        for block in found + [cur]:
            share = sum(samples[i] for i in block) / total
            if not block or share < min_share:
                continue
            ran = collections.Counter(int(body[i][header["Instructions Executed"]] or 0) for i in block).most_common(1)
            ops = collections.Counter(body[i][1].split()[1 if body[i][1].startswith("@") else 0].split(".")[0]
                                      for i in block)
            why = collections.Counter()
            for i in block:
                for c in stalls:
                    why[c[6:]] += int(body[i][header[c]] or 0)
            print(f"  [{block[0]}-{block[-1]}] {len(block)} instructions x {ran[0][0]:,}: {100 * share:.1f}% of "
                  f"samples; stalls {dict(why.most_common(4))}; ops {dict(ops.most_common(8))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="qkv,o,gate_up,down")
    ap.add_argument("--summarize", metavar="SASS_CSV", help="summarize ncu's SASS page instead of running")
    ap.add_argument("--blocks", metavar="SASS_CSV", help="the SASS page's basic blocks by stall samples instead")
    ap.add_argument("--int4-kwargs", action="append", default=[], metavar="K=V[,K=V]",
                    help="also profile the GEMV with these int4_matmul keywords (repeatable)")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    if args.blocks:
        blocks(args.blocks)
        return
    rng = np.random.default_rng(0)
    wanted = args.layers.split(",")
    for name, k, n in LINEARS["llama3-8b"]:
        if name not in wanted:
            continue
        qweight = jnp.asarray(pack_int4(rng.integers(0, 16, (k, n), dtype=np.uint8)))
        scales = jnp.asarray(rng.uniform(0.001, 0.01, (k // GROUP, n)), jnp.bfloat16)
        zeros = jnp.asarray(rng.integers(0, 16, (k // GROUP, n)), jnp.uint8)
        x = jnp.asarray(rng.standard_normal((1, k)), jnp.bfloat16)
        _, block_n, splits = choose_int4_tiling(1, k, n, f16x2=True)
        gemvs = [jax.jit(functools.partial(int4_matmul, **parse_int4_kwargs(spec) if spec else {}))
                 for spec in ["", *args.int4_kwargs]]
        probe = jax.jit(lambda w, bn=block_n, ns=splits: load_probe(w, block_n=bn, num_splits=ns))
        for gemv in gemvs:
            jax.block_until_ready(gemv(x, qweight, scales, zeros))                  # compile
        jax.block_until_ready(probe(qweight))
        print(f"{name}: K {k} N {n} block_n {block_n} splits {splits} int4 bytes {k * n // 2 / 1e6:.1f} MB; "
              f"GEMV launches: default{''.join(', ' + s for s in args.int4_kwargs)}", flush=True)
        for gemv in gemvs:
            jax.block_until_ready(gemv(x, qweight, scales, zeros))                  # the profiled launches
        jax.block_until_ready(probe(qweight))


if __name__ == "__main__":
    main()
