"""Dense linear layers in either weight layout: x @ W with W held [in, out] (K x N, Flax's kernel, what
jaxpaged's Linear holds) against W held [out, in] (N x K, torch's nn.Linear and every HF checkpoint), the
product then dot_general(x, W, contracting dim 1 of both), which cuBLAS takes as a transposed operand.

  python3 bench/layout_probe.py --out DIR [--rows 1,8,64,256,2048,16384] [--models llama3-8b] [--git-rev REV]

The question: do cuBLAS's decode-sized GEMVs (one request's step: M = 1) read an [out, in] weight, whose output
columns are contiguous rows of K, faster than an [in, out] one, and do prefill-sized GEMMs keep their speed?
Times: bench_kernels.time_op (the device's time per op, two jitted calls of n and 2n ops differenced), each op
reading its own weight copy so that the copies exceed the 50 MB L2. Also prints, for M = 1, what XLA compiled
for each layout (its custom calls and any transpose or copy of the weight). Writes layout_<device>.json/.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.bench_kernels import rel_err, time_op  # noqa: E402
from bench.bench_matmul import LINEARS  # noqa: E402

TIMED_OPS = 8
NK = (((1,), (1,)), ((), ()))          # x [M, K] . W [N, K] -> [M, N]


def compiled_ops(fn, *args) -> str:
    """The optimized HLO's custom-call targets and any transpose or copy instruction, one line."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    targets = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    moves = len(re.findall(r"= \S+ (?:transpose|copy)\(", text))
    return f"custom calls {targets}, transposes/copies {moves}"


def bench(model: str, name: str, k: int, n: int, m: int, results: list, budget_end: float) -> None:
    if time.time() > budget_end:
        print(f"budget spent: skipping {model} {name} M={m}", flush=True)
        return
    nw = int(max(2 * TIMED_OPS, math.ceil((1 << 30) / (2 * k * n))))
    nx = int(max(2, min(2 * TIMED_OPS, (1 << 30) // (2 * m * k))))
    w_kn = tuple(jax.random.normal(jax.random.PRNGKey(i), (k, n), jnp.bfloat16) * 0.02 for i in range(nw))
    w_nk = tuple(jnp.asarray(w.T) for w in w_kn)
    xs = tuple(jax.random.normal(jax.random.PRNGKey(1000 + i), (m, k), jnp.bfloat16) for i in range(nx))
    variants = {
        "kn": (lambda i, xs, w: xs[i % nx] @ w[i % nw], (xs, w_kn)),
        "nk": (lambda i, xs, w: jax.lax.dot_general(xs[i % nx], w[i % nw], NK), (xs, w_nk)),
    }
    if m == 1:
        print(f"  {name} M=1 [in, out]: {compiled_ops(lambda x, w: x @ w, xs[0], w_kn[0])}", flush=True)
        print(f"  {name} M=1 [out, in]: {compiled_ops(lambda x, w: jax.lax.dot_general(x, w, NK), xs[0], w_nk[0])}",
              flush=True)
    outs = {}
    for label, (op, data) in variants.items():
        outs[label] = jax.jit(lambda *a, op=op: op(0, *a))(*data)
        dev_s, _ = time_op(op, data, n=TIMED_OPS)
        row = {"model": model, "linear": name, "K": k, "N": n, "M": m, "layout": label, "us": dev_s * 1e6,
               "TBps": 2 * k * n / dev_s / 1e12, "TFLOPs": 2 * m * k * n / dev_s / 1e12}
        results.append(row)
        print(f"{model:10s} {name:8s} M={m:<6d} {label} {dev_s * 1e6:9.1f} us  {row['TBps']:5.2f} TB/s "
              f"{row['TFLOPs']:6.1f} TFLOP/s", flush=True)
    err = rel_err(outs["nk"], outs["kn"])
    results[-1]["rel_err_vs_kn"] = err
    print(f"  nk against kn: rel. err {err:.1e}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--git-rev", default="unknown")
    p.add_argument("--models", default="llama3-8b")
    p.add_argument("--rows", default="1,8,64,256,2048,16384")
    p.add_argument("--budget-s", type=float, default=240)
    a = p.parse_args()
    end = time.time() + a.budget_s
    device = jax.devices()[0].device_kind
    print(f"device {device}, jax {jax.__version__}", flush=True)
    results: list = []
    for model in a.models.split(","):
        for name, k, n in LINEARS[model]:
            for m in (int(r) for r in a.rows.split(",")):
                bench(model, name, k, n, m, results, end)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = device.replace(" ", "_")
    meta = {"device": device, "jax": jax.__version__, "git_rev": a.git_rev, "command": " ".join(sys.argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    (out / f"layout_{slug}.json").write_text(json.dumps({**meta, "results": results}, indent=1))
    base = {(r["model"], r["linear"], r["M"]): r["us"] for r in results if r["layout"] == "kn"}
    lines = [f"# Weight layouts: {device}, jax {jax.__version__}, rev {a.git_rev}", "", f"`{meta['command']}`", "",
             "| model | linear | K x N | M | layout | us | weight TB/s | TFLOP/s | x [in, out] |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['model']} | {r['linear']} | {r['K']} x {r['N']} | {r['M']} | "
                     f"{'[in, out]' if r['layout'] == 'kn' else '[out, in]'} | {r['us']:.1f} | {r['TBps']:.2f} | "
                     f"{r['TFLOPs']:.1f} | {r['us'] / base[(r['model'], r['linear'], r['M'])]:.2f} |")
    (out / f"layout_{slug}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
