"""Paged decode attention (one query token per request), split-K flash-decoding, Pallas (Triton) on GPU.

Legend as in ragged_paged_attention.py: R requests, N query heads, K kv heads, G = N // K, Gp = G padded
to a power of two >= 16 (the smallest tile a tensor-core dot takes), D head dim, L layers, B blocks,
S block size, M max blocks per request, NS splits of the context, P blocks loaded per loop iteration.

Grid (R, K, NS): one program owns one request, one kv head and one contiguous range of the request's
blocks. The ranges are cut from each request's own context (its length, or its sliding window), not
from the block table's width: a 512-token request in a table sized for 8k tokens still spreads over
all NS programs instead of sitting in the first. (At 64 x 512 on llama3-8b's layout, where 1024
programs already fill the H100, both ways read 2.0 TB/s; the split count matters at few requests.)
All G query heads of the kv head are one [Gp, D] tile, so each K/V block is read from memory
exactly once per step (GQA without re-reads). Each program writes its normalised partial output and its
log-sum-exp; splits left empty (a context shorter than NS tiles) write nothing. A second kernel, grid
(R, K), merges each request's non-empty splits and writes the output. At few requests the split count is
large (one wave of programs: 256 splits at one request of qwen2-0.5b with a 32k table) and short
contexts fill few of them, so the merge reads only those; jnp's merge over all NS splits was four or five
XLA fusions a layer there, 6.5-8.8 us of a 46 us decode layer on the H200, against 2 us for this kernel.
Merging inside the decode kernel (the last split to finish, found by an atomic count, merges) costs every
program a barrier and a fenced atomic and puts a serial merge on the critical path, which made it slower
on the H100.

The cache is passed whole ([L, 2, B, K, S, D]) and the layer is picked inside the kernel, so the model's
lax.scan over layers never copies a layer out of the pool.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from ._checks import check_triton_offsets, dot_precision, from_cache, validate_q_and_cache
from ._softmax import NEG, init_carry, online_softmax_step

NUM_SMS = 132            # H100 SXM: the SM count where no GPU says its own (lowering on the CPU)
# The split count fills one wave of PROGRAMS_PER_SM programs per SM and never spills into a second one.
# Why one wave: programs that spill past the resident wave leave a tail in which most SMs idle, so a
# split count that stays inside one wave beats a larger one that does not (e.g. qwen2-0.5b 256 x 4k on the
# H100: 2 splits, 1,024 programs, faster than 3 or 5). 8 per SM is the largest count that 1,024 programs
# fit in. Where the (request, head) pairs alone fill a wave, one split runs.
PROGRAMS_PER_SM = 8
# Each split walks at least this many key tiles: a one-tile split pays a program's fixed costs (q load,
# partial output and log-sum-exp stores, its share of the merge) for 64 keys: at qwen2-0.5b 16 x 1k on the
# H100, 8 splits of two tiles ran faster than 16 splits of one.
MIN_TILES_PER_SPLIT = 2
MERGE_SPLITS = 16        # splits the merge loads at once: one chunk holds a 1k-token context at one request
MERGE_WARPS = 4          # the merge's warps: a chunk is [MERGE_SPLITS, G (padded), D] float32 partials
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _split_blocks(seq_len, num_splits, block_size: int, blocks_per_iter: int, sliding_window: int | None):
    """How a request's context is cut into its splits: (its blocks, the first block its window sees, blocks per
    split, a multiple of blocks_per_iter). Split s reads blocks [first + s * per_split, first + (s + 1) * per_split)
    below the blocks' end; the splits past the end are empty. The decode kernel and the merge both cut so."""
    num_blocks = pl.cdiv(seq_len, block_size)
    # keys before seq_len - sliding_window are never seen: the splits share out the blocks from there
    window_first = 0 if sliding_window is None else jnp.maximum(seq_len - sliding_window, 0) // block_size
    per_split = pl.cdiv(pl.cdiv(num_blocks - window_first, num_splits), blocks_per_iter) * blocks_per_iter
    return num_blocks, window_first, per_split


