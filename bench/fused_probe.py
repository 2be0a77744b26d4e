"""The fused small-batch linear kernels (pallas_kernels/fused_linear.py) against the unfused layer pieces XLA
compiles (the model's own ops: RMSNorm, the dot, the bias, RoPE, SiLU, the residual add), per layer piece, on the
GPU, at a few rows, under a few tilings.

  python3 bench/fused_probe.py [--models qwen2-0.5b,llama3-8b] [--rows 1,16] [--out DIR]

Pieces: qkv (norm + q/k/v + bias + RoPE), o (+ residual), gate_up (norm + SiLU * up), down (+ residual). Times:
bench_kernels.time_op's device throughput, each op on its own copy of the weights (>= 1 GiB in all: L2 never
holds them). Prints one line a (model, piece, rows, variant) and writes fused_probe.json under --out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO_ROOT))   # after the installed jaxpaged (the repo folder lacks its subpackages)

import jaxpaged  # noqa: E402,F401  (the engine's XLA flags, before jax starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.bench_kernels import time_op  # noqa: E402
from bench.bench_matmul import weight_sets  # noqa: E402
from jaxpaged.models.decoder import RMSNorm, _rotate, matmul  # noqa: E402
from jaxpaged.pallas_kernels.fused_linear import fused_linear  # noqa: E402

SHAPES = {   # hidden, intermediate, heads, kv heads, head dim, q/k/v bias
    "qwen2-0.5b": (896, 4864, 14, 2, 64, True),
    "llama3-8b": (4096, 14336, 32, 8, 128, False),
}
BF = jnp.bfloat16


def norm(x, w):
    return RMSNorm(1e-6, BF).apply({"params": {"scale": w}}, x)


def pieces(model: str):
    """piece -> (K, N of the weight, unfused fn(x, w, aux), fused fn(x, w, aux, **tiling))."""
    h, f, nh, nkv, d, bias = SHAPES[model]
    q, kv = nh * d, nkv * d

    def qkv_xla(x, w, a):
        y = matmul(norm(x, a["nw"]), w, BF)
        if bias:
            y = y + a["b"]
        t = x.shape[0]
        qq = _rotate(y[:, :q].reshape(t, nh, d), a["cos"], a["sin"])
        kk = _rotate(y[:, q:q + kv].reshape(t, nkv, d), a["cos"], a["sin"])
        return qq, kk, y[:, q + kv:]

    def qkv_fused(x, w, a, **kw):
        return fused_linear(x, w, mode="qkv", norm_weight=a["nw"], bias=a["b"] if bias else None, cos=a["cos"],
                            sin=a["sin"], num_heads=nh, num_kv_heads=nkv, head_dim=d, **kw)

    def swiglu_xla(x, w, a):
        g, u = jnp.split(matmul(norm(x, a["nw"]), w, BF), 2, axis=-1)
        return jax.nn.silu(g) * u

    return {
        "qkv": (h, q + 2 * kv, qkv_xla, qkv_fused),
        "o": (q, h, lambda x, w, a: a["res"] + matmul(x, w, BF),
              lambda x, w, a, **kw: fused_linear(x, w, mode="residual", residual=a["res"], **kw)),
        "gate_up": (h, 2 * f, swiglu_xla,
                    lambda x, w, a, **kw: fused_linear(x, w, mode="swiglu", norm_weight=a["nw"], **kw)),
        "down": (f, h, lambda x, w, a: a["res"] + matmul(x, w, BF),
                 lambda x, w, a, **kw: fused_linear(x, w, mode="residual", residual=a["res"], **kw)),
    }


TILINGS = [{}, {"num_stages": 4}, {"num_warps": 8}, {"block_n": 32}, {"block_n": 16}]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen2-0.5b,llama3-8b")
    p.add_argument("--rows", default="1,16")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = []
    n_ops = 16
    for model in args.models.split(","):
        h, f, nh, nkv, d, _ = SHAPES[model]
        for name, (k, n, xla_fn, fused_fn) in pieces(model).items():
            sets = weight_sets(2 * k * n)
            ws = tuple(jax.random.normal(jax.random.PRNGKey(i), (k, n), BF) * 0.02 for i in range(sets))
            for m in (int(r) for r in args.rows.split(",")):
                key = jax.random.PRNGKey(m)
                aux = {"nw": jnp.ones((k,), BF), "b": jnp.zeros((n,), BF) + 0.1,
                       "cos": jnp.cos(jax.random.uniform(key, (m, d // 2))),
                       "sin": jnp.sin(jax.random.uniform(key, (m, d // 2))),
                       "res": jax.random.normal(key, (m, n), BF)}
                xs = tuple(jax.random.normal(jax.random.PRNGKey(100 + i), (m, k), BF) for i in range(8))
                variants = {"xla": xla_fn}
                for t in TILINGS if m == 1 else TILINGS[:1]:
                    if name == "qkv" and t.get("block_n", 0) > d // 2:
                        continue
                    label = "fused " + (" ".join(f"{a}={b}" for a, b in t.items()) or "default")
                    variants[label] = lambda x, w, a, fn=fused_fn, t=t: fn(x, w, a, **t)
                for label, fn in variants.items():
                    try:
                        us = time_op(lambda i, xs, ws, a, fn=fn: fn(xs[i % 8], ws[i % sets], a), (xs, ws, aux),
                                     n_ops)[0] * 1e6
                    except Exception as e:  # noqa: BLE001 - a tiling the shape refuses or Triton rejects
                        print(f"{model} {name} M={m} {label}: failed {type(e).__name__}: {str(e)[:160]}", flush=True)
                        continue
                    tbs = 2 * k * n / us / 1e6
                    print(f"{model} {name} K={k} N={n} M={m} {label}: {us:.1f} us ({tbs:.2f} TB/s)", flush=True)
                    results.append({"model": model, "piece": name, "k": k, "n": n, "m": m, "variant": label,
                                     "us": us, "weight_tb_s": tbs})
            del ws
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fused_probe.json").write_text(json.dumps({"device": jax.devices()[0].device_kind,
                                                                     "jax": jax.__version__, "results": results},
                                                                    indent=1))


if __name__ == "__main__":
    main()
