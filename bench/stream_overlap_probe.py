"""Can a large decode step's attention run beside its GEMMs? At a few hundred requests a llama3-8b layer is its
decode attention (bound by the HBM) then its GEMMs (bound by the tensor cores), one after the other. This probe
times, per layer, at llama3-8b's layout with `rows` requests of `ctx` tokens each:

  gemm      the four linear layers with SiLU x up, alone
  attn      the decode attention (the Mosaic decode kernel, as attention() routes it), alone
  serial    both, independent, as XLA orders them on its one stream
  streams   both, the attention kernel's custom call annotated for a second stream (JAX's compute_on with
            compute_type="gpu_stream:1", under xla_gpu_experimental_stream_annotation): XLA makes it an
            asynchronous call
  whole / halves / halves on stream 1 / grouped
            a decode step's layers (norm, q/k/v, attention, o, MLP) with the rows whole, in two halves, in two
            halves whose attention is annotated (one half's attention could then run beside the other's GEMMs),
            and the same with each half's attention in an XLA scheduling group with the other half's o, MLP and
            next q/k/v (jax.experimental.scheduling_groups): without groups XLA scheduled each call-done right
            after its call-start, so nothing ran beside it. That API marks its call `scheduling_group=NAME`; XLA's
            latency-hiding scheduler reads integer `_scheduling_group_id` attributes, which
            jax.experimental.xla_metadata.set_xla_metadata puts on ordinary ops but not on compute_on's call (its
            lowering writes the call's attributes itself), so whether XLA honours this arm is for the run to show
  grouped, numbered
            the same with each group's calls and ops given their group's integer `_scheduling_group_id` in the
            lowered module before it compiles (number_scheduling_groups)

under each attention CTA count of --num-ctas (the persistent kernel's CTAs; fewer leave SMs to the GEMMs). Only the
kernel's custom call is annotated: XLA fails at run time on an annotated computation that holds calls of its own
(each jnp helper's private function in the kernel's work-list code): "No ExecutionStreamId found for call-start".
--dump-hlo writes each annotated program as XLA scheduled it (where its call-start and call-done sit).

    python3 bench/stream_overlap_probe.py [--rows 768] [--ctx 512] [--layers 8] [--num-ctas 132,66] [--dump-hlo DIR]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))

H, INTER = 4096, 14336                          # llama3-8b's hidden and MLP sizes
STREAM_FLAG = "--xla_gpu_experimental_stream_annotation=true"


def number_scheduling_groups(module) -> int:
    """In place, on a lowered (StableHLO) module: give each call that jax.experimental.scheduling_groups marked
    `scheduling_group=NAME` the integer `_scheduling_group_id` XLA's latency-hiding scheduler reads (one per NAME,
    in order of appearance), on the call and on every op of its callee. A callee is shared by every call site of
    one jitted function (the kernel wrappers), so each marked call gets private copies of the functions it reaches,
    renamed; the bodies of stream-annotated calls (`_xla_stream_annotation`, compute_on's) are shared as they are,
    their call carrying the id. Returns the number of groups."""
    from jax._src.lib.mlir import ir

    funcs = {ir.StringAttr(op.attributes["sym_name"]).value: op for op in module.body.operations
             if "sym_name" in op.attributes}
    names: dict[str, int] = {}
    copies = [0]

    def frontend(op) -> dict:
        if "mhlo.frontend_attributes" not in op.attributes:
            return {}
        d = ir.DictAttr(op.attributes["mhlo.frontend_attributes"])
        return {d[i].name: d[i].attr for i in range(len(d))}

    def mark(op, gid: int) -> None:
        attrs = frontend(op)
        attrs["_scheduling_group_id"] = ir.StringAttr.get(str(gid))
        op.attributes["mhlo.frontend_attributes"] = ir.DictAttr.get(attrs)

    def private_callee(call, gid: int) -> None:
        callee = ir.FlatSymbolRefAttr(call.attributes["callee"]).value
        clone = funcs[callee].clone(ip=ir.InsertionPoint(module.body))
        copies[0] += 1
        name = f"{callee}_group{gid}_{copies[0]}"
        clone.attributes["sym_name"] = ir.StringAttr.get(name)
        call.attributes["callee"] = ir.FlatSymbolRefAttr.get(name)
        funcs[name] = clone
        mark_body(clone, gid)

    def mark_body(op, gid: int) -> None:
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    inner = inner.operation
                    if inner.name == "func.return":
                        continue
                    mark(inner, gid)
                    if inner.name == "func.call" and "_xla_stream_annotation" not in frontend(inner):
                        private_callee(inner, gid)
                    else:
                        mark_body(inner, gid)

    with module.context:
        for op in list(funcs["main"].regions[0].blocks[0].operations):
            op = op.operation
            group = frontend(op).get("scheduling_group")
            if op.name == "func.call" and group is not None:
                gid = names.setdefault(ir.StringAttr(group).value, len(names) + 1)
                mark(op, gid)
                private_callee(op, gid)
    return len(names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=768)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--num-ctas", default="132,66", help="comma list of the attention kernel's CTA counts")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dump-hlo", metavar="DIR", help="write each annotated program's compiled (scheduled) HLO there")
    args = ap.parse_args()
    if STREAM_FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + STREAM_FLAG).strip()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import compute_on as co

    from bench.bench_kernels import BLOCK, LAYOUTS, make_pool, random_tables
    from pallas_kernels import attention
    from pallas_kernels import ragged_paged_attention_mgpu as rpa

    # compute_on(f, *, compute_type, out_memory_spaces) in jax 0.11 is compute_on2 in 0.10 (whose compute_on is a
    # context manager)
    wrap = getattr(co, "compute_on2", None) or co.compute_on
    launch = rpa._launch

    def launch_on_stream_1(*a, **k):
        (out,) = wrap(lambda *x: [launch(*x, **k)], compute_type="gpu_stream:1",
                      out_memory_spaces=jax.memory.Space.Device)(*a)
        return out

    heads, kv_heads, head_dim = LAYOUTS["llama3-8b"]
    r, n = args.rows, args.layers
    ks = jax.random.split(jax.random.PRNGKey(0), 8)
    rng = np.random.default_rng(0)
    per_req = -(-args.ctx // BLOCK)
    blocks = r * per_req + 1
    bf16 = jnp.bfloat16
    q = jax.random.normal(ks[0], (n, r, heads, head_dim), jnp.float32).astype(bf16)
    pool = make_pool(rng, blocks, kv_heads, head_dim, bf16, n)
    tables = random_tables(rng, 1, r, per_req, blocks)[0]
    lens = jnp.full((r,), args.ctx, jnp.int32)
    qsl = jnp.arange(r + 1, dtype=jnp.int32)
    x = (jax.random.normal(ks[2], (r, H), jnp.float32) * 0.1).astype(bf16)
    shapes = {"qkv": (H, (heads + 2 * kv_heads) * head_dim), "o": (heads * head_dim, H), "gate_up": (H, 2 * INTER),
              "down": (INTER, H)}
    w = {k: (jax.random.normal(ks[3 + i], (n,) + s, jnp.float32) * s[0] ** -0.5).astype(bf16)
         for i, (k, s) in enumerate(shapes.items())}
    operands = (q, pool, tables, lens, qsl, x, w)

    def compiled(f, stream: bool, group_ids: bool = False):
        rpa._launch = launch_on_stream_1 if stream else launch        # read when the program is traced
        jax.clear_caches()                  # (the kernels' own jit caches too)
        try:
            lowered = jax.jit(f).lower(*operands)
            if group_ids:       # the module is compiled as changed here
                print(f"  {number_scheduling_groups(lowered.compiler_ir('stablehlo'))} scheduling groups numbered",
                      flush=True)
            exe = lowered.compile()
        finally:
            rpa._launch = launch
        if stream:
            hlo = exe.as_text()
            print(f"  compiled: {hlo.count('call-start(')} call-start", flush=True)
            if args.dump_hlo:
                os.makedirs(args.dump_hlo, exist_ok=True)
                Path(args.dump_hlo, f"stream_{len(os.listdir(args.dump_hlo))}.hlo.txt").write_text(hlo)
        return lambda: exe(*operands)

    def attn_layer(q_i, pool, tables, lens, qsl, i, ctas):
        return attention(q_i, pool, i, tables, lens, qsl, scale=head_dim ** -0.5, decode_only=True,
                         backend="mosaic", num_sms=ctas)

    def layer_in(w, i, h):                  # the input norm's stand-in and the q/k/v projection
        return (h * jax.lax.rsqrt(jnp.mean(jnp.square(h.astype(jnp.float32)), -1, keepdims=True) + 1e-6)
                .astype(h.dtype)) @ w["qkv"][i]

    def layer_out(w, i, h, a):              # o projection, residual, SiLU x up MLP, residual
        h = h + a.reshape(a.shape[0], -1) @ w["o"][i]
        gu = h @ w["gate_up"][i]
        return h + (jax.nn.silu(gu[:, :INTER]) * gu[:, INTER:]) @ w["down"][i]

    def part_attention(q, pool, qsl, qkv, i, meta_j, ctas):
        """A part's attention at layer i, its q from its own q/k/v output (so the data flow is a step's; the pool
        is not written); q, pool, qsl: the program's operands, meta_j: the part's (tables, lens)."""
        m = qkv.shape[0]
        return attn_layer(qkv[:, :heads * head_dim].reshape(m, heads, head_dim) + q[i, :m], pool, *meta_j,
                          qsl[:m + 1], i, ctas)

    def pair_program(kind, ctas):
        """Independent attention and GEMMs, `n` of each: kind "gemm", "attn", "serial" or "streams"."""
        def f(q, pool, tables, lens, qsl, x, w):
            h, acc = x, jnp.zeros((), jnp.float32)
            for i in range(n):
                if kind != "gemm":
                    acc = acc + attn_layer(q[i], pool, tables, lens, qsl, i, ctas)[0, 0, 0].astype(jnp.float32)
                if kind != "attn":
                    h = layer_out(w, i, h, layer_in(w, i, h)[:, :heads * head_dim])
            return acc + h[0, 0].astype(jnp.float32)
        return compiled(f, kind == "streams")

    def decode_program(parts, stream, ctas):
        """A decode step's layers with the rows in `parts` parts."""
        def f(q, pool, tables, lens, qsl, x, w):
            hs, meta = jnp.split(x, parts), list(zip(jnp.split(tables, parts), jnp.split(lens, parts)))
            for i in range(n):
                outs = [part_attention(q, pool, qsl, layer_in(w, i, hs[j]), i, meta[j], ctas) for j in range(parts)]
                hs = [layer_out(w, i, hs[j], outs[j]) for j in range(parts)]
            return sum(h[0, 0].astype(jnp.float32) for h in hs)
        return compiled(f, stream)

    def grouped_program(ctas, group_ids):
        """Two halves, the attention annotated for stream 1, each half's attention in one XLA scheduling group
        (jax.experimental.scheduling_groups) with the other half's o projection, MLP and next q/k/v: the
        latency-hiding scheduler is then to keep that work between the call's start and done."""
        from jax.experimental.scheduling_groups import scheduling_group

        def f(q, pool, tables, lens, qsl, x, w):
            def attend(qkv, i, meta_j):
                return part_attention(q, pool, qsl, qkv, i, meta_j, ctas)

            (ha, hb), meta = jnp.split(x, 2), list(zip(jnp.split(tables, 2), jnp.split(lens, 2)))
            qkv_a, qkv_b = layer_in(w, 0, ha), layer_in(w, 0, hb)
            out_a = attend(qkv_a, 0, meta[0])
            for i in range(n):
                last = i + 1 == n

                def b_beside_a(qkv_b, ha, out_a, i=i, last=last):
                    out_b = attend(qkv_b, i, meta[1])
                    ha = layer_out(w, i, ha, out_a)
                    return out_b, ha, (None if last else layer_in(w, i + 1, ha))
                out_b, ha, qkv_a = scheduling_group(f"layer{i}b")(b_beside_a)(qkv_b, ha, out_a)
                if last:
                    hb = layer_out(w, i, hb, out_b)
                    break

                def a_beside_b(qkv_a, hb, out_b, i=i):
                    out_a = attend(qkv_a, i + 1, meta[0])
                    hb = layer_out(w, i, hb, out_b)
                    return out_a, hb, layer_in(w, i + 1, hb)
                out_a, hb, qkv_b = scheduling_group(f"layer{i}a")(a_beside_b)(qkv_a, hb, out_b)
            return ha[0, 0].astype(jnp.float32) + hb[0, 0].astype(jnp.float32)
        return compiled(f, True, group_ids)

    def per_layer_us(fn):
        jax.block_until_ready(fn())
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6 / n

    def tried(fn, name):
        try:
            return per_layer_us(fn())
        except Exception as e:      # noqa: BLE001 - an arm that fails is a finding, not the end of the probe
            print(f"  {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            return float("nan")

    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; llama3-8b's layout, {r} requests x {args.ctx} "
          f"tokens, {n} layers a program; XLA_FLAGS={os.environ['XLA_FLAGS']!r}; us a layer", flush=True)
    gemm = tried(lambda: pair_program("gemm", None), "gemm")
    print("| attention CTAs | gemm | attn | serial | streams | whole | halves | halves, stream 1 | the same, grouped "
          "| grouped, numbered |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for ctas in (int(c) for c in args.num_ctas.split(",")):
        row = [tried(lambda k=k: pair_program(k, ctas), k) for k in ("attn", "serial", "streams")]
        row += [tried(lambda p=p, s=s: decode_program(p, s, ctas), f"{p} part(s), stream {int(s)}")
                for p, s in ((1, False), (2, False), (2, True))]
        row += [tried(lambda g=g: grouped_program(ctas, g), f"grouped halves{', ids' if g else ''}")
                for g in (False, True)]
        print(f"| {ctas} | {gemm:.1f} | " + " | ".join(f"{v:.1f}" for v in row) + " |", flush=True)


if __name__ == "__main__":
    main()
