"""Which fp8 matmul patterns XLA lowers to cuBLASLt's fp8 GEMM on this GPU, and what each costs (issue 26).

  python3 bench/fp8_probe.py [--out DIR] [--rows 1,256,4096] [--k 4096] [--n 14336]

For each pattern: whether the compiled HLO holds the fp8 cuBLASLt custom call (`__cublas$lt$matmul$f8`), its
time (bench_kernels.time_op, weight copies that exceed L2), and its error against the bf16 dot of the
dequantized operands. Weights are e4m3 with one scale per tensor, stored [N, K] (cuBLASLt's fp8 GEMM takes
the weight K-major) or [K, N]; activations are quantized in the program with a dynamic per-tensor scale.
Prints one line per (pattern, rows) and writes fp8_probe.json under --out.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.bench_kernels import rel_err, time_op  # noqa: E402

F8 = jnp.float8_e4m3fn
F8_MAX = 448.0


def quantize_per_tensor(x):
    scale = jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32))), 1e-12) / F8_MAX
    return (x.astype(jnp.float32) / scale).astype(F8), scale


def dot_nk(a, b, out=jnp.bfloat16):
    """a [M, K] x b [N, K] -> [M, N]."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=out)


# pattern name -> (weight stored [N, K]?, fn(x bf16[M, K], w_f8, w_scale f32[]) -> bf16[M, N])
PATTERNS = {
    # dequantize both in bf16 then dot: the pattern XLA's GEMM rewriter folds into the fp8 GEMM
    "convert*scale bf16, w[N,K]": (True, lambda x, w, sw: (lambda xq, sx: dot_nk(
        xq.astype(jnp.bfloat16) * sx.astype(jnp.bfloat16), w.astype(jnp.bfloat16) * sw.astype(jnp.bfloat16)))(
        *quantize_per_tensor(x))),
    "convert*scale f32, w[N,K]": (True, lambda x, w, sw: (lambda xq, sx: dot_nk(
        xq.astype(jnp.float32) * sx, w.astype(jnp.float32) * sw, jnp.float32).astype(jnp.bfloat16))(
        *quantize_per_tensor(x))),
    "convert*scale bf16, w[K,N]": (False, lambda x, w, sw: (lambda xq, sx: jnp.dot(
        xq.astype(jnp.bfloat16) * sx.astype(jnp.bfloat16), w.astype(jnp.bfloat16) * sw.astype(jnp.bfloat16)))(
        *quantize_per_tensor(x))),
    # the fp8 operands straight into the dot, scales applied to the output
    "f8 dot -> bf16, w[N,K]": (True, lambda x, w, sw: (lambda xq, sx: (
        dot_nk(xq, w, jnp.bfloat16).astype(jnp.float32) * (sx * sw)).astype(jnp.bfloat16))(*quantize_per_tensor(x))),
    "f8 dot -> f32, w[N,K]": (True, lambda x, w, sw: (lambda xq, sx: (
        dot_nk(xq, w, jnp.float32) * (sx * sw)).astype(jnp.bfloat16))(*quantize_per_tensor(x))),
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--rows", default="1,256,4096")
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=14336)
    args = p.parse_args()
    k, n = args.k, args.n
    print(f"fp8 probe: {jax.devices()[0].device_kind}, jax {jax.__version__}, K {k}, N {n}", flush=True)
    # one array per copy (tuple arguments), never slices of a stacked array: XLA copies a slice that feeds a
    # cuBLAS call, and the copy would be timed with the op; 2 x 8 copies, one per op of time_op's longer call
    copies = max(16, -(-(1 << 30) // (k * n)))
    wq, sw, wq_kn, w_deq_kn = [], [], [], []
    for c in range(copies):
        q, s = quantize_per_tensor(jax.random.normal(jax.random.PRNGKey(c), (n, k), jnp.bfloat16) * 0.02)
        wq.append(q)
        sw.append(s)
        wq_kn.append(q.T)
        w_deq_kn.append((q.T.astype(jnp.float32) * s).astype(jnp.bfloat16))
    wq, sw, wq_kn, w_deq_kn = tuple(wq), tuple(sw), tuple(wq_kn), tuple(w_deq_kn)
    results = []
    for m in (int(r) for r in args.rows.split(",")):
        xs = jax.random.normal(jax.random.PRNGKey(m), (64, m, k), jnp.bfloat16)
        ref_op = lambda i, xs, wd: xs[i % 64] @ wd[i % copies]
        dev_s, _ = time_op(ref_op, (xs, w_deq_kn), n=8)
        print(f"M={m:<5d} {'bf16 dot (dequantized w)':32s} {dev_s * 1e6:9.1f} us", flush=True)
        results.append({"M": m, "pattern": "bf16", "us": dev_s * 1e6})
        ref = jax.jit(lambda xs, wd: xs[0] @ wd)(xs, w_deq_kn[0])
        for name, (nk, fn) in PATTERNS.items():
            weights = wq if nk else wq_kn
            op = lambda i, xs, wq_, sw_, fn=fn: fn(xs[i % 64], wq_[i % copies], sw_[i % copies])
            try:
                hlo = jax.jit(lambda xs, wq_, sw_: op(0, xs, wq_, sw_)).lower(xs, weights, sw).compile().as_text()
                targets = sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))
                f8_gemm = any("f8" in t for t in targets)
                out = jax.jit(lambda xs, wq_, sw_: op(0, xs, wq_, sw_))(xs, weights, sw)
                dev_s, _ = time_op(op, (xs, weights, sw), n=8)
            except Exception as e:  # noqa: BLE001  (a pattern XLA refuses is reported, the rest go on)
                print(f"M={m:<5d} {name:32s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            err = rel_err(out, ref)
            print(f"M={m:<5d} {name:32s} {dev_s * 1e6:9.1f} us  fp8 GEMM: {f8_gemm}  err {err:.3f}  {targets}",
                  flush=True)
            results.append({"M": m, "pattern": name, "us": dev_s * 1e6, "f8_gemm": f8_gemm, "rel_err": err,
                            "custom_calls": targets})
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "command": " ".join(sys.argv)}
        (Path(args.out) / "fp8_probe.json").write_text(json.dumps({**meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
