"""Can a large decode step's attention run beside its GEMMs? At a few hundred requests a llama3-8b layer is its
decode attention (bound by the HBM) then its GEMMs (bound by the tensor cores), one after the other. This probe
times, per layer, independent pairs of llama3-8b's MLP (gate_up, SiLU x up, down) on `rows` tokens and its decode
attention (the Mosaic decode kernel) over `rows` requests of `ctx` tokens:

  mlp       the MLPs alone              attn      the attentions alone
  serial    both, as XLA orders them on its one stream
  streams   both, each attention in JAX's compute_on2(compute_type="gpu_stream:1"): XLA's explicit stream
            annotation runs it asynchronously on a second stream (xla_gpu_experimental_stream_annotation)

under each attention CTA count of --num-ctas (the persistent kernel's CTAs; fewer leave SMs to the GEMMs). If
`streams` comes near max(mlp, attn) rather than their sum, a step built of two half batches (one's attention
beside the other's GEMMs) could gain up to the smaller of the two.

    python3 bench/stream_overlap_probe.py [--rows 512] [--ctx 384] [--layers 8] [--num-ctas ,66,33] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))

H, INTER = 4096, 14336                          # llama3-8b's hidden and MLP sizes


def make_inputs(rows: int, ctx: int, layers: int, dtype, seed: int = 0) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.bench_kernels import BLOCK, LAYOUTS, make_pool, random_tables
    heads, kv_heads, head_dim = LAYOUTS["llama3-8b"]
    k = iter(jax.random.split(jax.random.PRNGKey(seed), 4 * layers))
    per_req = -(-ctx // BLOCK)
    blocks = rows * per_req + 1
    rng = np.random.default_rng(seed)
    return {
        "x": [jax.random.normal(next(k), (rows, H), dtype) for _ in range(layers)],
        "w_gu": [(jax.random.normal(next(k), (H, 2 * INTER), dtype) * H ** -0.5).astype(dtype) for _ in range(layers)],
        "w_d": [(jax.random.normal(next(k), (INTER, H), dtype) * INTER ** -0.5).astype(dtype) for _ in range(layers)],
        "q": [jax.random.normal(next(k), (rows, heads, head_dim), dtype) for _ in range(layers)],
        "pool": make_pool(rng, blocks, kv_heads, head_dim, dtype, layers),
        "tables": random_tables(rng, 1, rows, per_req, blocks)[0], "lens": jnp.full((rows,), ctx, jnp.int32),
    }


def variants(layers: int, num_ctas: int | None, interpret: bool) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.experimental import compute_on as co

    from jaxpaged.pallas_kernels import paged_decode_attention_reference
    from jaxpaged.pallas_kernels.paged_decode_attention_mgpu import paged_decode_attention_mgpu

    def mlp(x, w_gu, w_d):
        g, u = jnp.split(x @ w_gu, 2, axis=-1)
        return (jax.nn.silu(g) * u) @ w_d

    def attn(q, pool, layer, tables, lens):
        if interpret:       # the CPU (a smoke run of this script): the plain-jnp decode attention
            return paged_decode_attention_reference(q, pool, jnp.int32(layer), tables, lens, scale=q.shape[-1] ** -0.5)
        return paged_decode_attention_mgpu(q, pool, jnp.int32(layer), tables, lens, scale=q.shape[-1] ** -0.5,
                                           num_ctas=num_ctas, interpret=False)

    def build(use_mlp: bool, use_attn: bool, stream: bool):
        def f(inp):
            outs = []
            for i in range(layers):
                if use_attn:
                    a = (lambda q, p, t, n, i=i: attn(q, p, i, t, n))
                    args = (inp["q"][i], inp["pool"], inp["tables"], inp["lens"])
                    if stream:
                        # compute_on2(f, compute_type=, out_memory_spaces=) in jax 0.10; the same function is
                        # compute_on in jax 0.11.2
                        wrap = getattr(co, "compute_on2", co.compute_on)
                        outs.append(wrap(a, compute_type="gpu_stream:1",
                                         out_memory_spaces=jax.memory.Space.Device)(*args))
                    else:
                        outs.append(a(*args))
                if use_mlp:
                    outs.append(mlp(inp["x"][i], inp["w_gu"][i], inp["w_d"][i]))
            return outs
        return jax.jit(f)
    return {"mlp": build(True, False, False), "attn": build(False, True, False),
            "serial": build(True, True, False), "streams": build(True, True, True)}


def time_call(f, inp, n: int = 10) -> float:
    import jax
    import numpy as np
    for _ in range(3):
        jax.block_until_ready(f(inp))
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(inp))
        t.append(time.perf_counter() - t0)
    return float(np.median(t))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--num-ctas", default=",66,33", help="comma list; empty entry: the kernel's default (one a SM)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    interpret = jax.default_backend() == "cpu"
    inp = make_inputs(args.rows, args.ctx, args.layers, jnp.bfloat16)
    results = []
    for c in args.num_ctas.split(","):
        ctas = int(c) if c.strip() else None
        vs = variants(args.layers, ctas, interpret)
        row = {"num_ctas": ctas}
        for name, f in vs.items():
            if ctas is not None and name == "mlp" and results:
                row[name] = results[0]["mlp"]           # the MLPs do not depend on the attention's CTAs
                continue
            try:
                row[name] = 1e6 * time_call(f, inp, 2 if interpret else 10) / args.layers
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is a finding, not a stop
                row[name] = None
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        hlo = vs["streams"].lower(inp).compile().as_text() if "streams_error" not in row else ""
        row["streams_async_ops"] = hlo.count("-start(") + hlo.count("async-start")
        if all(row.get(k) for k in ("mlp", "attn", "streams")):
            row["streams_over_max"] = row["streams"] / max(row["mlp"], row["attn"])
            row["serial_over_sum"] = row["serial"] / (row["mlp"] + row["attn"])
        results.append(row)
        print(json.dumps(row), flush=True)
    dev = jax.devices()[0].device_kind
    print(f"\n{dev}, jax {jax.__version__}: llama3-8b MLP on {args.rows} rows and decode attention over {args.rows} x "
          f"{args.ctx}, {args.layers} independent layer pairs a call; us a layer")
    print("| attention CTAs | mlp | attn | serial | streams | streams / max(mlp, attn) | async ops |")
    print("|---|---|---|---|---|---|---|")
    fmt = lambda v: "-" if v is None else f"{v:.1f}"     # noqa: E731
    for r in results:
        print(f"| {r['num_ctas'] or 'default'} | {fmt(r.get('mlp'))} | {fmt(r.get('attn'))} | {fmt(r.get('serial'))} | "
              f"{fmt(r.get('streams'))} | {fmt(r.get('streams_over_max'))} | {r['streams_async_ops']} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "stream_overlap.json").write_text(json.dumps(
            {"device": dev, "jax": jax.__version__, "args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
