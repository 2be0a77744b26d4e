"""Ragged paged causal attention as a Pallas Mosaic GPU kernel for Hopper (FlashAttention-3 style).

Legend as in ragged_paged_attention.py (T tokens, R requests, N query heads, K kv heads, G = N // K,
D head dim, L layers, B blocks in the pool, S block size, M max blocks per request), plus BQ query
tokens per warpgroup tile, BKV keys per pipeline step (P = BKV // S cache blocks), C pipeline slots
(max_concurrent_steps), NT tiles, Tp = max(T, BQ) rows of the padded q / output.

Persistent: one CTA per SM runs (tile, head) items, dealt in snake order (_Work), of a work list
computed before the launch (_mgpu_schedule.py: tiles of up to 2 * BQ tokens of one request, longest first,
then zero tiles over the bucket padding), heads fastest so GQA siblings share K/V in L2. Three
warpgroups (as JAX's attention_mgpu.py): two compute warpgroups own one BQ-token half of the tile
each, the third (memory warpgroup) streams K/V through C SMEM slots. The slots and barriers run on
one step count across items, so the memory warpgroup gathers the next item's first steps while the
compute warpgroups finish this one, and each compute warpgroup fetches its next q tile while it
computes this one: no pipeline fill or drain per tile, which dominated 512-token prompts. A slot of
BKV keys is gathered from the paged cache with one TMA copy per cache block: block
block_tables[r, j] is the contiguous [S, D] tile kv_cache[layer, 0 or 1, block, h // G], copied to
rows [i * S, (i + 1) * S) of the slot; the P copies of a slot complete on one barrier made with
num_arrivals=P (every copy arrives once and adds its bytes to the expected transaction count).

Tiles start at any token, and Mosaic's TMA into 8-row-tiled (swizzled) SMEM only addresses whole
8-row tiles of GMEM, so q and the output go through untiled SMEM buffers: q is re-laid out into the
swizzled wgmma operand by one register round trip, and a tile's rows are stored by TMA stores of BQ,
BQ/2, ..., 2, 1 rows picked by the bits of its row count, so no row of a neighbouring request is
touched.

Causal: key step j is unmasked when all its keys are <= the tile's first query position; later steps
mask per row (key_pos <= row_pos). Query token i of request r sits at seq_lens[r] - q_len[r] + i.

An e4m3 pool (FP8_CACHE_DTYPE bytes, --kv-cache-dtype fp8) is read at half the bytes: the memory warpgroup
gathers the bytes into 1-byte slots (one 8-row swizzled tile per row group, as the 2-byte slots), and each
compute warpgroup widens a slot into its own float16 buffer (one register round trip: Hopper converts two
e4m3 values to float16 in one instruction; every e4m3 value is exact in float16) before the slot's wgmma,
freeing the slot as soon as it is read. K and V take turns in that buffer: a step's QK wgmma has finished
before V is widened, and its PV wgmma before the next step's K. The kernel then computes in float16: q
is rounded to it (a bf16 q loses nothing in float16's range) and the output converted back.

ALiBi: every key step (masked or not) adds slope * (key position - row position) to the scores, the slope
read once per item from a (request, head) table (a decode's packed rows share one position, and one slope
while each pair holds one query head).

split_keys (not causal: the packed decode): a decode tile's rows fit one warpgroup's half, so the other would
idle; instead both take those rows and every other key step each, without the ping-pong, and warpgroup 1
hands its (acc, m, l) to warpgroup 0 through SMEM at the item's end. Each warpgroup still waits on every
slot's load barriers and frees every slot, so both observe every barrier phase.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from . import _mgpu_schedule as ms
from . import _mgpu_ops as ops
from ._checks import FP8_CACHE_DTYPE, from_cache, is_hopper, validate_q_and_cache
from .paged_decode_attention import device_num_sms

_LOG2E = math.log2(math.e)
_M_INIT = -1e30                  # finite: rows with no unmasked key stay NaN-free until the division
_SMEM_BYTES = 227 * 1024         # H100 dynamic shared memory per CTA
_COMPUTE_WGS = ms.COMPUTE_WGS
_INTERPRET_CTAS = 3              # the interpreter's default CTA count: several items per CTA


def _widen(src, dst, interpret):
    """An e4m3 slot (its bytes, [BKV, D]) -> dst, this warpgroup's float16 wgmma operand buffer. Each thread loads its
    pairs of bytes where the WGMMA layout puts them (16-bit loads) and widens each pair to an f16x2 in place. Loading
    32-bit words (WGMMA_UPCAST_2X) instead costs a relayout after the conversion: 96 SEL and 40 SHFL of a 64-key
    step's ~600 instructions a thread on the H100, in the dependent chain that bounds the e4m3 decode, which took
    3.7% longer that way at llama3-8b's 256 x 4k on the H100 (bench/results/NOTES.md)."""
    if interpret:
        dst[...] = from_cache(src[...], dst.dtype)
    else:
        x = ops.smem_load(src, plgpu.Layout.WGMMA)
        dst[...] = lax.bitcast_convert_type(x, jnp.float8_e4m3fn).astype(dst.dtype)
    plgpu.commit_smem()                              # generic-proxy writes -> visible to wgmma