def _decode_kernel(layer_ref, seq_lens_ref, block_tables_ref, slopes_ref, q_ref, kv_ref, o_ref, *lse_refs,
                   scale, sliding_window, soft_cap, alibi, blocks_per_iter, group_pad):
    # layer_ref:        i32[1]
    # seq_lens_ref:     i32[R]
    # block_tables_ref: i32[R, M]
    # slopes_ref:       f32[N]                ALiBi slopes (read only when alibi)
    # q_ref:            dtype[R, K, G, D]     rows G..Gp-1 of a tile are masked loads (zeros)
    # kv_ref:           dtype[L, 2, B, K, S, D]
    # one split (no lse_refs):
    #   o_ref:          dtype[R, N, D]        final output, rows h*G .. h*G+G-1 written by program (r, h)
    # several splits:
    #   o_ref:          f32[R, K, NS, G, D]   this split's output, already divided by its softmax sum
    #   lse_refs[0]:    f32[R, K, NS, G]      this split's log-sum-exp (NEG when the split is empty)
    #   (only the G real rows of the [Gp, D] tile are stored: the merge reads no padding)
    r, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_size, head_dim = kv_ref.shape[-2], kv_ref.shape[-1]
    group = q_ref.shape[2]
    max_blocks = block_tables_ref.shape[1]
    tile = blocks_per_iter * block_size
    layer = layer_ref[0]
    seq_len = seq_lens_ref[r]
    num_blocks, window_first, per_split = _split_blocks(seq_len, pl.num_programs(2), block_size, blocks_per_iter,
                                                        sliding_window)
    first_block = window_first + split * per_split
    end_block = jnp.minimum(first_block + per_split, num_blocks)
    num_iters = pl.cdiv(jnp.maximum(end_block - first_block, 0), blocks_per_iter)
    # The last tile can reach past the split's end (into the next split's blocks): mask there too.
    key_end = jnp.minimum(seq_len, end_block * block_size)
    row = jax.lax.broadcasted_iota(jnp.int32, (group_pad, head_dim), 0)
    q = plgpu.load(q_ref.at[r, h, pl.ds(0, group_pad), :], mask=row < group, other=0.0)   # [Gp, D]
    precision = dot_precision(q.dtype)
    # base-2 softmax: exp2(x * log2(e)) == exp(x), one multiply folded into the scale
    qk_scale = scale if soft_cap is not None else scale * _LOG2E
    if alibi:      # per row (query head) slope, in the base-2 domain of the scores
        heads = jax.lax.broadcasted_iota(jnp.int32, (group_pad,), 0)
        slope = plgpu.load(slopes_ref.at[pl.ds(h * group, group_pad)], mask=heads < group, other=0.0) * _LOG2E

    def body(i, carry):
        block0 = first_block + i * blocks_per_iter
        idx = block0 + jax.lax.broadcasted_iota(jnp.int32, (blocks_per_iter,), 0)
        blocks = plgpu.load(block_tables_ref.at[r, pl.ds(block0, blocks_per_iter)],
                            mask=idx < max_blocks, other=0)                  # [P]; past M -> null
        k = from_cache(kv_ref[layer, 0, blocks, h, :, :].reshape(tile, head_dim), q.dtype)   # [P*S, D]
        v = from_cache(kv_ref[layer, 1, blocks, h, :, :].reshape(tile, head_dim), q.dtype)   # [P*S, D]
        s = plgpu.dot(q, k, trans_b=True, precision=precision) * qk_scale    # [Gp, P*S] f32
        if soft_cap is not None:
            s = (soft_cap * _LOG2E) * jnp.tanh(s / soft_cap)
        pos = block0 * block_size + jax.lax.broadcasted_iota(jnp.int32, (group_pad, tile), 1)
        if alibi:
            s = s + slope[:, None] * (pos - (seq_len - 1)).astype(jnp.float32)
        mask = pos < key_end
        if sliding_window is not None:
            mask &= pos >= seq_len - sliding_window
        s = jnp.where(mask, s, NEG)
        return online_softmax_step(carry, s, v, mask=mask, precision=precision)

    m, l, acc = jax.lax.fori_loop(0, num_iters, body, init_carry(group_pad, head_dim))
    nonempty = l > 0.0
    l_safe = jnp.where(nonempty, l, 1.0)
    out = acc / l_safe[:, None]
    if not lse_refs:
        plgpu.store(o_ref.at[r, pl.ds(h * group, group_pad), :], out.astype(o_ref.dtype),
                    mask=row < group)
    else:
        @pl.when(first_block < num_blocks)          # an empty split's partials are never read (_merge_kernel)
        def _():
            plgpu.store(o_ref.at[r, h, split, pl.ds(0, group_pad), :], out, mask=row < group)
            lse = jnp.where(nonempty, (m + jnp.log2(l_safe)) * _LN2, NEG)
            real = jax.lax.broadcasted_iota(jnp.int32, (group_pad,), 0) < group
            plgpu.store(lse_refs[0].at[r, h, split, pl.ds(0, group_pad)], lse, mask=real)


