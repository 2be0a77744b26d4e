"""Whether a decode step's attention (bound by HBM bytes) can run beside its GEMMs (bound by FLOPs at large batches)
on a second CUDA stream: XLA's stream annotation (`jax.experimental.compute_on("gpu_stream:1")`, honoured under
`--xla_gpu_experimental_stream_annotation=true`), the lever for issue 24's large-batch decode steps, whose time is the
sum of the two (NOTES, "A decode step's kernels").

  python3 bench/overlap_probe.py [--reqs 768] [--ctx 512] [--layers 8] [--attn-ctas 132,66,33]

At llama3-8b's layout, `--layers` repetitions in one program of: decode attention over `--reqs` requests of `--ctx`
tokens (the Mosaic decode kernel, as attention() routes it, on `--attn-ctas` CTAs), and the four linear layers with
SiLU x up over `--reqs` rows, on independent data. Arms: attention alone, GEMMs alone, both in one program one after
the other, and both with the attention on the second stream. With overlap, the last arm's time is under the third's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))

HEADS, KV_HEADS, HEAD_DIM, BLOCK, HIDDEN, INTER = 32, 8, 128, 16, 4096, 14336


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reqs", type=int, default=768)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--attn-ctas", default="132,66,33")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dump-hlo", metavar="DIR", help="write each stream arm's compiled (scheduled) HLO there")
    args = ap.parse_args()
    flag = "--xla_gpu_experimental_stream_annotation=true"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import compute_on as co

    # compute_on(f, *, compute_type, out_memory_spaces) in jax 0.11 is compute_on2 in 0.10 (whose compute_on is a
    # context manager)
    wrap = getattr(co, "compute_on2", None) or co.compute_on

    from jaxpaged.pallas_kernels import ragged_paged_attention_mgpu as rpa
    launch = rpa._launch

    def launch_on_stream_1(*a, **k):
        # Only the kernel's custom call goes on the stream: XLA's stream assignment fails on an annotated computation
        # that holds calls of its own (each jnp helper's private function: "No ExecutionStreamId found for
        # call-start"), so the schedule and the padding stay on stream 0.
        (out,) = wrap(lambda *x: [launch(*x, **k)], compute_type="gpu_stream:1",
                      out_memory_spaces=jax.memory.Space.Device)(*a)
        return out

    def compiled(f, stream):
        rpa._launch = launch_on_stream_1 if stream else launch        # read when the program is traced
        jax.clear_caches()                  # (the kernels' own jit caches too)
        try:
            exe = jax.jit(f).lower(q, pool, tables, lens, qsl, x, w).compile()
        finally:
            rpa._launch = launch
        if stream:      # what XLA made of the annotation
            hlo = exe.as_text()
            print(f"  compiled: {hlo.count('call-start')} call-start, {hlo.count('async-start')} async-start",
                  flush=True)
            if args.dump_hlo:
                os.makedirs(args.dump_hlo, exist_ok=True)
                path = os.path.join(args.dump_hlo, f"stream_{len(os.listdir(args.dump_hlo))}.hlo.txt")
                with open(path, "w") as fh:
                    fh.write(hlo)
        return lambda: exe(q, pool, tables, lens, qsl, x, w)

    from jaxpaged.pallas_kernels import attention

    r, n = args.reqs, args.layers
    key = jax.random.PRNGKey(0)
    ks = jax.random.split(key, 8)
    per_req = args.ctx // BLOCK
    blocks = r * per_req + 1
    bf16 = jnp.bfloat16
    q = jax.random.normal(ks[0], (n, r, HEADS, HEAD_DIM), jnp.float32).astype(bf16)
    pool = jax.random.normal(ks[1], (n, 2, blocks, KV_HEADS, BLOCK, HEAD_DIM), jnp.float32).astype(bf16)
    tables = jnp.asarray(np.random.default_rng(0).permutation(np.arange(1, blocks)).reshape(r, per_req), jnp.int32)
    lens = jnp.full((r,), args.ctx, jnp.int32)
    qsl = jnp.arange(r + 1, dtype=jnp.int32)
    x = (jax.random.normal(ks[2], (r, HIDDEN), jnp.float32) * 0.1).astype(bf16)
    w = {"qkv": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), "o": (HEADS * HEAD_DIM, HIDDEN),
         "gate_up": (HIDDEN, 2 * INTER), "down": (INTER, HIDDEN)}
    w = {k: (jax.random.normal(ks[3 + i], (n,) + s, jnp.float32) * 0.02).astype(bf16)
         for i, (k, s) in enumerate(w.items())}

    def attn_layer(q_i, pool, tables, lens, qsl, i, ctas):
        return attention(q_i, pool, i, tables, lens, qsl, scale=HEAD_DIM ** -0.5, decode_only=True,
                         backend="mosaic", num_sms=ctas)

    def gemm_layer(w, i, h):
        qkv = h @ w["qkv"][i]
        o = qkv[:, :HEADS * HEAD_DIM] @ w["o"][i]
        gu = (h + o) @ w["gate_up"][i]
        return h + (jax.nn.silu(gu[:, :INTER]) * gu[:, INTER:]) @ w["down"][i]

    def program(kind, ctas):
        def f(q, pool, tables, lens, qsl, x, w):
            h, acc = x, jnp.zeros((), jnp.float32)
            for i in range(n):
                if kind in ("attn", "seq", "stream"):
                    a = attn_layer(q[i], pool, tables, lens, qsl, i, ctas)
                    acc = acc + a[0, 0, 0].astype(jnp.float32)
                if kind in ("gemm", "seq", "stream"):
                    h = gemm_layer(w, i, h)
            return acc + h[0, 0].astype(jnp.float32)
        return compiled(f, kind == "stream")

    def layer_in(w, i, h):                  # the input norm's stand-in and the q/k/v projection
        return (h * jax.lax.rsqrt(jnp.mean(jnp.square(h.astype(jnp.float32)), -1, keepdims=True) + 1e-6)
                .astype(h.dtype)) @ w["qkv"][i]

    def layer_out(w, i, h, a):              # o projection, residual, SiLU x up MLP, residual
        h = h + a.reshape(a.shape[0], -1) @ w["o"][i]
        gu = h @ w["gate_up"][i]
        return h + (jax.nn.silu(gu[:, :INTER]) * gu[:, INTER:]) @ w["down"][i]

    def decode_program(halves, stream, ctas):
        """A decode step's layers: q/k/v, attention, o and the MLP, with the rows in `halves` parts whose
        attention runs on stream 1 when `stream` (each half's q from its q/k/v output, so the data flow is a
        step's; the pool is not written)."""
        def f(q, pool, tables, lens, qsl, x, w):
            hs = jnp.split(x, halves)
            parts = [(jnp.split(tables, halves)[j], jnp.split(lens, halves)[j]) for j in range(halves)]
            m = r // halves
            for i in range(n):
                outs = []
                for j in range(halves):
                    qkv = layer_in(w, i, hs[j])
                    qj = (qkv[:, :HEADS * HEAD_DIM].reshape(m, HEADS, HEAD_DIM) + q[i, :m])
                    args_ = (qj, pool, parts[j][0], parts[j][1], qsl[:m + 1], i, ctas)
                    outs.append(attn_layer(*args_))
                hs = [layer_out(w, i, hs[j], outs[j]) for j in range(halves)]
            return sum(h[0, 0].astype(jnp.float32) for h in hs)
        return compiled(f, stream)

    def timed(fn):
        jax.block_until_ready(fn())
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; {r} requests x {args.ctx} tokens, {n} layers, "
          f"XLA_FLAGS={os.environ['XLA_FLAGS']!r}", flush=True)
    gemm = timed(program("gemm", None))
    print(f"GEMMs alone: {gemm:.3f} ms ({gemm / n * 1e3:.1f} us a layer)", flush=True)
    for ctas in [int(c) for c in args.attn_ctas.split(",")]:
        row = {}
        for kind in ("attn", "seq", "stream"):
            try:
                row[kind] = timed(program(kind, ctas))
            except Exception as e:      # a failing arm is a finding, not the end of the probe
                print(f"  {kind} on {ctas} CTAs failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                row[kind] = float("nan")
        print(f"attention on {ctas} CTAs: alone {row['attn']:.3f} ms; with the GEMMs one after the other "
              f"{row['seq']:.3f} ms (sum of the parts {row['attn'] + gemm:.3f}); attention on stream 1 "
              f"{row['stream']:.3f} ms: {row['seq'] / row['stream']:.2f}x", flush=True)
        for halves, stream in ((1, False), (2, False), (2, True)):
            try:
                t = timed(decode_program(halves, stream, ctas))
                print(f"  decode layers, {halves} part(s), attention on stream {int(stream)}: {t:.3f} ms "
                      f"({t / n * 1e3:.1f} us a layer)", flush=True)
            except Exception as e:
                print(f"  decode layers, {halves} part(s), stream {int(stream)} failed: {type(e).__name__}: "
                      f"{str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