def _scores(q_smem, k_smem, slot, wide, k_free, sched, interpret):
    """q @ K^T of the slot, f32[BQ, BKV]; the slot is freed once read (over an e4m3 pool: once widened)."""
    k_src = k_smem.at[slot]
    if wide is not None:
        _widen(k_src, wide, interpret)
        plgpu.barrier_arrive(k_free.at[slot])
        k_src = wide
    qk = ops.qk(q_smem, k_src, sched, interpret)
    if wide is None:
        plgpu.barrier_arrive(k_free.at[slot])
    return qk


def _online_softmax(qk, acc, m, l, qk_scale, dtype):
    """One key step's online-softmax update (log2 domain) -> (acc rescaled, m, l, probabilities in dtype)."""
    m_new = jnp.maximum(m, qk.max(axis=1) * qk_scale)
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(qk * qk_scale - lax.broadcast_in_dim(m_new, qk.shape, [0]))
    acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
    return acc, m_new, l * alpha + p.sum(axis=1), p.astype(dtype)


def _values(v_smem, slot, wide, v_free, interpret):
    """The slot's V as the PV wgmma's operand: the slot itself, or (e4m3 pool) `wide`, freeing the slot."""
    if wide is None:
        return v_smem.at[slot]
    _widen(v_smem.at[slot], wide, interpret)         # the QK wgmma has read `wide`: V may take it
    plgpu.barrier_arrive(v_free.at[slot])
    return wide


def _kv_step(j, carry, *, masked, first_step, row_pos0, key_last, num_steps, q_smem, k_smem, v_smem,
             wide, bars, sched, qk_scale, alibi_slope, interpret):
    """Key step j of the item (the first_step + j-th of the CTA) of online softmax for one compute
    warpgroup, in FA3's ping-pong order. Masked steps hide keys past each row's position (causal) or,
    where key_last is given (not causal), past key_last for every row. wide: None, or (e4m3 pool) this
    warpgroup's float16 buffer that each slot is widened into before its wgmma. alibi_slope: None, or the
    item's ALiBi slope over the softmax scale (the scores' units before qk_scale)."""
    acc, m, l = carry                                # f32[BQ, D], f32[BQ], f32[BQ] (log2 domain)
    k_bar, v_bar, k_free, v_free = bars
    num_slots, block_kv = k_smem.shape[0], k_smem.shape[1]
    slot = lax.rem(first_step + j, num_slots)
    qk = _scores(q_smem, k_smem, slot, wide, k_free, sched, interpret)                   # f32[BQ, BKV]
    if masked or alibi_slope is not None:
        cols = ops.iota(qk.shape, 1, interpret) + j * block_kv
        last = ops.iota(qk.shape, 0, interpret) + row_pos0 if key_last is None else key_last
    if alibi_slope is not None:                      # `last` is each row's own position
        qk = qk + (cols - last).astype(jnp.float32) * alibi_slope
    if masked:
        qk = jnp.where(cols <= last, qk, -jnp.inf)
    acc, m_new, l, p16 = _online_softmax(qk, acc, m, l, qk_scale, q_smem.dtype)
    acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
    plgpu.barrier_arrive(sched.barrier)              # softmax done: let the other warpgroup's wgmma go
    plgpu.barrier_wait(v_bar.at[slot])
    v_src = _values(v_smem, slot, wide, v_free, interpret)
    plgpu.barrier_wait(sched.barrier)                # wait until the tensor core is ours again

    def wait_next_k():
        @pl.when(j + 1 < num_steps)
        def _():
            plgpu.barrier_wait(k_bar.at[lax.rem(first_step + j + 1, num_slots)])
    acc = ops.pv(acc, p16, v_src, wait_next_k, interpret)         # returns once the wgmma is done
    if wide is None:
        plgpu.barrier_arrive(v_free.at[slot])
    return acc, m_new, l