def _merge_kernel(seq_lens_ref, o_ref, lse_ref, out_ref, *, block_size, blocks_per_iter, sliding_window,
                  group_pad):
    # seq_lens_ref: i32[R]
    # o_ref:        f32[R, K, NS, G, D]   the splits' outputs, each divided by its own softmax sum
    # lse_ref:      f32[R, K, NS, G]      their log-sum-exps
    # out_ref:      dtype[R, N, D]        rows h*G .. h*G+G-1 written by program (r, h)
    # Only the request's non-empty splits are read, MERGE_SPLITS at a time (one load of each chunk in flight:
    # a split at a time, the loads' latency set the merge's time): at few requests the splits are many (one
    # wave of programs), and a short context fills few of them.
    r, h = pl.program_id(0), pl.program_id(1)
    num_splits, group, head_dim = o_ref.shape[2], o_ref.shape[3], o_ref.shape[4]
    num_blocks, window_first, per_split = _split_blocks(seq_lens_ref[r], num_splits, block_size, blocks_per_iter,
                                                        sliding_window)
    span = num_blocks - window_first
    used = jnp.where(span > 0, pl.cdiv(span, jnp.maximum(per_split, 1)), 0)
    chunk = MERGE_SPLITS
    real = jax.lax.broadcasted_iota(jnp.int32, (chunk, group_pad), 1) < group

    def body(c, carry):
        m, l, acc = carry
        live = (c * chunk + jax.lax.broadcasted_iota(jnp.int32, (chunk, group_pad), 0) < used) & real
        lse = plgpu.load(lse_ref.at[r, h, pl.ds(c * chunk, chunk), pl.ds(0, group_pad)], mask=live,
                         other=NEG)                                                      # [C, Gp]
        o = plgpu.load(o_ref.at[r, h, pl.ds(c * chunk, chunk), pl.ds(0, group_pad), :],
                       mask=jnp.broadcast_to(live[:, :, None], (chunk, group_pad, head_dim)), other=0.0)
        m_new = jnp.maximum(m, jnp.max(lse, axis=0))
        w = jnp.where(live, jnp.exp(lse - m_new[None, :]), 0.0)
        alpha = jnp.exp(m - m_new)
        return m_new, l * alpha + jnp.sum(w, axis=0), acc * alpha[:, None] + jnp.sum(o * w[:, :, None], axis=0)

    _, l, acc = jax.lax.fori_loop(0, pl.cdiv(used, chunk), body, init_carry(group_pad, head_dim))
    out = acc / jnp.where(l > 0.0, l, 1.0)[:, None]
    row = jax.lax.broadcasted_iota(jnp.int32, (group_pad, head_dim), 0)
    plgpu.store(out_ref.at[r, pl.ds(h * group, group_pad), :], out.astype(out_ref.dtype), mask=row < group)


