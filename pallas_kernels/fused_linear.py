"""A decoder layer's linear layers at a few rows (a small decode batch), each with its neighbours fused in:
Pallas (Triton) kernels with a plain-jnp reference.

Legend: M rows of x (tokens, M <= FUSED_MAX_ROWS), K input features, N output features, D head dim, P = D / 2.

Why: at one to a few rows every linear layer reads its whole weight for a handful of FMAs per weight, and the
small operations between them (the RMSNorm's reduction and scale, the q/k/v bias, RoPE, the SiLU and its
product, each residual add) are kernels of their own, a few microseconds each however little they compute. At
one row qwen2-0.5b's layer on the H100 is ~17 such kernels for 4 matmuls. Here a layer is four kernels (plus
the KV write and attention), one per weight:

    "qkv"       RMSNorm(x) @ W_qkv (+ bias), RoPE on q and k, q / k / v as separate outputs; one program a head
                (its first and second halves as two [K, P] column tiles, so rotate_half is local to the program)
    "residual"  residual + x @ W (the attention's output projection, the MLP's down projection)
    "swiglu"    SiLU(g) * u with [g | u] = RMSNorm(x) @ W_gate_up (one program reads a gate tile and the
                matching up tile)
    "plain"     [RMSNorm(x)] @ W (+ bias): the building block, for tests and layers that need no neighbour

The RMSNorm is folded as norm(x) @ W = r * ((x * w_norm) @ W), r = rsqrt(mean(x^2) + eps) per row, so a
program reads its rows of x once: it accumulates sum(x^2) while it streams K, and scales the dot's rows by r
at the end. (HF rounds x * r to the dtype before the weight multiplies it; here x * w_norm is rounded
instead: a different rounding point, within the dtype's precision.) Elsewhere each value is rounded to the
dtype where the unfused layer rounds it (the matmul's output, the bias add, RoPE's products, SiLU, the
product, the residual add), so a fused layer computes what the unfused one does up to the dot's summation
order and the norm's rounding point.

Each program holds all of K for its columns (no split-K: a split would need its partial sums reduced by
another kernel, which is what this is for). Rows are padded to one 16-row tensor-core tile (masked loads and
stores). Float32 weights take the dot at HIGHEST precision (no TF32), so a float32 model stays float32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

FUSED_MAX_ROWS = 16          # the one 16-row tile a program computes
_TILE_BYTES = 32 * 1024      # a [BK, BN] weight tile's bytes, about: K chunks sized so narrow column tiles still
                             # keep enough bytes in flight per program
MODES = ("plain", "residual", "swiglu", "qkv")


def _k_block(k: int, block_n: int, itemsize: int) -> int:
    """The largest power of two from 32 dividing K whose [BK, BN] tile is at most _TILE_BYTES (at least 32)."""
    bk = 32
    while k % (bk * 2) == 0 and bk * 2 * block_n * itemsize <= _TILE_BYTES:
        bk *= 2
    return bk


def _n_block(n: int, sms: int) -> int:
    """Columns a program: the widest of 64, 32, 16 dividing N that still gives about one program per SM."""
    for bn in (64, 32):
        if n % bn == 0 and n // bn >= sms:
            return bn
    return 16 if n % 16 == 0 else 32


def _qkv_block(half: int, heads: int, sms: int) -> int:
    """Columns of a head half a "qkv" program: the widest of half, 64, 32, 16 dividing it that still gives about
    one program per SM."""
    for bn in (half, 64, 32):
        if half % bn == 0 and heads * (half // bn) >= sms:
            return bn
    return 16


def check(k: int, n: int, head_dim: int | None = None) -> str | None:
    """Why a layer of K x N cannot run here, or None."""
    if k % 32:
        return f"input features {k} not a multiple of 32"
    if head_dim is not None and (head_dim % 32 or n % head_dim):
        return f"head dim {head_dim} not a multiple of 32 dividing {n}"
    if head_dim is None and n % 16:
        return f"output features {n} not a multiple of 16"
    return None


def _round(v, dtype):
    """v rounded to dtype, back in float32 (the unfused layer's rounding points)."""
    return v.astype(dtype).astype(jnp.float32)


def _kernel(*refs, mode, has_norm, has_bias, eps, block_k, block_n, num_heads, num_kv_heads, rope, half):
    # refs, in order: x dtype[M, K]; norm weight [K] (has_norm); W [K, N']; bias [N'] (has_bias);
    # residual dtype[M, N] ("residual"); cos, sin f32[M, P] ("qkv" with rope); outputs: dtype[M, N]
    # ("plain", "residual"), dtype[M, N'/2] ("swiglu"), or q dtype[M, N_q], k and v dtype[M, N_kv] ("qkv")
    refs = list(refs)
    x_ref = refs.pop(0)
    nw_ref = refs.pop(0) if has_norm else None
    w_ref = refs.pop(0)
    b_ref = refs.pop(0) if has_bias else None
    res_ref = refs.pop(0) if mode == "residual" else None
    cos_ref, sin_ref = (refs.pop(0), refs.pop(0)) if mode == "qkv" and rope else (None, None)
    out_refs = refs
    dtype = x_ref.dtype
    w_dtype = w_ref.dtype
    num_rows, k = x_ref.shape
    j = pl.program_id(0)
    rows = jax.lax.broadcasted_iota(jnp.int32, (FUSED_MAX_ROWS, block_k), 0)
    row_ok = rows < num_rows
    precision = jax.lax.Precision.HIGHEST if w_dtype == jnp.float32 else None
    if mode == "swiglu":                       # a gate tile and the up tile N'/2 columns on
        starts = [j * block_n, w_ref.shape[1] // 2 + j * block_n]
    elif mode == "qkv":                        # block_n columns of a head's first half, and their rope partners
        per_head = half // block_n
        head, part = j // per_head, j % per_head
        starts = [head * 2 * half + part * block_n, head * 2 * half + half + part * block_n]
    else:
        starts = [j * block_n]

    def body(i, carry):
        accs, ss = carry
        ks = pl.ds(i * block_k, block_k)
        xk = plgpu.load(x_ref.at[pl.ds(0, FUSED_MAX_ROWS), ks], mask=row_ok, other=0.0).astype(jnp.float32)
        if has_norm:
            ss = ss + jnp.sum(xk * xk, axis=1)
            xk = xk * nw_ref[ks].astype(jnp.float32)[None, :]
        a = xk.astype(dtype).astype(w_dtype)
        accs = tuple(acc + plgpu.dot(a, w_ref[ks, pl.ds(start, block_n)], precision=precision)
                     for acc, start in zip(accs, starts))
        return accs, ss

    init = (tuple(jnp.zeros((FUSED_MAX_ROWS, block_n), jnp.float32) for _ in starts),
            jnp.zeros((FUSED_MAX_ROWS,), jnp.float32))
    accs, ss = jax.lax.fori_loop(0, k // block_k, body, init)
    if has_norm:
        r = jax.lax.rsqrt(ss / k + eps)[:, None]
        accs = tuple(acc * r for acc in accs)
    ys = [_round(acc, dtype) for acc in accs]                                     # the matmul's output
    if has_bias:
        ys = [_round(y + b_ref[pl.ds(start, block_n)].astype(jnp.float32)[None, :], dtype)
              for y, start in zip(ys, starts)]
    out_rows = jax.lax.broadcasted_iota(jnp.int32, (FUSED_MAX_ROWS, block_n), 0)
    out_ok = out_rows < num_rows
    tile_rows = pl.ds(0, FUSED_MAX_ROWS)

    def store(ref, col, value):
        plgpu.store(ref.at[tile_rows, pl.ds(col, block_n)], value.astype(ref.dtype), mask=out_ok)

    if mode == "plain":
        store(out_refs[0], starts[0], ys[0])
    elif mode == "residual":
        res = plgpu.load(res_ref.at[tile_rows, pl.ds(starts[0], block_n)], mask=out_ok, other=0.0)
        store(out_refs[0], starts[0], res.astype(jnp.float32) + ys[0])
    elif mode == "swiglu":                      # nn.silu: x * sigmoid(x), each op rounded as XLA rounds it
        g, u = ys
        act = _round(g * _round(jax.nn.sigmoid(g), dtype), dtype)
        store(out_refs[0], starts[0], act * u)
    else:
        x1, x2 = ys
        q_ref, k_ref, v_ref = out_refs
        if rope:                                # HF's rotate_half, in the dtype as models/decoder._rotate computes
            c = _round(plgpu.load(cos_ref.at[tile_rows, pl.ds(part * block_n, block_n)], mask=out_ok, other=0.0),
                       dtype)
            s = _round(plgpu.load(sin_ref.at[tile_rows, pl.ds(part * block_n, block_n)], mask=out_ok, other=0.0),
                       dtype)
            r1 = _round(_round(x1 * c, dtype) - _round(x2 * s, dtype), dtype)
            r2 = _round(_round(x2 * c, dtype) + _round(x1 * s, dtype), dtype)
        else:
            r1, r2 = x1, x2
        def store_head(ref, h, first, second):
            store(ref, h * 2 * half + part * block_n, first)
            store(ref, h * 2 * half + half + part * block_n, second)

        @pl.when(head < num_heads)
        def _():
            store_head(q_ref, head, r1, r2)

        @pl.when((head >= num_heads) & (head < num_heads + num_kv_heads))
        def _():
            store_head(k_ref, head - num_heads, r1, r2)

        @pl.when(head >= num_heads + num_kv_heads)
        def _():
            store_head(v_ref, head - num_heads - num_kv_heads, x1, x2)


@functools.partial(jax.jit, static_argnames=("mode", "eps", "num_heads", "num_kv_heads", "head_dim", "block_n",
                                             "block_k", "num_warps", "num_stages", "sms", "interpret"))
def fused_linear(x, w, *, mode: str = "plain", norm_weight=None, eps: float = 1e-6, bias=None, residual=None,
                 cos=None, sin=None, num_heads: int = 0, num_kv_heads: int = 0, head_dim: int = 0,
                 block_n: int | None = None, block_k: int | None = None, num_warps: int = 4, num_stages: int = 3,
                 sms: int = 132, interpret: bool | None = None):
    """x dtype[M, K] (M <= FUSED_MAX_ROWS) through W [K, N'] (x's dtype, or float32 holding its values) with
    the mode's neighbours (module docstring). norm_weight [K]: RMSNorm x first (Llama's form, eps). bias [N'].
    "residual": residual dtype[M, N] added. "swiglu": W is [gate | up], N' = 2 N, out SiLU(g) * u.
    "qkv": W is [q | k | v] for num_heads / num_kv_heads heads of head_dim; cos, sin f32[M, P] rotate q and k
    (None: no RoPE, e.g. ALiBi); returns (q, k, v) as dtype[M, heads * D]. Otherwise returns dtype[M, N]."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    m, k = x.shape
    kw, n_all = w.shape
    if m > FUSED_MAX_ROWS or kw != k:
        raise ValueError(f"x {x.shape} and W {w.shape}: at most {FUSED_MAX_ROWS} rows, K equal")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    heads = num_heads + 2 * num_kv_heads
    if mode == "qkv":
        if n_all != heads * head_dim:
            raise ValueError(f"W {w.shape} is not q, k, v of {num_heads} + 2 x {num_kv_heads} heads of {head_dim}")
        why = check(k, n_all, head_dim)
        half = n = head_dim // 2
        block_n = block_n or _qkv_block(half, heads, sms)
        if half % block_n or block_n % 16:
            raise ValueError(f"block_n {block_n}: a multiple of 16 dividing half the head dim {half}")
        grid = heads * (half // block_n)
    else:
        n = n_all // 2 if mode == "swiglu" else n_all
        half = 0
        why = check(k, n)
        block_n = block_n or _n_block(n, sms)
        grid = n // block_n
    if why is not None:
        raise ValueError(why)
    block_k = block_k or _k_block(k, block_n * (2 if mode in ("swiglu", "qkv") else 1), w.dtype.itemsize)
    rope = mode == "qkv" and cos is not None
    args = [x] + ([norm_weight] if norm_weight is not None else []) + [w] + ([bias] if bias is not None else [])
    if mode == "residual":
        if residual is None or residual.shape != (m, n):
            raise ValueError(f"mode residual needs residual [{m}, {n}]")
        args.append(residual)
    if rope:
        args += [cos.astype(jnp.float32), sin.astype(jnp.float32)]
    out_shape: tuple | jax.ShapeDtypeStruct = jax.ShapeDtypeStruct((m, n), x.dtype)
    if mode == "qkv":
        out_shape = tuple(jax.ShapeDtypeStruct((m, hn * head_dim), x.dtype)
                          for hn in (num_heads, num_kv_heads, num_kv_heads))
    kernel = functools.partial(_kernel, mode=mode, has_norm=norm_weight is not None, has_bias=bias is not None,
                               eps=eps, block_k=block_k, block_n=block_n, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, rope=rope, half=half)
    return pl.pallas_call(kernel, grid=(grid,), out_shape=out_shape,
                          compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                          interpret=interpret, name=f"fused_linear_{mode}")(*args)


def fused_linear_reference(x, w, *, mode: str = "plain", norm_weight=None, eps: float = 1e-6, bias=None,
                           residual=None, cos=None, sin=None, num_heads: int = 0, num_kv_heads: int = 0,
                           head_dim: int = 0):
    """Plain jnp, the unfused layer's operations in its order (HF's RMSNorm: x * r rounded, then times the
    weight; the dot in float32; each result rounded to x's dtype)."""
    dtype = x.dtype
    if norm_weight is not None:
        x32 = x.astype(jnp.float32)
        xn = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(dtype)
        x = (norm_weight.astype(jnp.float32) * xn.astype(jnp.float32)).astype(dtype)
    y = _round(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST), dtype)
    if bias is not None:
        y = _round(y + bias.astype(jnp.float32), dtype)
    if mode == "plain":
        return y.astype(dtype)
    if mode == "residual":
        return (residual.astype(jnp.float32) + y).astype(dtype)
    if mode == "swiglu":
        g, u = jnp.split(y, 2, axis=-1)
        act = _round(g * _round(jax.nn.sigmoid(g), dtype), dtype)
        return (act * u).astype(dtype)
    m = x.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = y[:, :q_size].reshape(m, num_heads, head_dim)
    k = y[:, q_size:q_size + kv_size].reshape(m, num_kv_heads, head_dim)
    v = y[:, q_size + kv_size:]

    def rotate(t):
        if cos is None:
            return t
        c = _round(cos.astype(jnp.float32), dtype)[:, None, :]
        s = _round(sin.astype(jnp.float32), dtype)[:, None, :]
        t1, t2 = jnp.split(t, 2, axis=-1)
        r1 = _round(_round(t1 * c, dtype) - _round(t2 * s, dtype), dtype)
        r2 = _round(_round(t2 * c, dtype) + _round(t1 * s, dtype), dtype)
        return jnp.concatenate([r1, r2], axis=-1)
    return (rotate(q).reshape(m, q_size).astype(dtype), rotate(k).reshape(m, kv_size).astype(dtype),
            v.astype(dtype))


__all__ = ["FUSED_MAX_ROWS", "MODES", "check", "fused_linear", "fused_linear_reference"]