def _split_step(j, carry, *, own, first_step, key_last, q_smem, k_smem, v_smem, wide, bars, qk_scale,
                alibi_slope, interpret):
    """Key step j of an item whose steps the two compute warpgroups share (split_keys: this one computes the
    steps with own=True, every other one). Every step waits on its slot's load barriers and frees the slot (the
    other warpgroup's steps too), so each warpgroup observes every barrier phase; no ping-pong (the warpgroups
    run independently). Rows see the keys up to key_last (not causal)."""
    acc, m, l = carry
    k_bar, v_bar, k_free, v_free = bars
    num_slots, block_kv = k_smem.shape[0], k_smem.shape[1]
    slot = lax.rem(first_step + j, num_slots)
    plgpu.barrier_wait(k_bar.at[slot])
    if not own:
        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_wait(v_bar.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])
        return carry
    qk = _scores(q_smem, k_smem, slot, wide, k_free, lambda: None, interpret)            # f32[BQ, BKV]
    cols = ops.iota(qk.shape, 1, interpret) + j * block_kv
    if alibi_slope is not None:
        qk = qk + (cols - key_last).astype(jnp.float32) * alibi_slope
    qk = jnp.where(cols <= key_last, qk, -jnp.inf)
    acc, m_new, l, p16 = _online_softmax(qk, acc, m, l, qk_scale, q_smem.dtype)
    plgpu.barrier_wait(v_bar.at[slot])
    v_src = _values(v_smem, slot, wide, v_free, interpret)
    acc = ops.pv(acc, p16, v_src, lambda: None, interpret)         # returns once the wgmma is done
    if wide is None:
        plgpu.barrier_arrive(v_free.at[slot])
    return acc, m_new, l


def _merge_halves(wg, k, acc, m, l, xchg, xbars, interpret):
    """split_keys: warpgroup 1 hands its (acc, m, l) over SMEM; warpgroup 0 merges it into its own and
    returns the item's (acc, l) (warpgroup 1's return is not used). m and l travel as [BQ, 8] broadcasts."""
    xacc, xml = xchg                                 # f32[BQ, D], f32[2, BQ, 8]
    ready, free = xbars
    width = xml.shape[-1]
    if wg == 1:
        pl.when(k > 0)(lambda: plgpu.barrier_wait(free))               # warpgroup 0 has read the last item's
        xacc[...] = acc
        xml[0] = lax.broadcast_in_dim(m, (m.shape[0], width), [0])
        xml[1] = lax.broadcast_in_dim(l, (l.shape[0], width), [0])
        plgpu.barrier_arrive(ready)
        return acc, l
    plgpu.barrier_wait(ready)
    acc1 = xacc[...] if interpret else ops.smem_load(xacc, plgpu.Layout.WGMMA)
    m1 = (xml[0] if interpret else ops.smem_load(xml.at[0], plgpu.Layout.WGMMA)).max(axis=1)
    l1 = (xml[1] if interpret else ops.smem_load(xml.at[1], plgpu.Layout.WGMMA)).max(axis=1)
    plgpu.barrier_arrive(free)
    m_all = jnp.maximum(m, m1)
    a0, a1 = jnp.exp2(m - m_all), jnp.exp2(m1 - m_all)
    acc = (acc * lax.broadcast_in_dim(a0, acc.shape, [0])
           + acc1 * lax.broadcast_in_dim(a1, acc.shape, [0]))
    return acc, l * a0 + l1 * a1


class _Sched:
    """The barrier that makes the two compute warpgroups take turns on the tensor core."""

    def __init__(self, barrier):
        self.barrier = barrier

    def __call__(self):
        plgpu.barrier_arrive(self.barrier)
        plgpu.barrier_wait(self.barrier)


def _skip_step(j, carry, *, first_step, num_slots, bars, sched):
    """A step past this warpgroup's last key (or of an idle warpgroup): observe and free the slot.

    Waiting on the load barriers keeps every barrier phase observed by every waiter (the interpreter
    checks this; on the GPU it keeps the parity bookkeeping exact), and the two schedule barriers
    match the two a real step takes, so the other warpgroup's ping-pong never stalls.
    """
    k_bar, v_bar, k_free, v_free = bars
    slot = lax.rem(first_step + j, num_slots)
    plgpu.barrier_wait(k_bar.at[slot])
    plgpu.barrier_arrive(k_free.at[slot])
    plgpu.barrier_wait(v_bar.at[slot])
    plgpu.barrier_arrive(v_free.at[slot])
    sched()
    sched()
    return carry


def _store_rows(out, obuf, o_ref, head, load, lo, rows):
    """Write rows [lo, lo + rows) of the tile out (dtype[BQ, D]) to o_ref rows load + lo + ...

    Through the untiled buffer (any row offset is addressable there, and TMA from untiled SMEM takes
    any GMEM row) in TMA stores of BQ, BQ/2, ..., 2, 1 rows picked by the bits of `rows`: a full tile
    is one store, and no row of a neighbouring request is touched. The stores are not waited for here:
    the next tile's store waits until they have read obuf, the kernel's end until they land.
    """
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    obuf[...] = out
    plgpu.commit_smem()
    first, size = lo, obuf.shape[0]
    while size:
        @pl.when((rows & size) != 0)
        def _(first=first, size=size):
            plgpu.copy_smem_to_gmem(obuf.at[pl.ds(first, size)], o_ref.at[pl.ds(load + first, size), head])
        first, size = first + (rows & size), size // 2


