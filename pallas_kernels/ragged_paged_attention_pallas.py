"""Ragged paged attention in Pallas (Triton) for a flat batch of prefill chunks and decodes.

Legend as in ragged_paged_attention.py (T tokens, R requests, N/K heads, G = N // K, D, L, B, S, M), plus
BM rows per tile (a power of two), BQ = BM // G query tokens per tile, BK = P * S keys per inner
iteration (P blocks).

A tile is BQ consecutive query tokens of ONE request times the G query heads of one kv head: its
[BM, D] rows are (token, head) pairs, packed without padding the group (G 7, BM 128: 18 tokens, 126
rows used, not 16 tokens of 8 rows with one idle), so the G heads that share a kv head share every
K/V load (GQA without re-reads) and the dots stay at tensor-core size even for short chunks. Tiles
never straddle two requests: a request of q_len tokens gets cdiv(q_len, BQ) tiles, so at most
cdiv(T, BQ) + R tiles exist; the schedule (request and first token of each tile) is computed by a few
jnp ops before the launch, and tiles past the real count exit at once. The bucket padding past
query_start_loc[R] gets tiles of its own that write zeros, so every output row is written by exactly
one tile.

q and the output keep the model's [T, N, D] layout, seen as [T * N, D] rows: a tile gathers its rows
(G heads of a token are contiguous) and stores them with a mask, so nothing is padded or transposed
around the kernel (those copies read and wrote all of q and o again: 64 MB each way at llama3-8b's
16 x 512, beside a kernel of ~100-250 us).

Each tile walks the request's keys from its window start to its last query position, gathering P blocks
per iteration from the paged cache; key tiles entirely at or before the tile's first query position
skip the causal mask. Query token i of request r sits at position seq_lens[r] - q_len[r] + i.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from ._checks import check_triton_offsets, dot_precision, from_cache, validate_q_and_cache
from ._softmax import NEG, init_carry, online_softmax_step

_LOG2E = 1.4426950408889634


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


class TileRows(NamedTuple):
    load: jax.Array    # i32[BM] rows to read, all inside the array
    store: jax.Array   # i32[BM] rows to write; lanes not owned point one past the end
    own: jax.Array     # bool[BM] lanes whose row this tile writes


def _tile_rows(tile_start, num_valid_tokens, head, *, block_rows, group, num_heads, num_rows):
    """Rows of q[T * N, D] a tile reads, rows it writes, and which of them are its own: NamedTuple.

    Row i of a [BM, D] tile is token i // G, head i % G of kv head `head`. For loads, rows past the
    tile's valid tokens (and the BM - BQ * G spare rows) are clamped onto a real row, so no load needs
    a mask or leaves the array. For stores they point one past the array's end instead (and are
    masked), so no two lanes of a store ever name the same row.
    # G 3, BM 8 (BQ 2), 1 valid token at s, kv head 1, N 6: tok [0, 0, 0, 1, 1, 1, 2, 2], heads
    #   [3, 4, 5, 3, 4, 5, 3, 4]; own [1, 1, 1, 0, 0, 0, 0, 0]; load rows 6s + heads;
    #   store rows [6s+3, 6s+4, 6s+5, end, end, end, end, end]
    """
    i = jax.lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
    tok, g = i // group, i % group
    own = tok < num_valid_tokens              # num_valid_tokens <= BQ, so spare rows are never own
    load_rows = ((tile_start + jnp.minimum(tok, num_valid_tokens - 1)) * num_heads
                 + head * group + jnp.minimum(g, group - 1))
    return TileRows(load_rows, jnp.where(own, load_rows, num_rows), own)


def _columns(head_dim):
    """i32[1, D]: a masked store indexes rows and columns with arrays (interpret mode's store takes
    either all-array or all-slice indices)."""
    return jax.lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)


def _ragged_kernel(layer_ref, tile_req_ref, tile_start_ref, query_start_loc_ref, seq_lens_ref,
                   block_tables_ref, slopes_ref, q_ref, kv_ref, o_ref, *, scale, sliding_window, soft_cap,
                   alibi, num_heads, group, block_rows, blocks_per_iter):
    # layer_ref:           i32[1]
    # tile_req_ref:        i32[NT]      request of each tile; R: bucket padding (written as zeros); -1: none
    # tile_start_ref:      i32[NT]      flat index of the tile's first query token
    # query_start_loc_ref: i32[R + 1]
    # seq_lens_ref:        i32[R]
    # block_tables_ref:    i32[R, M]
    # slopes_ref:          f32[N]       ALiBi slopes (read only when alibi)
    # q_ref:               dtype[T * N, D]   q[T, N, D] viewed as rows (free reshape): row t * N + n
    # kv_ref:              dtype[L, 2, B, K, S, D]
    # o_ref:               dtype[T * N, D]   same rows; each written by exactly one tile
    t, h = pl.program_id(0), pl.program_id(1)
    head_dim = kv_ref.shape[-1]
    num_reqs = seq_lens_ref.shape[0]
    tokens_per_tile = block_rows // group
    req = tile_req_ref[t]
    q_start = tile_start_ref[t]
    rows_of = functools.partial(_tile_rows, head=h, block_rows=block_rows, group=group,
                                num_heads=num_heads, num_rows=q_ref.shape[0])

    @pl.when(req == num_reqs)
    def _():
        num_padding = q_ref.shape[0] // num_heads - q_start
        rows = rows_of(q_start, jnp.minimum(tokens_per_tile, num_padding))
        zeros = jnp.zeros((block_rows, head_dim), o_ref.dtype)
        plgpu.store(o_ref.at[rows.store[:, None], _columns(head_dim)], zeros, mask=rows.own[:, None])

    @pl.when((req >= 0) & (req < num_reqs))
    def _():
        q_end = query_start_loc_ref[req + 1]
        # position of the tile's token 0: context before the chunk + offset inside the chunk
        first_pos = seq_lens_ref[req] - q_end + q_start
        num_tokens = jnp.minimum(tokens_per_tile, q_end - q_start)      # valid tokens in this tile
        rows = rows_of(q_start, num_tokens)
        q = q_ref[rows.load, :]                                          # [BM, D]
        # each row's query head's slope, in the base-2 domain of the scores
        slope = slopes_ref[rows.load % num_heads] * _LOG2E if alibi else None
        out = _attend(q, req, first_pos, num_tokens, block_tables_ref, kv_ref, layer_ref[0], h,
                      scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, slope=slope,
                      group=group, blocks_per_iter=blocks_per_iter)
        plgpu.store(o_ref.at[rows.store[:, None], _columns(head_dim)], out.astype(o_ref.dtype),
                    mask=rows.own[:, None])


def _attend(q, req, first_pos, num_tokens, block_tables_ref, kv_ref, layer, h, *, scale, sliding_window,
            soft_cap, slope, group, blocks_per_iter):
    """Online-softmax attention of one tile's rows q f32/bf16[BM, D] over the request's paged keys; slope
    f32[BM] (ALiBi, already times log2(e)) or None."""
    block_size, head_dim = kv_ref.shape[-2], kv_ref.shape[-1]
    bm, bk = q.shape[0], blocks_per_iter * block_size
    kv_end = first_pos + num_tokens                                      # keys [.., kv_end) are needed
    kv_begin = 0
    if sliding_window is not None:
        kv_begin = (jnp.maximum(first_pos - sliding_window + 1, 0) // bk) * bk
    precision = dot_precision(q.dtype)
    # base-2 softmax: exp2(x * log2(e)) == exp(x), one multiply folded into the scale
    qk_scale = scale if soft_cap is not None else scale * _LOG2E
    max_blocks = block_tables_ref.shape[1]
    row_pos = first_pos + jax.lax.broadcasted_iota(jnp.int32, (bm, bk), 0) // group

    def body(j, carry, masked):
        block0 = kv_begin // block_size + j * blocks_per_iter
        idx = block0 + jax.lax.broadcasted_iota(jnp.int32, (blocks_per_iter,), 0)
        blocks = plgpu.load(block_tables_ref.at[req, pl.ds(block0, blocks_per_iter)],
                            mask=idx < max_blocks, other=0)              # [P]; past M -> null
        k = from_cache(kv_ref[layer, 0, blocks, h, :, :].reshape(bk, head_dim), q.dtype)   # [BK, D]
        v = from_cache(kv_ref[layer, 1, blocks, h, :, :].reshape(bk, head_dim), q.dtype)   # [BK, D]
        s = plgpu.dot(q, k, trans_b=True, precision=precision) * qk_scale  # [BM, BK] f32
        if soft_cap is not None:
            s = (soft_cap * _LOG2E) * jnp.tanh(s / soft_cap)
        key_pos = block0 * block_size + jax.lax.broadcasted_iota(jnp.int32, (bm, bk), 1)
        if slope is not None:
            s = s + slope[:, None] * (key_pos - row_pos).astype(jnp.float32)
        if masked:
            mask = key_pos <= row_pos
            if sliding_window is not None:
                mask &= key_pos > row_pos - sliding_window
            s = jnp.where(mask, s, NEG)
        return online_softmax_step(carry, s, v, mask=mask if masked else None, precision=precision)

    carry = init_carry(bm, head_dim)
    num_iters = pl.cdiv(kv_end - kv_begin, bk)
    # Key tiles wholly at or before the first query position need no causal mask (no window).
    num_full = 0 if sliding_window is not None else (first_pos + 1) // bk
    num_full = jnp.minimum(num_full, num_iters)
    carry = jax.lax.fori_loop(0, num_full, functools.partial(body, masked=False), carry)
    m, l, acc = jax.lax.fori_loop(num_full, num_iters, functools.partial(body, masked=True), carry)
    return acc / jnp.where(l > 0.0, l, 1.0)[:, None]


def _tile_schedule(query_start_loc, num_tokens, tokens_per_tile):
    """Request and first token of every tile; the bucket padding is request R, tiles past the count -1.

    # q_lens [3, 0, 9], T 14 (2 padding tokens), BQ 4 -> tiles per "request" [1, 0, 3, 1],
    #   cum [0, 1, 1, 4, 5]; tile_req [0, 2, 2, 2, 3, -1, ...], tile_start [0, 3, 7, 11, 12, 0, ...],
    #   then both reversed
    At most cdiv(T, BQ) + R tiles: the R + 1 ranges cover T tokens, each adding under one partial tile.
    """
    num_reqs = query_start_loc.shape[0] - 1
    num_tiles = -(-num_tokens // tokens_per_tile) + num_reqs
    starts = jnp.concatenate([query_start_loc, jnp.full((1,), num_tokens, jnp.int32)])   # [R + 2]
    q_lens = starts[1:] - starts[:-1]                                                     # [R + 1]
    cum = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                           jnp.cumsum((q_lens + tokens_per_tile - 1) // tokens_per_tile)]).astype(jnp.int32)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    req = jnp.minimum(jnp.searchsorted(cum[1:], tile, side="right").astype(jnp.int32), num_reqs)
    start = starts[req] + (tile - cum[req]) * tokens_per_tile
    real = tile < cum[num_reqs + 1]
    # Reversed: a request's last tiles attend to the most keys; launching them first shortens the tail.
    return (jnp.where(real, req, -1)[::-1], jnp.where(real, start, 0)[::-1], num_tiles)


def _launch(q_rows, kv_cache, layer, tile_req, tile_start, query_start_loc, seq_lens, tables, slopes, *, scale,
            sliding_window, soft_cap, alibi, num_heads, group, block_rows, blocks_per_iter,
            num_tiles, num_warps, num_stages, interpret):
    num_kv_heads = num_heads // group
    kernel = functools.partial(_ragged_kernel, scale=scale, sliding_window=sliding_window,
                               soft_cap=soft_cap, alibi=alibi, num_heads=num_heads, group=group,
                               block_rows=block_rows, blocks_per_iter=blocks_per_iter)
    return pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(layer, tile_req, tile_start, query_start_loc, seq_lens, tables, slopes, q_rows, kv_cache)


def _validate(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc):
    validate_q_and_cache(q, kv_cache, layer_idx)
    check_triton_offsets(kv_cache)
    num_reqs = seq_lens.shape[0]
    if (block_tables.ndim != 2 or block_tables.shape[0] != num_reqs or seq_lens.ndim != 1
            or query_start_loc.shape != (num_reqs + 1,)):
        raise ValueError(f"block_tables {block_tables.shape}, seq_lens {seq_lens.shape} and "
                         f"query_start_loc {query_start_loc.shape} disagree on the request count")
    for name, x in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "block_m",
                                             "block_k", "num_warps", "num_stages", "interpret"))
def ragged_paged_attention_pallas(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc, *,
                                  scale: float, sliding_window: int | None = None,
                                  soft_cap: float | None = None, alibi_slopes=None, block_m: int | None = None,
                                  block_k: int | None = None, num_warps: int | None = None,
                                  num_stages: int | None = None, interpret: bool | None = None):
    """Same contract as ragged_paged_attention_reference: q dtype[T, N, D] -> dtype[T, N, D].

    block_m: rows (query tokens x heads of a group) per tile; block_k: keys per inner iteration.
    """
    _validate(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[4]
    group = num_heads // num_kv_heads
    block_m = block_m or (128 if head_dim <= 128 else 64)
    block_k = block_k or 64
    block_rows = max(block_m, _next_pow2(group))        # a tile holds at least one token's G heads
    tokens_per_tile = block_rows // group
    blocks_per_iter = max(1, block_k // block_size)
    if num_warps is None or num_stages is None:
        # On the H100, 128 x 64 tiles run best with 4 warps and 2 stages at D 128, and with 8 warps and
        # 3 stages at D 64 (sweeps over both head layouts, prompts of 2k-8k tokens).
        default_warps, default_stages = (8, 3) if head_dim <= 64 else (4, 2)
        num_warps = num_warps or default_warps
        num_stages = num_stages or default_stages
    tile_req, tile_start, num_tiles = _tile_schedule(query_start_loc, num_tokens, tokens_per_tile)
    # q and the output keep their [T, N, D] layout (viewed as [T * N, D] rows, no copy): a tile gathers
    # its rows itself, so no transpose or pad runs around the kernel.
    layer = jnp.asarray(layer_idx, jnp.int32).reshape(1)
    alibi = alibi_slopes is not None
    slopes = alibi_slopes.astype(jnp.float32) if alibi else jnp.zeros((num_heads,), jnp.float32)
    o_rows = _launch(q.reshape(num_tokens * num_heads, head_dim), kv_cache, layer, tile_req, tile_start,
                     query_start_loc, seq_lens, block_tables, slopes, scale=scale, sliding_window=sliding_window,
                     soft_cap=soft_cap, alibi=alibi, num_heads=num_heads, group=group,
                     block_rows=block_rows, blocks_per_iter=blocks_per_iter, num_tiles=num_tiles,
                     num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    return o_rows.reshape(num_tokens, num_heads, head_dim)
