"""The kernels around the W4A16 GEMVs of a one-row decode layer: one Pallas (Triton) kernel for each place where
XLA makes three, taking the GEMV before it as partial sums (int4_matmul's keep_splits) or giving the GEMV after it
its float16 pairs of x (int4_matmul's x_pairs), with whatever else the layer needs from the same values.

    rms_norm_gemv_x    the norm before q/k/v and gate/up: RMSNorm's output, its maximum, its pairs
    silu_mul_gemv_x    the SwiGLU product before down, from the gate/up GEMV's partial sums: its pairs and a
                       bound a slab
    rope_qkv           q, k and v with RoPE, from the q/k/v GEMV's partial sums (or a dense projection's output),
                       with its bias and Qwen3's q/k norms; it can store k and v into the pool (write_kv's store)

A decode layer of one request is ~25 us of small kernels beside its ~52 us of 4-bit GEMVs (llama3-8b on the
H100), each near a launch's floor, so the count of kernels is what these save: 2.5, 1.6 and 1.4 us where XLA's
three took ~4, 4.4 and 3.7 (bench/results/NOTES.md). Each computes what models/decoder.py computes in the
model's dtype, rounded where it rounds, and the pairs as prepare_gemv_x makes them (pallas_kernels/int4_matmul.py:
layout and scaling); each has a plain-jnp `*_reference` that computes the same.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._checks import check_triton_offsets, to_cache
from .int4_matmul import _NIBBLE_ROWS, PACK_ROWS, _f16_pair, _pow2_chunks, _pow2_scale, prepare_gemv_x, slab_pairs
from .kv_write import write_kv_reference


def _rounded(v, dtype):
    """v's float32 value rounded to dtype (the model's rounding of a step it computes in dtype)."""
    return v.astype(dtype).astype(jnp.float32)


def _norm_gemv_x_kernel(x_ref, w_ref, y_ref, p_ref, a_ref, *, eps, plus_one, features):
    # x_ref, w_ref, y_ref: [S, 8, 16] (slab, value position j, row r: input row 128 s + 16 j + r), x's dtype
    # p_ref: i32[S, 4, 16], pair p of slab s and row r (prepare_gemv_x's layout); a_ref: f32[1], max |y|
    # Positions j < 4 and j >= 4 are loaded apart: they are each pair's low and high halves. S slabs are taken in
    # chunks of a power of two of them (a Triton block's shape).
    def total(v, reduce):                     # over every axis, one at a time (Triton reduces one axis a call)
        while v.ndim:
            v = reduce(v, axis=-1)
        return v

    chunks = [pl.ds(start, size) for start, size in _pow2_chunks(features // PACK_ROWS)]
    xs = [[x_ref[c, pl.ds(j0, 4), :].astype(jnp.float32) for j0 in (0, 4)] for c in chunks]
    ws = [[w_ref[c, pl.ds(j0, 4), :] for j0 in (0, 4)] for c in chunks]
    inv_rms = jax.lax.rsqrt(functools.reduce(jnp.add, [total(x * x, jnp.sum) for xc in xs for x in xc]) / features
                            + eps)
    if plus_one:        # RMSNorm's two forms (models/decoder.py), rounded where it rounds
        ys = [[(x * inv_rms * (1.0 + w.astype(jnp.float32))).astype(y_ref.dtype) for x, w in zip(xc, wc)]
              for xc, wc in zip(xs, ws)]
    else:
        ys = [[w * (x * inv_rms).astype(y_ref.dtype) for x, w in zip(xc, wc)] for xc, wc in zip(xs, ws)]
    y32 = [[y.astype(jnp.float32) for y in yc] for yc in ys]
    amax = functools.reduce(jnp.maximum, [total(jnp.abs(y), jnp.max) for yc in y32 for y in yc])
    scale, _ = _pow2_scale(amax)
    for c, yc, y32c in zip(chunks, ys, y32):
        odd = jax.lax.broadcasted_iota(jnp.int32, yc[0].shape, 1) % 2 == 1
        factor = jnp.where(odd, scale * (1.0 / 16), scale)
        p_ref[c, :, :] = _f16_pair(y32c[0] * factor, y32c[1] * factor, asm=False)
        y_ref[c, pl.ds(0, 4), :] = yc[0]
        y_ref[c, pl.ds(4, 4), :] = yc[1]
    a_ref[...] = jnp.broadcast_to(amax, (1,))


NORM_MAX_SLABS = 128        # rows of up to 16,384 features: one program holds a row


def norm_gemv_x_supported(features: int) -> bool:
    """Whether rms_norm_gemv_x takes rows of this many features: whole slabs, up to NORM_MAX_SLABS of them."""
    return features % PACK_ROWS == 0 and 0 < features // PACK_ROWS <= NORM_MAX_SLABS


@functools.partial(jax.jit, static_argnames=("eps", "plus_one", "interpret"))
def rms_norm_gemv_x(x, weight, *, eps: float, plus_one: bool = False, interpret: bool | None = None):
    """One row's RMSNorm and the f16x2 GEMV's operands of its output in one kernel: x dtype[1, K], weight
    dtype[K] -> (y dtype[1, K] as models/decoder.py's RMSNorm computes it, its float16 pairs i32[1, K/2] as
    prepare_gemv_x makes them, max |y| f32[1]: int4_matmul's x_pairs). What XLA makes of the same (the norm's
    reduction, a kernel for the scalar both the pairs and the GEMV read, the pairs) is three kernels.
    plus_one: Gemma's form, scaled by (1 + w). K: norm_gemv_x_supported."""
    m, k = x.shape
    if m != 1 or weight.shape != (k,) or not norm_gemv_x_supported(k):
        raise ValueError(f"rms_norm_gemv_x takes one row of whole slabs, up to {NORM_MAX_SLABS} of them: x "
                         f"{x.shape}, weight {weight.shape}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    slabs = k // PACK_ROWS
    y, pairs, amax = pl.pallas_call(
        functools.partial(_norm_gemv_x_kernel, eps=eps, plus_one=plus_one, features=k),
        out_shape=(jax.ShapeDtypeStruct((slabs, 8, _NIBBLE_ROWS), x.dtype),
                   jax.ShapeDtypeStruct((slabs, 4, _NIBBLE_ROWS), jnp.int32),
                   jax.ShapeDtypeStruct((1,), jnp.float32)),
        # 4 warps up to 32 slabs (measured at llama3-8b's 4096 features), more for wider rows' registers
        compiler_params=plgpu.CompilerParams(num_warps=max(4, min(16, slabs // 8)), num_stages=1),
        interpret=interpret,
        name="rms_norm_gemv_x",
    )(x.reshape(slabs, 8, _NIBBLE_ROWS), weight.astype(x.dtype).reshape(slabs, 8, _NIBBLE_ROWS))
    return y.reshape(1, k), pairs.reshape(1, k // 2), amax


def _silu_mul_gemv_x_kernel(g_ref, p_ref, a_ref, *, parts, dtype):
    # g_ref: [P, 2, S, 8, 16] the gate/up GEMV's output in P parts (its splits' partial sums, or P = 1 the output),
    # gate then up, input row 128 s + 16 j + r at [s, j, r]; p_ref: i32[S, 4, 16] the pairs (prepare_gemv_x's
    # layout), each slab's scaled by its own bound; a_ref: f32[S], each slab's max |silu(gate) * up|. One program a
    # slab: a slab's pairs need only its own bound.
    slab = pl.program_id(0)

    rounded = functools.partial(_rounded, dtype=dtype)

    def part_sum(which, j0):
        return functools.reduce(jnp.add, [g_ref[p, which, slab, pl.ds(j0, 4), :].astype(jnp.float32)
                                          for p in range(parts)])

    halves = []                           # value positions 0-3 and 4-7, [4, 16] each
    for j0 in (0, 4):                     # as MLP computes it: the GEMV's output, the SiLU, the product, each rounded
        gate, up = rounded(part_sum(0, j0)), rounded(part_sum(1, j0))
        act = rounded(gate * rounded(1.0 / (1.0 + jnp.exp(-gate))))
        halves.append(rounded(act * up))
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.max(jnp.abs(v), axis=1), axis=0) for v in halves])
    scale, _ = _pow2_scale(amax)
    odd = jax.lax.broadcasted_iota(jnp.int32, (4, _NIBBLE_ROWS), 0) % 2 == 1
    factor = jnp.where(odd, scale * (1.0 / 16), scale)
    p_ref[slab, :, :] = _f16_pair(halves[0] * factor, halves[1] * factor, asm=False)
    a_ref[pl.ds(slab, 1)] = jnp.broadcast_to(amax, (1,))


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
def silu_mul_gemv_x(gate_up, *, dtype, interpret: bool | None = None):
    """One row's SwiGLU product and the f16x2 GEMV's operands of it in one kernel, for the down projection:
    gate_up f32[P, 1, 2I] (int4_matmul's keep_splits output: the gate/up GEMV's partial sums over its splits, gate
    then up) or dtype[1, 1, 2I] -> (the float16 pairs i32[1, I/2] of silu(gate) * up as MLP computes it in dtype,
    f32[I/128] the max |.| of each 128-row slab), int4_matmul's x_pairs: each slab's pairs scaled by its own
    bound, whose inverse the GEMV folds into that slab's group scales. What XLA makes of the same (the splits' sum
    with the SiLU and product, the maximum, the pairs) is three kernels. One program a slab: with one bound for
    all of I the pairs would wait on a reduction over every program."""
    parts, m, width = gate_up.shape
    inter = width // 2
    if m != 1 or width % 2 or inter % PACK_ROWS:
        raise ValueError(f"silu_mul_gemv_x takes one row of gate and up, whole slabs: {gate_up.shape}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    slabs = inter // PACK_ROWS
    pairs, amax = pl.pallas_call(
        functools.partial(_silu_mul_gemv_x_kernel, parts=parts, dtype=jnp.dtype(dtype)),
        grid=(slabs,),
        out_shape=(jax.ShapeDtypeStruct((slabs, 4, _NIBBLE_ROWS), jnp.int32),
                   jax.ShapeDtypeStruct((slabs,), jnp.float32)),
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="silu_mul_gemv_x",
    )(gate_up.reshape(parts, 2, slabs, 8, _NIBBLE_ROWS))
    return pairs.reshape(1, inter // 2), amax


def _rope_qkv_kernel(*refs, parts, q_heads, kv_heads, dtype, bias, eps, kv_write, kv_scaled):
    # parts_ref: [P, (q_heads + 2 kv_heads) * 2, D/2] the q/k/v GEMV's output in P parts, each head's two halves;
    # with bias, b_ref: dtype[(q_heads + 2 kv_heads) * 2, D/2] the projection's bias; with q/k norms (eps not
    # None), n_ref: dtype[2, 2, D/2] q_norm's and k_norm's weights, each in halves; cos_ref, sin_ref: f32[1, D/2];
    # with kv_write: layer_ref i32[1], slot_ref i32[1], (kv_scaled) scale_ref f32[2] k's and v's scales, the
    # pool [L, 2, B, K, S, D] (in, aliased to out); q_ref: [q_heads, 2, D/2], and without kv_write k_ref, v_ref:
    # [kv_heads, 2, D/2]. Program h: head h of q, then of k (both normed if so, then rotated), then of v (copied);
    # with kv_write k's and v's heads go into the pool (write_kv's store) instead of out.
    refs = list(refs)
    parts_ref = refs.pop(0)
    b_ref = refs.pop(0) if bias else None
    n_ref = refs.pop(0) if eps is not None else None
    cos_ref, sin_ref = refs.pop(0), refs.pop(0)
    if kv_write:
        layer_ref, slot_ref = refs.pop(0), refs.pop(0)
        scale_ref = refs.pop(0) if kv_scaled else None
        _, q_ref, cache_ref = refs
    else:
        q_ref, k_ref, v_ref = refs
    h = pl.program_id(0)
    half = cos_ref.shape[1]

    rounded = functools.partial(_rounded, dtype=dtype)

    def head_half(which):       # the projection's output as Int4Linear rounds it: the sum, then the bias added
        row = pl.ds(2 * h + which, 1)
        y = rounded(functools.reduce(jnp.add, [parts_ref[p, row, pl.ds(0, half)].astype(jnp.float32)
                                               for p in range(parts)]))                 # [1, D/2]
        return rounded(y + b_ref[row, :].astype(jnp.float32)) if b_ref is not None else y

    x1, x2 = head_half(0), head_half(1)
    y1, y2 = x1, x2
    if n_ref is not None:       # Qwen3's q_norm / k_norm over the head, RMSNorm's Llama form (models/decoder.py)
        def total(v):
            return jnp.sum(jnp.sum(v, axis=1), axis=0)
        inv_rms = jax.lax.rsqrt((total(x1 * x1) + total(x2 * x2)) / (2 * half) + eps)
        weights = [jnp.where(h < q_heads, n_ref[0, pl.ds(i, 1), :], n_ref[1, pl.ds(i, 1), :]).astype(jnp.float32)
                   for i in (0, 1)]
        y1, y2 = (rounded(w * rounded(x * inv_rms)) for w, x in zip(weights, (x1, x2)))
    cos, sin = rounded(cos_ref[...]), rounded(sin_ref[...])
    # HF's rotate_half, as models/decoder.py's _rotate computes it in x's dtype
    r1 = rounded(rounded(y1 * cos) - rounded(y2 * sin)).astype(dtype)
    r2 = rounded(rounded(y2 * cos) + rounded(y1 * sin)).astype(dtype)

    @pl.when(h < q_heads)
    def _():
        q_ref[pl.ds(h, 1), 0, :] = r1
        q_ref[pl.ds(h, 1), 1, :] = r2

    def store(which, head, lo, hi):     # k (which 0) or v (1) of kv head `head`, its halves dtype[1, D/2]
        if not kv_write:
            out = k_ref if which == 0 else v_ref
            out[pl.ds(head, 1), 0, :] = lo
            out[pl.ds(head, 1), 1, :] = hi
            return
        block_size = cache_ref.shape[4]
        slot, layer = slot_ref[0], layer_ref[0]
        for start, part in ((0, lo), (half, hi)):       # as write_kv: divided by the scale in float32, one rounding
            value = part.astype(jnp.float32) / scale_ref[which] if kv_scaled else part
            cache_ref[layer, which, slot // block_size, head, slot % block_size, pl.ds(start, half)] = to_cache(
                value.reshape(half), cache_ref.dtype)

    @pl.when((h >= q_heads) & (h < q_heads + kv_heads))
    def _():
        store(0, h - q_heads, r1, r2)

    @pl.when(h >= q_heads + kv_heads)
    def _():
        store(1, h - q_heads - kv_heads, x1.astype(dtype), x2.astype(dtype))


@functools.partial(jax.jit, static_argnames=("q_heads", "kv_heads", "dtype", "eps", "interpret"))
def rope_qkv(qkv, cos, sin, bias=None, qk_norm=None, kv_write=None, *, q_heads: int, kv_heads: int, dtype,
             eps: float | None = None, interpret: bool | None = None):
    """One row's q, k and v from the q/k/v GEMV's partial sums, with RoPE (HF's rotate_half over the whole head)
    on q and k, in one kernel: qkv f32[P, 1, (q_heads + 2 kv_heads) D] (int4_matmul's keep_splits output) or
    dtype[1, 1, ...], cos, sin f32[1, D/2], bias None or dtype[(q_heads + 2 kv_heads) D] (Qwen2's), qk_norm None
    or (q_norm's, k_norm's weights dtype[D]) with their eps (Qwen3's, before RoPE) -> q dtype[1, q_heads, D], k, v
    dtype[1, kv_heads, D], as models/decoder.py's Attention computes them in dtype. What XLA makes of the same
    (the splits' sum fused into each of q's and k's rotation and v's slice) is three kernels or more. One program
    a head. D: a power of two.
    kv_write (kv_cache [L, 2, B, K, S, D], layer_idx, slot_mapping i32[1], kv_scales None or (k_scale, v_scale)):
    k and v go into the pool at the row's slot as kv_write.write_kv stores them (the pool updated in place), and
    the result is (q, the pool): one kernel fewer."""
    parts, m, width = qkv.shape
    heads = q_heads + 2 * kv_heads
    head_dim = width // heads
    if m != 1 or width % heads or head_dim & (head_dim - 1) or cos.shape != (1, head_dim // 2) or \
            sin.shape != cos.shape or (bias is not None and bias.shape != (width,)) or \
            (qk_norm is not None and (eps is None or [w.shape for w in qk_norm] != [(head_dim,)] * 2)):
        raise ValueError(f"rope_qkv takes one row of {heads} heads of a power-of-two size, cos/sin of half a head, "
                         f"a bias of the row's size and two norms' weights of a head's size with their eps: qkv "
                         f"{qkv.shape}, cos {cos.shape}, sin {sin.shape}, bias {None if bias is None else bias.shape}, "
                         f"qk_norm {None if qk_norm is None else [w.shape for w in qk_norm]}, eps {eps}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    half = head_dim // 2
    operands = [qkv.reshape(parts, heads * 2, half)]
    if bias is not None:
        operands.append(bias.astype(dtype).reshape(heads * 2, half))
    if qk_norm is not None:
        operands.append(jnp.stack(qk_norm).astype(dtype).reshape(2, 2, half))
    operands += [cos.astype(jnp.float32), sin.astype(jnp.float32)]
    q_shape = jax.ShapeDtypeStruct((q_heads, 2, half), dtype)
    kv_shape = jax.ShapeDtypeStruct((kv_heads, 2, half), dtype)
    aliases = {}
    kv_scaled = False
    out_shape: tuple[jax.ShapeDtypeStruct, ...]
    if kv_write is not None:
        kv_cache, layer_idx, slot_mapping, kv_scales = kv_write
        if kv_cache.ndim != 6 or kv_cache.shape[1] != 2 or kv_cache.shape[3] != kv_heads or \
                kv_cache.shape[5] != head_dim:
            raise ValueError(f"kv_write's pool must be [L, 2, B, {kv_heads}, S, {head_dim}]; got {kv_cache.shape}")
        if slot_mapping.shape != (1,):
            raise ValueError(f"kv_write's slot_mapping must be i32[1]; got {slot_mapping.shape}")
        check_triton_offsets(kv_cache)
        operands += [jnp.asarray(layer_idx, jnp.int32).reshape(1), slot_mapping.astype(jnp.int32)]
        kv_scaled = kv_scales is not None
        if kv_scaled:
            operands.append(jnp.stack([jnp.asarray(x, jnp.float32).reshape(()) for x in kv_scales]))
        aliases = {len(operands): 1}
        operands.append(kv_cache)
        out_shape = (q_shape, jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype))
    else:
        out_shape = (q_shape, kv_shape, kv_shape)
    outs = pl.pallas_call(
        functools.partial(_rope_qkv_kernel, parts=parts, q_heads=q_heads, kv_heads=kv_heads, dtype=jnp.dtype(dtype),
                          bias=bias is not None, eps=None if qk_norm is None else eps, kv_write=kv_write is not None,
                          kv_scaled=kv_scaled),
        grid=(heads,),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="rope_qkv",
    )(*operands)
    q = outs[0].reshape(1, q_heads, head_dim)
    if kv_write is not None:
        return q, outs[1]
    return q, outs[1].reshape(1, kv_heads, head_dim), outs[2].reshape(1, kv_heads, head_dim)


def rms_norm_gemv_x_reference(x, weight, *, eps: float, plus_one: bool = False):
    """rms_norm_gemv_x in plain jnp: (y, pairs, max |y|)."""
    x32 = x.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if plus_one:
        y = (x32 * inv_rms * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    else:
        y = weight.astype(x.dtype) * (x32 * inv_rms).astype(x.dtype)
    amax = jnp.max(jnp.abs(y.astype(jnp.float32))).reshape(1)
    pairs, _ = prepare_gemv_x(y, PACK_ROWS, False, amax)
    return y, pairs, amax


def silu_mul_gemv_x_reference(gate_up, *, dtype):
    """silu_mul_gemv_x in plain jnp: (pairs, each slab's max |silu(gate) * up|)."""
    total = jnp.sum(gate_up.astype(jnp.float32), axis=0)[0]                              # [2I]
    gate, up = jnp.split(_rounded(total, dtype), 2)
    act = _rounded(gate * _rounded(1.0 / (1.0 + jnp.exp(-gate)), dtype), dtype)
    hidden = _rounded(act * up, dtype).reshape(-1, 8, _NIBBLE_ROWS)                     # [slab, j, r]
    amax = jnp.max(jnp.abs(hidden), axis=(1, 2))
    return slab_pairs(hidden, amax).reshape(1, -1), amax


def rope_qkv_reference(qkv, cos, sin, bias=None, qk_norm=None, kv_write=None, *, q_heads: int, kv_heads: int, dtype,
                       eps: float | None = None):
    """rope_qkv in plain jnp: (q, k, v), or with kv_write (q, the pool with k and v written)."""
    heads = q_heads + 2 * kv_heads
    y = _rounded(jnp.sum(qkv.astype(jnp.float32), axis=0)[0], dtype)                    # [heads * D]
    if bias is not None:
        y = _rounded(y + bias.astype(jnp.float32), dtype)
    y = y.reshape(heads, 2, -1)                                                          # [head, half, D/2]
    q, k, v = y[:q_heads], y[q_heads:q_heads + kv_heads], y[q_heads + kv_heads:]
    if qk_norm is not None:
        def norm(x, w):
            inv_rms = jax.lax.rsqrt(jnp.mean(x * x, axis=(1, 2), keepdims=True) + eps)
            return _rounded(w.astype(jnp.float32).reshape(1, 2, -1) * _rounded(x * inv_rms, dtype), dtype)
        q, k = norm(q, qk_norm[0]), norm(k, qk_norm[1])
    c, s_ = _rounded(cos.astype(jnp.float32), dtype), _rounded(sin.astype(jnp.float32), dtype)   # [1, D/2]

    def rotate(x):
        x1, x2 = x[:, 0], x[:, 1]
        return jnp.stack([_rounded(_rounded(x1 * c, dtype) - _rounded(x2 * s_, dtype), dtype),
                          _rounded(_rounded(x2 * c, dtype) + _rounded(x1 * s_, dtype), dtype)], axis=1)
    q, k = rotate(q).astype(dtype).reshape(1, q_heads, -1), rotate(k).astype(dtype).reshape(1, kv_heads, -1)
    v = v.astype(dtype).reshape(1, kv_heads, -1)
    if kv_write is None:
        return q, k, v
    kv_cache, layer_idx, slot_mapping, kv_scales = kv_write
    if kv_scales is not None:
        k, v = k.astype(jnp.float32) / kv_scales[0], v.astype(jnp.float32) / kv_scales[1]
    return q, write_kv_reference(kv_cache, layer_idx, k, v, slot_mapping)


__all__ = ["norm_gemv_x_supported", "rms_norm_gemv_x", "rms_norm_gemv_x_reference", "rope_qkv", "rope_qkv_reference",
           "silu_mul_gemv_x", "silu_mul_gemv_x_reference"]