class _Work:
    """The (tile, head) items of this CTA, tile-major with heads fastest (GQA siblings share K/V in
    L2), dealt in rounds of num_ctas in snake order so that CTAs balance: the work list runs longest
    first, and a CTA that takes a long item in one round takes a short one in the next.

    # 3 CTAs, 8 items -> rounds [0 1 2] [5 4 3] [6 7 -]: CTA 0 runs items 0, 5, 6; CTA 2 runs 2, 3
    """

    def __init__(self, live_tiles, num_ctas, num_heads):
        self.cta, self.num_ctas, self.num_heads = lax.axis_index("ctas"), num_ctas, num_heads
        num_items = live_tiles * num_heads
        full, left = num_items // num_ctas, lax.rem(num_items, num_ctas)
        self.num_iters = full + (self._slot(full) < left).astype(jnp.int32)

    def _slot(self, k):
        """This CTA's place in round k."""
        return jnp.where(lax.rem(k, 2) == 0, self.cta, self.num_ctas - 1 - self.cta)

    def item(self, k):
        """-> (tile, head) of this CTA's k-th item."""
        i = k * self.num_ctas + self._slot(k)
        return i // self.num_heads, lax.rem(i, self.num_heads)


def _wg_tile(sched_ref, tile, wg, block_kv):
    """(first q row, first written row - that, rows written, position of the first, key steps) of
    compute warpgroup wg in tile; steps stop at the last written row's position (0: idle or zero tile)."""
    load, lo, rows, pos = (sched_ref[tile, ms.WG0 + 4 * wg + c] for c in (ms.LOAD, ms.LO, ms.ROWS, ms.POS))
    steps = jnp.where(rows > 0, pl.cdiv(pos + rows, block_kv), 0)
    return load, lo, rows, pos, jnp.minimum(steps, sched_ref[tile, ms.STEPS])


