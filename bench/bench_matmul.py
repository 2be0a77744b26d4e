"""Linear layers at decode sizes on the GPU: XLA's bf16 dot against the Pallas W4A16 kernel (issue 26) and a
Pallas dense GEMV (issue 24: can a kernel of ours read bf16 weights faster than cuBLAS at M = 1?).

  python3 bench/bench_matmul.py --out DIR [--git-rev REV] [--budget-s 300] [--models llama3-8b,qwen2-0.5b]
      [--rows 1,4,16,64] [--sweep]

For each model's four linear layers (K, N) and each row count M:
  xla-bf16      x @ w, bf16 weights (cuBLAS / XLA's own GEMV fusion)
  int4          pallas_kernels.int4_matmul, group 128, the op's own tiling
  int4-xla      dequantize_int4 then the dot, all in XLA (what a model does without the kernel)
  gguf-int4     the same kernel in its offset form, group 32, float32 scales and mins: a GGUF file's 4-bit
                blocks (Q4_0, Q4_1, Q4_K) as quantization="gguf" repacks them
  gguf-int8     the same kernel on 8-bit values (bits=8), groups of 16 with float32 scales and mins: GGUF's
                other types (Q8_0, Q5_x, Q6_K) and their mixes with 4-bit ones, as quantization="gguf" repacks them
  gguf-q4k-xla  Q4_K blocks expanded in XLA then the dot (what a GGUF layer cost without the kernel)
  gemv-bf16     the Pallas dense GEMV below (M <= 16 only)
--sweep adds, at M = 1, int4 and gemv-bf16 under other tilings (splits, columns per program, warps, stages);
--load-probe, at M = 1, the int4 GEMV's weight loads alone (no arithmetic) under several tilings.
--int4-kwargs K=V[,K=V] (repeatable), at M = 1: int4 and gguf-int4 with those int4_matmul keywords; --only keeps
the named variant families.
Each Pallas variant's output is checked against XLA's dot first (relative error printed). Times: median of
device-synchronised samples (bench_kernels.time_op), each sample's ops reading weight copies that together
exceed the 50 MB L2 (>= 1 GiB or 32 copies); TB/s counts the weight bytes only. Writes
matmul_<device>.json / .md under --out.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

from bench.bench_kernels import rel_err, time_op  # noqa: E402
from pallas_kernels.int4_matmul import (choose_int4_tiling, dequantize_int4, int4_matmul, pack_bits,  # noqa: E402
                                        pack_int4)
from jaxpaged.quantization.gguf_blocks import BLOCK_SIZES, INT4_GROUP, dequantize  # noqa: E402

LINEARS = {   # (name, K, N): qkv, o, gate_up, down
    "llama3-8b": [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)],
    "qwen2-0.5b": [("qkv", 896, 1152), ("o", 896, 896), ("gate_up", 896, 9728), ("down", 4864, 896)],
}
GROUP = 128
T0 = time.time()


def _gemv_kernel(x_ref, w_ref, o_ref, *, block_k, k_per_split, block_n):
    # x_ref: bf16[M, K]; w_ref: bf16[K, N]; o_ref: f32[NS, M, N]
    jn, split = pl.program_id(0), pl.program_id(1)
    m = x_ref.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (16, block_k), 0)
    cols = pl.ds(jn * block_n, block_n)

    def body(i, acc):
        k0 = split * k_per_split + i * block_k
        x = plgpu.load(x_ref.at[pl.ds(0, 16), pl.ds(k0, block_k)], mask=rows < m, other=0.0)
        return acc + plgpu.dot(x, w_ref[pl.ds(k0, block_k), cols])

    acc = jax.lax.fori_loop(0, k_per_split // block_k, body, jnp.zeros((16, block_n), jnp.float32))
    out_rows = jax.lax.broadcasted_iota(jnp.int32, (16, block_n), 0)
    plgpu.store(o_ref.at[split, pl.ds(0, 16), cols], acc, mask=out_rows < m)


@functools.partial(jax.jit, static_argnames=("block_k", "block_n", "num_splits", "num_warps", "num_stages",
                                             "interpret"))
def gemv_bf16(x, w, *, block_k=128, block_n=128, num_splits=8, num_warps=4, num_stages=4, interpret=False):
    """x bf16[M <= 16, K] @ w bf16[K, N]: grid (N / block_n, num_splits), f32 partials summed by XLA."""
    m, k = x.shape
    n = w.shape[1]
    kernel = functools.partial(_gemv_kernel, block_k=block_k, k_per_split=k // num_splits, block_n=block_n)
    out = pl.pallas_call(kernel, grid=(n // block_n, num_splits),
                         out_shape=jax.ShapeDtypeStruct((num_splits, m, n), jnp.float32),
                         compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                         interpret=interpret, name="gemv_bf16")(x, w)
    return jnp.sum(out, axis=0).astype(x.dtype)


def _load_probe_kernel(w_ref, o_ref, *, slabs_per_split, block_n, slabs_per_iter):
    # w_ref: i32[K/8, N]; o_ref: i32[NS, N]. The int4 GEMV's weight loads alone (its grid, its [16, BN] tile a
    # slab), XOR-folded so that nothing is computed on them: how fast this access pattern can read.
    jn, split = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(jn * block_n, block_n)

    def body(i, acc):
        slab0 = split * slabs_per_split + i * slabs_per_iter
        for t in range(slabs_per_iter):
            acc ^= w_ref[pl.ds((slab0 + t) * 16, 16), cols]
        return acc

    acc = jax.lax.fori_loop(0, slabs_per_split // slabs_per_iter, body, jnp.zeros((16, block_n), jnp.int32))
    o_ref[split, cols] = jnp.sum(acc, axis=0)


@functools.partial(jax.jit, static_argnames=("block_n", "num_splits", "slabs_per_iter", "num_warps", "num_stages"))
def load_probe(qweight, *, block_n=64, num_splits=2, slabs_per_iter=1, num_warps=4, num_stages=3):
    """The int4 GEMV's weight reads without its arithmetic (bench only: the memory side's bound)."""
    k8, n = qweight.shape
    slabs = k8 // 16
    kernel = functools.partial(_load_probe_kernel, slabs_per_split=slabs // num_splits, block_n=block_n,
                               slabs_per_iter=slabs_per_iter)
    return pl.pallas_call(kernel, grid=(n // block_n, num_splits),
                          out_shape=jax.ShapeDtypeStruct((num_splits, n), jnp.int32),
                          compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                          name="load_probe")(qweight)


def _gemv_splits(k: int, n: int, block_n: int, block_k: int, sms: int) -> int:
    want = max(1, 4 * sms // (n // block_n))
    steps = k // block_k
    return max(d for d in range(1, steps + 1) if steps % d == 0 and d <= want)


TIMED_OPS = 16        # time_op's n: its longer call runs 2n ops


def weight_sets(nbytes_each: int) -> int:
    """Copies of a weight for the rotation: one per op of time_op's longer call (2n), so that no two ops share
    a weight (XLA merges dots that do into one batched dot), and >= 1 GiB in all (L2 never holds them)."""
    return int(max(2 * TIMED_OPS, math.ceil((1 << 30) / nbytes_each)))


def bench_shape(args, model, name, k, n, m, results, sms):
    rng = np.random.default_rng(k * 7 + n)
    nsets = weight_sets(k * n // 2)
    q = [pack_int4(rng.integers(0, 16, (k, n), dtype=np.uint8)) for _ in range(min(nsets, 4))]
    # Each copy its own array (a tuple argument), not a slice of a stacked one: XLA copies a slice that
    # feeds a custom call or a cuBLAS dot, and that copy would be timed with the op.
    qweights = tuple(jnp.asarray(q[i % len(q)]) for i in range(nsets))            # S x [K/8, N]
    scales = tuple(jnp.asarray(rng.uniform(0.001, 0.01, (k // GROUP, n)), jnp.bfloat16) for _ in range(nsets))
    zeros = tuple(jnp.asarray(rng.integers(0, 16, (k // GROUP, n)), jnp.uint8) for _ in range(nsets))
    nsets_bf16 = weight_sets(2 * k * n)
    w_bf16 = tuple(jax.random.normal(jax.random.PRNGKey(i), (k, n), jnp.bfloat16) * 0.02
                   for i in range(nsets_bf16))
    xs = jax.random.normal(jax.random.PRNGKey(2), (64, m, k), jnp.bfloat16)
    int4_bytes = k * n // 2 + (2 + 1) * (k // GROUP) * n                        # bf16 scales, uint8 zeros
    # GGUF: the offset form (f32 scales and mins per 32 rows), and Q4_K blocks [N, bytes] with small scales
    g_scales = tuple(jnp.asarray(rng.uniform(0.001, 0.01, (k // INT4_GROUP, n)), jnp.float32) for _ in range(nsets))
    g_mins = tuple(jnp.asarray(rng.uniform(-0.08, 0, (k // INT4_GROUP, n)), jnp.float32) for _ in range(nsets))
    gguf_int4_bytes = k * n // 2 + 2 * 4 * (k // INT4_GROUP) * n
    q8 = [pack_bits(rng.integers(0, 256, (k, n), dtype=np.uint8), 8) for _ in range(min(nsets, 2))]
    nsets8 = weight_sets(k * n)
    q8weights = tuple(jnp.asarray(q8[i % len(q8)]) for i in range(nsets8))
    g8_scales = tuple(jnp.asarray(rng.uniform(1e-4, 1e-3, (k // 16, n)), jnp.float32) for _ in range(nsets8))
    g8_mins = tuple(jnp.asarray(rng.uniform(-0.1, 0, (k // 16, n)), jnp.float32) for _ in range(nsets8))
    gguf_int8_bytes = k * n + 2 * 4 * (k // 16) * n
    q4k_size = BLOCK_SIZES["Q4_K"]
    q4k_bytes = n * k // q4k_size[0] * q4k_size[1]
    raw = []
    for _ in range(min(nsets, 4)):
        b = rng.integers(0, 256, (n, k // q4k_size[0], q4k_size[1]), dtype=np.uint8)
        b[..., 0:4] = rng.uniform(1e-5, 1e-4, (n, k // q4k_size[0], 2)).astype(np.float16).view(np.uint8)
        raw.append(b.reshape(n, -1))
    q4k = tuple(jnp.asarray(raw[i % len(raw)]) for i in range(weight_sets(q4k_bytes)))
    variants = {
        "xla-bf16": (lambda i, xs, w: xs[i % 64] @ w[i % nsets_bf16], (xs, w_bf16), 2 * k * n),
        "int4": (lambda i, xs, qw, s, b: int4_matmul(xs[i % 64], qw[i % nsets], s[i % nsets], b[i % nsets]),
                 (xs, qweights, scales, zeros), int4_bytes),
        "int4-xla": (lambda i, xs, qw, s, b: xs[i % 64] @ dequantize_int4(qw[i % nsets], s[i % nsets],
                                                                          b[i % nsets], jnp.bfloat16),
                     (xs, qweights, scales, zeros), int4_bytes),
        "gguf-int4": (lambda i, xs, qw, s, b: int4_matmul(xs[i % 64], qw[i % nsets], s[i % nsets], mins=b[i % nsets]),
                      (xs, qweights, g_scales, g_mins), gguf_int4_bytes),
        "gguf-int8": (lambda i, xs, qw, s, b: int4_matmul(xs[i % 64], qw[i % nsets8], s[i % nsets8],
                                                          mins=b[i % nsets8], bits=8),
                      (xs, q8weights, g8_scales, g8_mins), gguf_int8_bytes),
        "gguf-q4k-xla": (lambda i, xs, w: jax.lax.dot_general(
            xs[i % 64], dequantize(w[i % len(w)], "Q4_K").astype(jnp.bfloat16), (((1,), (1,)), ((), ()))),
            (xs, q4k), q4k_bytes),
    }
    if m == 1:      # the GEMV kernel's float32 form beside its default f16x2 form
        variants["int4 f32-gemv"] = (
            lambda i, xs, qw, s, b: int4_matmul(xs[i % 64], qw[i % nsets], s[i % nsets], b[i % nsets],
                                                gemv_math="f32"), (xs, qweights, scales, zeros), int4_bytes)
        variants["gguf-int4 f32-gemv"] = (
            lambda i, xs, qw, s, b: int4_matmul(xs[i % 64], qw[i % nsets], s[i % nsets], mins=b[i % nsets],
                                                gemv_math="f32"), (xs, qweights, g_scales, g_mins), gguf_int4_bytes)
    if args.load_probe and m == 1:
        ns0 = choose_int4_tiling(m, k, n, sms)[2]
        slabs = k // 128
        for bn, ns, spi in ((64, ns0, 1), (64, ns0, 2), (64, ns0, 4), (128, ns0, 1), (128, ns0, 4), (256, ns0, 4),
                            (64, max(1, ns0 // 2), 4), (128, min(slabs, 2 * ns0), 1)):
            if n % bn or slabs % ns or (slabs // ns) % spi:
                continue
            variants[f"probe-loads bn{bn} ns{ns} it{spi}"] = (
                lambda i, qw, bn=bn, ns=ns, spi=spi: load_probe(qw[i % nsets], block_n=bn, num_splits=ns,
                                                                 slabs_per_iter=spi), (qweights,), k * n // 2)
    if m <= 16:
        ns = _gemv_splits(k, n, 128, 128, sms)
        variants["gemv-bf16"] = (lambda i, xs, w: gemv_bf16(xs[i % 64], w[i % nsets_bf16], num_splits=ns),
                                 (xs, w_bf16), 2 * k * n)
    if args.sweep and m == 1:
        for ns_mult in (0.5, 2):
            for bn in (64, 256):
                steps = k // 128
                ns = max(1, min(steps, int(_gemv_splits(k, n, bn, 128, sms) * ns_mult)))
                while steps % ns:
                    ns -= 1
                variants[f"gemv-bf16 bn{bn} ns{ns}"] = (
                    lambda i, xs, w, bn=bn, ns=ns: gemv_bf16(xs[i % 64], w[i % nsets_bf16], block_n=bn,
                                                             num_splits=ns), (xs, w_bf16), 2 * k * n)
        ns = choose_int4_tiling(m, k, n, sms)[2]
        slabs = k // 128
        other_splits = sorted({d for d in range(1, slabs + 1) if slabs % d == 0 and d in (ns // 2, ns * 2)})
        per_split = slabs // ns
        for kw in ({"num_warps": 2}, {"num_warps": 8}, {"num_stages": 2}, {"num_stages": 4}, {"block_n": 64},
                   {"block_n": 256}, *({"num_splits": d} for d in other_splits),
                   *({"slabs_per_iter": t} for t in (2, 4) if per_split % t == 0),
                   *({"slabs_per_iter": 2, "num_warps": w} for w in (2, 8) if per_split % 2 == 0),
                   {"block_n": 128, "num_warps": 8}):
            label = "int4 " + ",".join(f"{a}={b}" for a, b in kw.items())
            variants[label] = (lambda i, xs, qw, s, b, kw=kw: int4_matmul(xs[i % 64], qw[i % nsets], s[i % nsets],
                                                                          b[i % nsets], **kw),
                               (xs, qweights, scales, zeros), int4_bytes)
    if m == 1:
        for spec in args.int4_kwargs:
            kw = parse_int4_kwargs(spec)
            for base, (s_, b_, form, nbytes) in {"int4": (scales, zeros, "zeros", int4_bytes),
                                                 "gguf-int4": (g_scales, g_mins, "mins", gguf_int4_bytes)}.items():
                variants[f"{base} {spec}"] = (
                    lambda i, xs, qw, s, b, kw=kw, form=form: int4_matmul(xs[i % 64], qw[i % nsets], s[i % nsets],
                                                                          **{form: b[i % nsets]}, **kw),
                    (xs, qweights, s_, b_), nbytes)
    if args.only:
        keep = set(args.only.split(","))
        variants = {label: v for label, v in variants.items() if label.split(" ")[0] in keep}
    ref_bf16 = None
    ref_int4 = None
    for label, (op, data, nbytes) in variants.items():
        if time.time() - T0 > args.budget_s:
            print(f"budget spent: skipping {model} {name} M={m} {label}", flush=True)
            return
        err = None
        try:
            out = jax.jit(lambda *a: op(0, *a))(*data)
            if label.startswith("gguf-int4"):      # against the f32 reference of its own weights (any variant)
                ref = data[0][0].astype(jnp.float32) @ dequantize_int4(qweights[0], g_scales[0], mins=g_mins[0])
                err = rel_err(out, ref)
            elif label == "gguf-int8":
                ref = data[0][0].astype(jnp.float32) @ dequantize_int4(q8weights[0], g8_scales[0], mins=g8_mins[0],
                                                                       bits=8)
                err = rel_err(out, ref)
            elif label.startswith("probe-loads"):
                err = 0.0                 # nothing computed: a read-bandwidth probe
            elif label == "int4" or label.startswith("int4 "):     # the kernel under any keywords
                ref = data[0][0].astype(jnp.float32) @ dequantize_int4(qweights[0], scales[0], zeros[0])
                err = rel_err(out, ref)
            elif label == "gguf-q4k-xla":
                err = 0.0                 # the reference's own expansion
            elif label.startswith("int4"):
                ref_int4 = out if ref_int4 is None else ref_int4
                err = rel_err(out, ref_int4)
            else:
                ref_bf16 = out if ref_bf16 is None else ref_bf16
                err = rel_err(out, ref_bf16)
            dev_s, wall_s = time_op(op, data, n=TIMED_OPS)
        except Exception as e:  # noqa: BLE001  (a tiling Triton refuses is reported, the rest goes on)
            print(f"{model} {name} M={m} {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        row = {"model": model, "linear": name, "K": k, "N": n, "M": m, "variant": label, "us": dev_s * 1e6,
               "wall_us": wall_s * 1e6, "TBps": nbytes / dev_s / 1e12, "weight_bytes": nbytes, "rel_err": err}
        results.append(row)
        print(f"{model:10s} {name:8s} M={m:<4d} {label:28s} {dev_s * 1e6:8.1f} us  {row['TBps']:5.2f} TB/s"
              f"  err {err:.1e}", flush=True)


def parse_int4_kwargs(spec: str) -> dict:
    """"gemv_math=f32,block_n=128,prefetch=False" -> {"gemv_math": "f32", "block_n": 128, "prefetch": False}
    (int4_matmul's keywords)."""
    out: dict = {}
    for item in spec.split(","):
        key, value = item.split("=")
        out[key] = (int(value) if value.lstrip("-").isdigit()
                    else {"True": True, "False": False}.get(value, value))
    return out


def write_outputs(args, results):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0].device_kind
    meta = {"device": device, "jax": jax.__version__, "git_rev": args.git_rev,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv)}
    slug = device.replace(" ", "_")
    (out / f"matmul_{slug}.json").write_text(json.dumps({**meta, "results": results}, indent=1))
    lines = [f"# Linear layers at decode sizes: {device}, jax {jax.__version__}, rev {args.git_rev}", "",
             f"`{meta['command']}`", "",
             "| model | linear | K x N | M | variant | us | weight TB/s | x xla-bf16 |",
             "|---|---|---|---|---|---|---|---|"]
    base = {(r["model"], r["linear"], r["M"]): r["us"] for r in results if r["variant"] == "xla-bf16"}
    for r in results:
        b = base.get((r["model"], r["linear"], r["M"]))
        ratio = f"{r['us'] / b:.2f}" if b else "-"
        lines.append(f"| {r['model']} | {r['linear']} | {r['K']} x {r['N']} | {r['M']} | {r['variant']} | "
                     f"{r['us']:.1f} | {r['TBps']:.2f} | {ratio} |")
    (out / f"matmul_{slug}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--git-rev", default="unknown")
    p.add_argument("--budget-s", type=float, default=300)
    p.add_argument("--models", default="llama3-8b,qwen2-0.5b")
    p.add_argument("--rows", default="1,2,4,8,16,64")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--int4-kwargs", action="append", default=[], metavar="K=V[,K=V]",
                   help="at M = 1, also time int4 and gguf-int4 with these int4_matmul keywords (repeatable)")
    p.add_argument("--only", default="",
                   help="comma list of variant families to time (e.g. xla-bf16,int4,gguf-int4); default all")
    p.add_argument("--load-probe", action="store_true",
                   help="at M = 1, the int4 GEMV's weight loads alone under several tilings (no arithmetic)")
    args = p.parse_args()
    device = jax.devices()[0]
    sms = int(getattr(device, "core_count", 0) or 132)
    print(f"device {device.device_kind}, {sms} SMs, jax {jax.__version__}", flush=True)
    results = []
    for model in args.models.split(","):
        for name, k, n in LINEARS[model]:
            for m in (int(r) for r in args.rows.split(",")):
                bench_shape(args, model, name, k, n, m, results, sms)
    write_outputs(args, results)


if __name__ == "__main__":
    main()