def device_num_sms() -> int:
    """The GPU's SM count (jax's core_count), NUM_SMS elsewhere."""
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or NUM_SMS) if device.platform == "gpu" else NUM_SMS


def choose_splits(num_reqs: int, num_kv_heads: int, max_blocks: int, blocks_per_iter: int,
                  programs_per_sm: int | None = None, sms: int = NUM_SMS) -> int:
    """The most splits whose (request, head, split) programs fit in one wave of programs_per_sm on each
    of `sms` SMs. Never fewer than MIN_TILES_PER_SPLIT tiles of the table per split, nor one split.
    """
    max_splits = max(1, -(-max_blocks // (blocks_per_iter * MIN_TILES_PER_SPLIT)))
    want = (programs_per_sm or PROGRAMS_PER_SM) * sms // (num_reqs * num_kv_heads)
    return int(min(max(want, 1), max_splits))


def _launch(q3, kv_cache, layer, seq_lens, block_tables, slopes, *, scale, sliding_window, soft_cap, alibi,
            num_splits, blocks_per_iter, group_pad, num_warps, num_stages, interpret):
    num_reqs, num_kv_heads, group, head_dim = q3.shape
    kernel = functools.partial(_decode_kernel, scale=scale, sliding_window=sliding_window,
                               soft_cap=soft_cap, alibi=alibi, blocks_per_iter=blocks_per_iter,
                               group_pad=group_pad)
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((num_reqs, num_kv_heads * group, head_dim), q3.dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((num_reqs, num_kv_heads, num_splits, group, head_dim),
                                          jnp.float32),
                     jax.ShapeDtypeStruct((num_reqs, num_kv_heads, num_splits, group), jnp.float32))
    return pl.pallas_call(
        kernel,
        grid=(num_reqs, num_kv_heads, num_splits),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_decode_attention",
    )(layer, seq_lens, block_tables, slopes, q3, kv_cache)


def validate_decode_inputs(q, kv_cache, layer_idx, block_tables, seq_lens):
    """The decode ops' shared checks of q, the cache, the tables and the lengths (ValueError)."""
    validate_q_and_cache(q, kv_cache, layer_idx)
    num_reqs = q.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != num_reqs or seq_lens.shape != (num_reqs,):
        raise ValueError(f"block_tables {block_tables.shape} / seq_lens {seq_lens.shape} do not match "
                         f"{num_reqs} requests")
    if block_tables.dtype != jnp.int32 or seq_lens.dtype != jnp.int32:
        raise ValueError("block_tables and seq_lens must be int32")


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "num_splits",
                                             "blocks_per_iter", "num_warps", "num_stages", "interpret",
                                             "num_sms"))