def _compute_wg(wg, work, sched_ref, slopes_ref, q_ref, o_ref, smem, bars, *, scale, causal, alibi, split,
                fp8, interpret):
    """Compute warpgroup wg: its half of each item's tile, online softmax over the item's keys; with split
    (not causal; wg static) both warpgroups take warpgroup 0's rows, each every other key step, and warpgroup
    0 merges and writes."""
    q_smem2, qbuf2, obuf2, k_smem, v_smem = smem[:5]
    wide2 = smem[5] if fp8 else None
    xchg = smem[5 + fp8:7 + fp8] if split else None
    k_bar, v_bar, q_bar, k_free, v_free, sched_bar = bars[:6]
    xbars = bars[6:8] if split else None
    plgpu.set_max_registers(232, action="increase")
    # buffers indexed by the traced warpgroup index either way (a static index into a transposed wgmma
    # operand does not lower under warpgroup semantics)
    wg_index = lax.axis_index("wg") if split else wg
    q_smem, qbuf, obuf = q_smem2.at[wg_index], qbuf2.at[wg_index], obuf2.at[wg_index]   # [BQ, D] each
    wide = wide2.at[wg_index] if fp8 else None                                          # [BKV, D] (e4m3 pool)
    rows_of = 0 if split else wg                     # whose half of the tile this warpgroup computes
    block_q, head_dim = q_smem.shape
    num_slots, block_kv = k_smem.shape[0], k_smem.shape[1]
    sched = _Sched(sched_bar)
    load_bars = (k_bar, v_bar, k_free, v_free)

    def fetch_q(k):
        # Mosaic's TMA into 8-row-tiled SMEM views GMEM as whole 8-row tiles, so a tile starting at
        # any token lands in the untiled qbuf first.
        tile, head = work.item(k)
        load, *_, num_steps = _wg_tile(sched_ref, tile, rows_of, block_kv)
        pl.when(num_steps > 0)(lambda: plgpu.copy_gmem_to_smem(
            q_ref.at[pl.ds(load, block_q), head], qbuf, q_bar.at[wg_index]))

    pl.when(work.num_iters > 0)(lambda: fetch_q(0))

    def run_item(k, first_step):
        tile, head = work.item(k)
        load, lo, rows, pos, num_steps = _wg_tile(sched_ref, tile, rows_of, block_kv)
        item_steps = sched_ref[tile, ms.STEPS]

        @pl.when(num_steps > 0)
        def _():                                     # qbuf -> the swizzled wgmma operand
            plgpu.barrier_wait(q_bar.at[wg_index])
            q_smem[...] = qbuf[...] if interpret else ops.smem_load(qbuf, plgpu.Layout.WGMMA)
            plgpu.commit_smem()                      # generic-proxy writes -> visible to wgmma

        pl.when(k + 1 < work.num_iters)(lambda: fetch_q(k + 1))     # lands while this item computes
        m = ops.layout(jnp.full((block_q,), _M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1), interpret)
        l = ops.layout(jnp.full((block_q,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1), interpret)
        acc = ops.layout(jnp.full((block_q, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA, interpret)
        # Not causal: every row sees the keys up to the last written row's position (decode rows).
        key_last = None if causal else pos + rows - 1
        # a zero tile's request is -1: it takes no key steps, and reads row 0 of the table
        slope = slopes_ref[jnp.maximum(sched_ref[tile, ms.REQ], 0), head] * (1.0 / scale) if alibi else None
        if split:
            # (a non-causal tile's rows see every step of the item: num_steps == item_steps, or 0 when idle)
            step = functools.partial(_split_step, first_step=first_step, key_last=key_last, q_smem=q_smem,
                                     k_smem=k_smem, v_smem=v_smem, wide=wide, bars=load_bars,
                                     qk_scale=scale * _LOG2E, alibi_slope=slope, interpret=interpret)

            def pair(i, carry):
                carry = step(2 * i, carry, own=wg == 0)
                return step(2 * i + 1, carry, own=wg == 1)
            carry = lax.fori_loop(0, item_steps // 2, pair, (acc, m, l))
            acc, m, l = lax.fori_loop(item_steps - lax.rem(item_steps, 2), item_steps,
                                      functools.partial(step, own=wg == 0), carry)     # an odd last step
            acc, l = _merge_halves(wg, k, acc, m, l, xchg, xbars, interpret)
            if wg == 0:
                pl.when(rows > 0)(lambda: _store_rows(
                    (acc / lax.broadcast_in_dim(jnp.maximum(l, 1.0), acc.shape, [0])).astype(o_ref.dtype),
                    obuf, o_ref, head, load, lo, rows))
            return first_step + item_steps
        pl.when(num_steps > 0)(lambda: plgpu.barrier_wait(k_bar.at[lax.rem(first_step, num_slots)]))
        pl.when(wg == 1)(sched)                      # offset the two warpgroups by half a step
        step = functools.partial(_kv_step, first_step=first_step, row_pos0=pos - lo, key_last=key_last,
                                 num_steps=num_steps, q_smem=q_smem, k_smem=k_smem, v_smem=v_smem,
                                 wide=wide, bars=load_bars, sched=sched, qk_scale=scale * _LOG2E,
                                 alibi_slope=slope, interpret=interpret)
        # Steps whose keys all sit at or before the first written row's position (causal; the last row's
        # otherwise) need no mask.
        num_full = jnp.clip((pos + 1 if causal else pos + rows) // block_kv, 0, num_steps)  # idle: pos < 0
        carry = lax.fori_loop(0, num_full, functools.partial(step, masked=False), (acc, m, l))
        acc, m, l = lax.fori_loop(num_full, num_steps, functools.partial(step, masked=True), carry)
        lax.fori_loop(num_steps, item_steps, functools.partial(
            _skip_step, first_step=first_step, num_slots=num_slots, bars=load_bars, sched=sched), 0)
        pl.when(wg == 0)(sched)

        @pl.when(rows > 0)
        def _():
            # l >= 1 on every row with a key (its maximum contributes exp2(0)); zero tiles have l = 0
            out = acc / lax.broadcast_in_dim(jnp.maximum(l, 1.0), acc.shape, [0])
            _store_rows(out.astype(o_ref.dtype), obuf, o_ref, head, load, lo, rows)
        return first_step + item_steps

    lax.fori_loop(0, work.num_iters, run_item, jnp.int32(0))
    if split and wg == 1:                            # observe warpgroup 0's last read of the exchange too
        pl.when(work.num_iters > 0)(lambda: plgpu.barrier_wait(xbars[1]))
    plgpu.wait_smem_to_gmem(0)


def _memory_wg(work, sched_ref, layer_ref, tables_ref, kv_ref, smem, bars, *, group, num_blocks,
               num_kv_heads):
    """Memory warpgroup: gathers every item's K/V steps into the C slots, P TMA copies per slot."""
    k_smem, v_smem = smem[3:5]
    k_bar, v_bar, _, k_free, v_free, _ = bars[:6]
    plgpu.set_max_registers(40, action="decrease")

    def run_item(k, first_step):
        tile, head = work.item(k)
        req, item_steps = sched_ref[tile, ms.REQ], sched_ref[tile, ms.STEPS]
        k_row0 = layer_ref[0] * (2 * num_blocks * num_kv_heads) + head // group
        ops.gather_kv_steps(kv_ref, tables_ref, req, first_step, item_steps, k_row0, k_row0 + num_blocks * num_kv_heads,
                            (k_smem, v_smem), (k_bar, v_bar, k_free, v_free), num_kv_heads=num_kv_heads)
        return first_step + item_steps

    total = lax.fori_loop(0, work.num_iters, run_item, jnp.int32(0))
    ops.observe_last_frees(total, k_free, v_free, k_smem.shape[0])


def _kernel(sched_ref, meta_ref, tables_ref, slopes_ref, q_ref, kv_ref, o_ref, *scratch, scale, group, num_heads,
            num_ctas, num_blocks, num_kv_heads, causal, alibi, split, fp8, interpret):
    # sched_ref:  i32[NT, 10]                 see _mgpu_schedule.tile_schedule
    # meta_ref:   i32[2]                      layer, live tiles (the first rows of sched)
    # tables_ref: i32[R, Mp]                  Mp = M rounded up to P; padding is the null block 0
    # slopes_ref: f32[R, N]                   ALiBi slope of request r's head n (read only when alibi)
    # q_ref:      dtype[Tp, N, D]
    # kv_ref:     dtype[L * 2 * B * K, S, D]  the pool with its leading axes flattened (or its e4m3 bytes)
    # o_ref:      dtype[Tp, N, D]             rows [0, T) written, the others untouched
    # scratch:    5 SMEM buffers, the e4m3 pool's widening buffers, split's exchange buffers (see _launch), then
    #             barriers k, v, q, k free, v free, schedule, and split's exchange ready and free
    num_smem = 5 + fp8 + 2 * split
    smem, bars = scratch[:num_smem], scratch[num_smem:]
    wg = lax.axis_index("wg")
    work = _Work(meta_ref[1], num_ctas, num_heads)
    compute = functools.partial(_compute_wg, work=work, sched_ref=sched_ref, slopes_ref=slopes_ref, q_ref=q_ref,
                                o_ref=o_ref, smem=smem, bars=bars, scale=scale, causal=causal, alibi=alibi,
                                split=split, fp8=fp8, interpret=interpret)
    if split:                                        # each warpgroup's own code: its half of the steps is static
        for w in range(_COMPUTE_WGS):
            pl.when(wg == w)(functools.partial(compute, w))
    else:
        pl.when(wg < _COMPUTE_WGS)(lambda: compute(wg))
    pl.when(wg == _COMPUTE_WGS)(functools.partial(
        _memory_wg, work, sched_ref, meta_ref, tables_ref, kv_ref, smem, bars, group=group,
        num_blocks=num_blocks, num_kv_heads=num_kv_heads))


def _launch(sched, meta, tables, slopes, qp, kv_rows, *, num_ctas, scale, group, num_blocks, num_kv_heads,
            block_q, block_kv, num_slots, causal, alibi, split, interpret, lowering_semantics):
    _, num_heads, head_dim = qp.shape
    per_step = block_kv // kv_rows.shape[1]
    # 128-byte rows (64 bf16/fp16 columns) in 8-row tiles, swizzled: the layout wgmma reads.
    mma = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    fp8 = kv_rows.dtype == FP8_CACHE_DTYPE
    # e4m3 slots: rows of D bytes in 8-row tiles, swizzled by their width (the layout the widening reads)
    slot = dict(transforms=(plgpu.TilingTransform((8, head_dim)), plgpu.SwizzleTransform(head_dim))) if fp8 else mma
    scratch = [
        plgpu.SMEM((_COMPUTE_WGS, block_q, head_dim), qp.dtype, **mma),   # q (wgmma operand)
        plgpu.SMEM((_COMPUTE_WGS, block_q, head_dim), qp.dtype),          # next q, untiled
        plgpu.SMEM((_COMPUTE_WGS, block_q, head_dim), qp.dtype),          # output, untiled
        plgpu.SMEM((num_slots, block_kv, head_dim), kv_rows.dtype, **slot),  # K slots
        plgpu.SMEM((num_slots, block_kv, head_dim), kv_rows.dtype, **slot),  # V slots
    ]
    if fp8:                                                               # each warpgroup's widened K or V
        scratch.append(plgpu.SMEM((_COMPUTE_WGS, block_kv, head_dim), qp.dtype, **mma))
    if split:                                 # warpgroup 1's acc, and its m and l as [BQ, 8] broadcasts
        scratch += [plgpu.SMEM((block_q, head_dim), jnp.float32), plgpu.SMEM((2, block_q, 8), jnp.float32)]
    scratch += [
        plgpu.Barrier(num_arrivals=per_step, num_barriers=num_slots),     # K slot loaded (P copies)
        plgpu.Barrier(num_arrivals=per_step, num_barriers=num_slots),     # V slot loaded
        plgpu.Barrier(num_barriers=_COMPUTE_WGS),                         # q tile loaded
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=num_slots),  # K slot free
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=num_slots),  # V slot free
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS),                         # tensor-core ping-pong
    ]
    if split:
        scratch += [plgpu.Barrier(), plgpu.Barrier()]                     # exchange written / read
    kernel = functools.partial(_kernel, scale=scale, group=group, num_heads=num_heads, num_ctas=num_ctas,
                               num_blocks=num_blocks, num_kv_heads=num_kv_heads, causal=causal, alibi=alibi,
                               split=split, fp8=fp8, interpret=interpret is not None)
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct(qp.shape, qp.dtype), scratch_types=scratch,
        grid=(num_ctas,), grid_names=("ctas",), num_threads=_COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=ops.compiler_params(lowering_semantics), interpret=interpret,
    )(sched, meta, tables, slopes, qp, kv_rows)


def mgpu_supported(q, kv_cache, block_size, *, sliding_window=None, soft_cap=None) -> str | None:
    """None when the Mosaic GPU kernel handles this call, else the reason (callers fall back)."""
    if sliding_window is not None or soft_cap is not None:
        return "the Mosaic GPU kernel supports neither sliding windows nor soft caps"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or kv_cache.dtype not in (q.dtype, FP8_CACHE_DTYPE):
        return (f"the Mosaic GPU kernel needs bf16/fp16 q and a cache of q's dtype or e4m3 "
                f"({FP8_CACHE_DTYPE}); got {q.dtype}, {kv_cache.dtype}")
    head_dim = q.shape[-1]
    if head_dim not in (64, 128):
        return f"the Mosaic GPU kernel needs head dim 64 or 128; got {head_dim}"
    if block_size not in (8, 16, 32, 64) or kv_cache.shape[4] != block_size:
        return (f"the Mosaic GPU kernel needs block size 8/16/32/64 (whole 8-row tiles per TMA copy); "
                f"got {block_size}, cache {kv_cache.shape}")
    if q.shape[1] % kv_cache.shape[3]:
        return f"{q.shape[1]} query heads are not a multiple of {kv_cache.shape[3]} kv heads"
    device = jax.devices()[0]
    if device.platform == "gpu" and not is_hopper(device):
        return f"the Mosaic GPU kernel needs Hopper's wgmma (sm_90); this GPU is {device.device_kind}"
    try:
        from jax._src.lib import cuda_versions
        cuda = cuda_versions.cuda_runtime_get_version() if cuda_versions is not None else 0
    except Exception:  # no CUDA runtime (CPU jaxlib): the interpreter runs
        cuda = 0
    if 12080 <= cuda < 12091:  # the guard JAX's attention_mgpu.py has for its causal mask
        return f"CUDA runtime {cuda}: ptxas 12.8.0-12.9.0 miscompiles the causal mask"
    return None


def _smem_bytes(head_dim, cache_dtype, block_q, block_kv, num_slots, split=False) -> int:
    """The SMEM buffers _launch allocates (2-byte q and output tiles; slots of the cache's dtype; over an
    e4m3 pool one float16 [BKV, D] buffer per compute warpgroup; with split, the f32 exchange)."""
    fp8 = jnp.dtype(cache_dtype) == FP8_CACHE_DTYPE
    rows = 3 * _COMPUTE_WGS * block_q * 2 + 2 * num_slots * block_kv * jnp.dtype(cache_dtype).itemsize
    exchange = (block_q * head_dim + 2 * block_q * 8) * 4 if split else 0
    return (rows + (_COMPUTE_WGS * block_kv * 2 if fp8 else 0)) * head_dim + exchange


def _validate(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc, *, scale, block_q,
              block_kv, max_concurrent_steps, sliding_window, soft_cap, split_keys=False, causal=True):
    validate_q_and_cache(q, kv_cache, layer_idx)
    reason = mgpu_supported(q, kv_cache, kv_cache.shape[4], sliding_window=sliding_window,
                            soft_cap=soft_cap)
    if reason:
        raise ValueError(reason)
    num_reqs = seq_lens.shape[0]
    if (block_tables.ndim != 2 or block_tables.shape[0] != num_reqs or seq_lens.ndim != 1
            or query_start_loc.shape != (num_reqs + 1,)):
        raise ValueError(f"block_tables {block_tables.shape}, seq_lens {seq_lens.shape} and "
                         f"query_start_loc {query_start_loc.shape} disagree on the request count")
    if any(x.dtype != jnp.int32 for x in (block_tables, seq_lens, query_start_loc)) or not scale > 0:
        raise ValueError("block_tables, seq_lens and query_start_loc must be int32 and scale > 0 "
                         f"(the softmax runs in the log2 domain); got scale {scale}")
    if block_q not in (64, 128) or block_kv not in (64, 128) or block_kv % kv_cache.shape[4]:
        raise ValueError(f"block_q and block_kv must be 64 or 128 (wgmma tiles), block_kv a multiple "
                         f"of the block size; got {block_q}, {block_kv}, S={kv_cache.shape[4]}")
    if max_concurrent_steps < 2:
        raise ValueError(f"max_concurrent_steps must be >= 2; got {max_concurrent_steps}")
    if split_keys and causal:
        raise ValueError("split_keys needs causal=False (the packed decode rows: every row sees every key step)")
    need = _smem_bytes(q.shape[-1], kv_cache.dtype, block_q, block_kv, max_concurrent_steps, split_keys)
    if need > _SMEM_BYTES:
        raise ValueError(f"{need} bytes of shared memory needed, {_SMEM_BYTES} available: lower "
                         "block_kv, block_q or max_concurrent_steps")


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_kv", "max_concurrent_steps",
                                             "sliding_window", "soft_cap", "num_ctas", "causal", "split_keys",
                                             "skip_single_tokens", "interpret", "lowering_semantics"))
