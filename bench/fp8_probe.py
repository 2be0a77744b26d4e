"""How the engine's fp8 linear layer (W8A8: e4m3 weights with one scale per output channel, activations
quantized per token) runs on this GPU, written a few ways, against the bf16 dot (issue 26).

  python3 bench/fp8_probe.py [--out DIR] [--rows 1,16,64,256,1024,4096,8192] [--models llama3-8b]

For each of the model's linear layers (qkv, o, gate_up, down), each row count and each way: whether the
compiled HLO holds cuBLASLt's fp8 GEMM (`__cublas$lt$matmul$f8`), the time (bench_kernels.time_op; every
timed op reads its own copy of the weights and of x, passed as separate arrays: XLA copies a slice that feeds
a cuBLAS call, and the copy would be timed with the op) and the error against the bf16 dot of the dequantized
operands. XLA's flags are the engine's (jaxpaged.envs: Triton GEMM off). Prints a table and writes
fp8_probe.json (and .md) under --out.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import jaxpaged  # noqa: E402,F401  (the engine's XLA flags, before jax starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.bench_kernels import rel_err, time_op  # noqa: E402
from bench.bench_matmul import LINEARS  # noqa: E402
from jaxpaged.quantization import fp8, int8  # noqa: E402


def dot_nk(a, b, out):
    """a [M, K] x b [N, K] -> [M, N]."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=out)


def scaled(y, sx, sw, dtype=jnp.float32):
    return (y.astype(dtype) * sx.astype(dtype) * sw[:, 0].astype(dtype)).astype(jnp.bfloat16)


def f32_out(x, w, sw):
    xq, sx = fp8.quantize_activations(x)
    return (dot_nk(xq, w, jnp.float32) * sx * sw[:, 0]).astype(jnp.bfloat16)


# way -> fn(x bf16[M, K], w f8[N, K] (i8 for the int8 ways), sw f32[N, 1]) -> bf16[M, N]
WAYS = {
    "engine": lambda x, w, sw: fp8.fp8_linear(x, w, sw),
    "f8 dot -> f32, unpadded": f32_out,
    "f8 dot -> bf16, unpadded": lambda x, w, sw: (lambda xq, sx: scaled(dot_nk(xq, w, jnp.bfloat16), sx, sw))(
        *fp8.quantize_activations(x)),
    "int8 W8A8 (engine)": lambda x, w, sw: int8.int8_linear(x, w, sw),
}
INT8_WAYS = {"int8 W8A8 (engine)"}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--rows", default="1,16,64,128,256,1024,4096,8192")
    p.add_argument("--models", default="llama3-8b")
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting new rows after this long")
    args = p.parse_args()
    import time
    t_start = time.monotonic()
    dev = jax.devices()[0].device_kind
    print(f"fp8 probe: {dev}, jax {jax.__version__}", flush=True)
    results = []
    for model in args.models.split(","):
        for layer, k, n in LINEARS[model]:
            # enough weight copies to exceed L2 (50 MB) many times; x copies up to 512 MB
            wc = max(4, min(16, -(-(1 << 30) // (k * n))))
            wq, sw, wd, wi = [], [], [], []
            for c in range(wc):
                w = jax.random.normal(jax.random.PRNGKey(c), (k, n), jnp.float32) * 0.02
                q, s = fp8.quantize_per_channel(w)
                wq.append(q)
                sw.append(s)
                wd.append(fp8.dequantize(q, s, k, jnp.bfloat16).T)        # [K, N], the dense layout
                wi.append(jnp.clip(jnp.round(w.T / (s * 448 / 127)), -128, 127).astype(jnp.int8))
            wq, sw, wd, wi = tuple(wq), tuple(sw), tuple(wd), tuple(wi)
            i8_scale = tuple(x * 448 / 127 for x in sw)
            for m in (int(r) for r in args.rows.split(",")):
                if time.monotonic() - t_start > args.budget_s:
                    print(f"budget spent: {layer} M={m} and after not run", flush=True)
                    break
                xc = max(2, min(16, (512 << 20) // (m * k * 2)))
                xs = tuple(jax.random.normal(jax.random.PRNGKey(100 + c), (m, k), jnp.bfloat16) for c in range(xc))
                ref_op = lambda i, xs, wd: xs[i % xc] @ wd[i % wc]
                base, _ = time_op(ref_op, (xs, wd), n=8)
                row = {"model": model, "layer": layer, "K": k, "N": n, "M": m, "bf16_us": base * 1e6}
                ref = jax.jit(lambda x, w: x @ w)(xs[0], wd[0])
                line = f"{layer:8s} M={m:<5d} bf16 {base * 1e6:8.1f} us"
                for name, fn in WAYS.items():
                    weights, scales = (wi, i8_scale) if name in INT8_WAYS else (wq, sw)
                    op = lambda i, xs, wq_, sw_, fn=fn: fn(xs[i % xc], wq_[i % wc], sw_[i % wc])
                    one = jax.jit(lambda x, w, s, fn=fn: fn(x, w, s))
                    hlo = one.lower(xs[0], weights[0], scales[0]).compile().as_text()
                    calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))
                    f8_gemm = "__cublas$lt$matmul$f8" in calls
                    dev_s, _ = time_op(op, (xs, weights, scales), n=8)
                    out = one(xs[0], weights[0], scales[0])
                    err = rel_err(out, ref) if out.shape == ref.shape else float("nan")
                    row[name] = {"us": dev_s * 1e6, "f8_gemm": f8_gemm, "rel_err": err, "custom_calls": calls}
                    line += f" | {name}: {dev_s * 1e6:8.1f} us{' f8GEMM' if f8_gemm else ''} {calls}"
                print(line, flush=True)
                results.append(row)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"device": dev, "jax": jax.__version__, "command": " ".join(sys.argv)}
        (out / "fp8_probe.json").write_text(json.dumps({**meta, "results": results}, indent=1))
        lines = [f"# fp8 linear layers: {dev}, jax {jax.__version__}", "", f"`{meta['command']}`", "",
                 "| layer | M | bf16 us | " + " | ".join(f"{w} us" for w in WAYS) + " |",
                 "|---|---|---|" + "---|" * len(WAYS)]
        for r in results:
            lines.append(f"| {r['layer']} | {r['M']} | {r['bf16_us']:.1f} | " + " | ".join(
                f"{r[w]['us']:.1f}{' (fp8 GEMM)' if r[w]['f8_gemm'] else ''}" for w in WAYS) + " |")
        (out / "fp8_probe.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