def paged_decode_attention(q, kv_cache, layer_idx, block_tables, seq_lens, *, scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None, alibi_slopes=None,
                           num_splits: int | None = None, blocks_per_iter: int | None = None,
                           num_warps: int | None = None, num_stages: int = 2,
                           interpret: bool | None = None, num_sms: int | None = None):
    """Decode attention over the paged cache: q dtype[R, N, D] -> dtype[R, N, D].

    kv_cache dtype[L, 2, B, K, S, D]; layer_idx i32[]; block_tables i32[R, M]; seq_lens i32[R]
    (context including this step's token, 0 for padding requests, whose output is zeros); alibi_slopes f32[N]
    or None (ragged_paged_attention.py).
    num_sms: the SM count the split count is fitted to (None: the device's, device_num_sms()).
    """
    validate_decode_inputs(q, kv_cache, layer_idx, block_tables, seq_lens)
    check_triton_offsets(kv_cache)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    num_reqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[4]
    group = num_heads // num_kv_heads
    group_pad = max(16, _next_pow2(group))
    max_blocks = block_tables.shape[1]
    if blocks_per_iter is None:
        # 64 keys per iteration: on the H100 best or within noise of it on both head layouts; 32 and
        # 128 lost at >= 64 sequences. Head size 256 (Gemma) too: on the H200, 32 keys on 2 warps ran the kernel
        # 5-11% faster at 64-256 requests x 1k-4k, but gemma-2-9b's ShareGPT throughput did not move with it.
        blocks_per_iter = max(1, 64 // block_size)
    if num_splits is None:
        num_splits = choose_splits(num_reqs, num_kv_heads, max_blocks, blocks_per_iter,
                                   sms=num_sms or device_num_sms())
    if num_warps is None:
        # On the H100, 2 warps beat 4 for D 64 at >= 4k tokens of context; for D 128, 4 warps were best
        # or within noise.
        num_warps = 2 if head_dim <= 64 else 4
    q3 = q.reshape(num_reqs, num_kv_heads, group, head_dim)
    layer = jnp.asarray(layer_idx, jnp.int32).reshape(1)
    alibi = alibi_slopes is not None
    # one slope per query head, padded past the last kv head's group (the kernel's masked rows read it)
    slopes = jnp.pad(alibi_slopes.astype(jnp.float32) if alibi else jnp.zeros((num_heads,), jnp.float32),
                     (0, group_pad))
    res = _launch(q3, kv_cache, layer, seq_lens, block_tables, slopes, scale=scale,
                  sliding_window=sliding_window, soft_cap=soft_cap, alibi=alibi, num_splits=num_splits,
                  blocks_per_iter=blocks_per_iter,
                  group_pad=group_pad, num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    if num_splits == 1:
        return res                                                     # written by the kernel
    o, lse = res                                                       # [R, K, NS, G, D], [R, K, NS, G]
    merge = functools.partial(_merge_kernel, block_size=block_size, blocks_per_iter=blocks_per_iter,
                              sliding_window=sliding_window, group_pad=_next_pow2(group))
    return pl.pallas_call(
        merge,
        grid=(num_reqs, num_kv_heads),
        out_shape=jax.ShapeDtypeStruct((num_reqs, num_heads, head_dim), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=MERGE_WARPS, num_stages=1),
        interpret=interpret,
        name="paged_decode_merge",
    )(seq_lens, o, lse)


def paged_decode_attention_reference(q, kv_cache, layer_idx, block_tables, seq_lens, *, scale: float,
                                     sliding_window: int | None = None, soft_cap: float | None = None,
                                     alibi_slopes=None):
    """Plain jnp, f32 math: q dtype[R, N, D] -> dtype[R, N, D]. Gathers every request's whole table."""
    num_reqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[4]
    group = num_heads // num_kv_heads
    max_blocks = block_tables.shape[1]
    layer = kv_cache[layer_idx]                                              # [2, B, K, S, D]
    k = layer[0][block_tables].transpose(0, 2, 1, 3, 4).reshape(num_reqs, num_kv_heads, -1, head_dim)
    v = layer[1][block_tables].transpose(0, 2, 1, 3, 4).reshape(num_reqs, num_kv_heads, -1, head_dim)
    qg = q.reshape(num_reqs, num_kv_heads, group, head_dim).astype(jnp.float32)
    s = jnp.einsum("rkgd,rkcd->rkgc", qg, from_cache(k, jnp.float32),
                   precision=jax.lax.Precision.HIGHEST) * scale              # [R, K, G, M*S]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    pos = jnp.arange(max_blocks * block_size)
    if alibi_slopes is not None:
        slopes = alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, group)
        dist = (pos[None, :] - (seq_lens[:, None] - 1)).astype(jnp.float32)               # [R, M*S]
        s = s + slopes[None, :, :, None] * dist[:, None, None, :]
    mask = pos[None, :] < seq_lens[:, None]
    if sliding_window is not None:
        mask &= pos[None, :] >= seq_lens[:, None] - sliding_window
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("rkgc,rkcd->rkgd", p, from_cache(v, jnp.float32),
                   precision=jax.lax.Precision.HIGHEST) / jnp.where(l == 0, 1.0, l)
    return o.reshape(num_reqs, num_heads, head_dim).astype(q.dtype)


__all__ = ["paged_decode_attention", "paged_decode_attention_reference", "choose_splits"]