def ragged_paged_attention_mgpu(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc, *,
                                scale: float, block_q: int = 64, block_kv: int = 128,
                                max_concurrent_steps: int = 2, sliding_window: int | None = None,
                                soft_cap: float | None = None, num_ctas: int | None = None,
                                causal: bool = True, alibi_slopes=None, split_keys: bool = False,
                                skip_single_tokens: bool = False, interpret=None,
                                lowering_semantics: str | None = None):
    """Same contract as ragged_paged_attention_reference: q dtype[T, N, D] -> dtype[T, N, D]; the cache is
    q's dtype or e4m3 (FP8_CACHE_DTYPE bytes: the kernel then computes in float16).

    alibi_slopes: None, f32[N] (ALiBi, the reference's meaning) or f32[R, N] (each request's own: the
    packed decode rows of paged_decode_attention_mgpu, whose "requests" are (request, kv head) pairs).
    split_keys (causal=False only): both compute warpgroups take the first warpgroup's rows of each tile and
    every other key step each, and merge at the item's end (a decode tile's rows fill one warpgroup's half,
    so the other would idle; over an e4m3 pool each step's widening and softmax bound the kernel).
    block_q: query tokens per compute warpgroup (a CTA holds 2 * block_q); block_kv: keys per pipeline
    step; max_concurrent_steps: K/V slots in flight; num_ctas: persistent CTAs (None: one per SM on the
    GPU, 3 in the interpreter). causal=False: every query row of a request sees all its seq_lens[r]
    keys (the packed decode rows of paged_decode_attention_mgpu; q_len may then exceed seq_lens).
    skip_single_tokens: the rows of requests with one query token are left unwritten (their values are
    undefined): mixed_attention_mgpu computes them with the packed decode kernel instead.
    interpret: None (CPU -> Mosaic GPU interpreter), a bool, or an InterpretGPUParams.
    lowering_semantics: None (jax's default), "lane" or "warpgroup".
    """
    _validate(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc, scale=scale,
              block_q=block_q, block_kv=block_kv, max_concurrent_steps=max_concurrent_steps,
              sliding_window=sliding_window, soft_cap=soft_cap, split_keys=split_keys, causal=causal)
    num_tokens, num_heads, head_dim = q.shape
    num_layers, _, num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    per_step = block_kv // block_size
    out_dtype = q.dtype
    if kv_cache.dtype == FP8_CACHE_DTYPE:           # e4m3 widens exactly to float16 (one instruction a pair)
        q = q.astype(jnp.float16)
    num_rows = max(num_tokens, block_q)          # a clamped q tile always fits inside [0, Tp)
    qp = jnp.pad(q, ((0, num_rows - num_tokens), (0, 0), (0, 0)))
    # Whole steps of table entries; the extra entries point at the null block (keys masked anyway).
    max_blocks = block_tables.shape[1]
    tables = jnp.pad(block_tables, ((0, 0), (0, -(-max_blocks // per_step) * per_step - max_blocks)))
    sched, live_tiles, num_tiles = ms.tile_schedule(query_start_loc, seq_lens, num_tokens, num_rows,
                                                    block_q, block_kv, skip_single_tokens)
    kv_rows = kv_cache.reshape(num_layers * 2 * num_blocks * num_kv_heads, block_size, head_dim)
    meta = jnp.stack([jnp.asarray(layer_idx, jnp.int32), live_tiles])
    alibi = alibi_slopes is not None
    slopes = (jnp.broadcast_to(jnp.asarray(alibi_slopes, jnp.float32), (seq_lens.shape[0], num_heads)) if alibi
              else jnp.zeros((1, 1), jnp.float32))
    interpret = ops.interpret_params(interpret)
    if num_ctas is None:
        # one CTA per SM (the H100 SXM's count when lowering for CUDA without a GPU)
        num_ctas = _INTERPRET_CTAS if interpret is not None else device_num_sms()
    out = _launch(sched, meta, tables, slopes, qp, kv_rows, num_ctas=min(num_ctas, num_tiles * num_heads),
                  scale=scale, group=num_heads // num_kv_heads, num_blocks=num_blocks,
                  num_kv_heads=num_kv_heads, block_q=block_q, block_kv=block_kv,
                  num_slots=max_concurrent_steps, causal=causal, alibi=alibi, split=split_keys, interpret=interpret,
                  lowering_semantics=lowering_semantics)
    return out[:num_tokens].astype(out_dtype)
