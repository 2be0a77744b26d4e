"""Ragged paged causal attention as a Pallas Mosaic GPU kernel for Hopper (FlashAttention-3 style).

Legend as in ragged_paged_attention.py (T tokens, R requests, N query heads, K kv heads, G = N // K,
D head dim, L layers, B blocks in the pool, S block size, M max blocks per request), plus BQ query
tokens per warpgroup tile, BKV keys per pipeline step (P = BKV // S cache blocks), C pipeline slots
(max_concurrent_steps), NT CTA tiles, Tp = max(T, BQ) rows of the padded q / output.

One CTA = one query head h x up to 2 * BQ consecutive query tokens of ONE request, run by three
warpgroups (as JAX's attention_mgpu.py): two compute warpgroups own one BQ-token tile each, the third
(memory warpgroup) streams the request's K/V through C SMEM slots. A slot of BKV keys is gathered from
the paged cache with one TMA copy per cache block: block block_tables[r, j] is the contiguous [S, D]
tile kv_cache[layer, 0 or 1, block, h // G], copied to rows [i * S, (i + 1) * S) of the slot; the P
copies of a slot complete on one barrier made with num_arrivals=P (every copy arrives once and adds
its bytes to the expected transaction count).

Tiles never write rows of another request. A request of q_len >= 2 * BQ tokens gets cdiv(q_len, 2 BQ)
CTAs, the last shifted back to end at its last token; a CTA with BQ <= n < 2 BQ tokens gives its
second warpgroup the tile ending at the last token (overlapping the first: overlapping rows are
computed identically and written twice with the same values). A CTA with n < BQ tokens (decodes,
short chunks) loads a BQ-row q tile clamped inside [0, Tp) and leaves its second warpgroup idle.
Tiles start at any token, and Mosaic's TMA into 8-row-tiled (swizzled) SMEM only addresses whole
8-row tiles of GMEM, so q and the output go through an untiled SMEM buffer: q is re-laid out into
the swizzled wgmma operand by one register round trip, and a tile's rows are stored by TMA stores of
BQ, BQ/2, ..., 2, 1 rows picked by the bits of its row count. The schedule (request, rows and
positions of every tile) is computed by a few jnp ops before the launch; CTAs past the real count
exit at once. Output rows past query_start_loc[R] (bucket padding) are zeroed by a jnp.where outside.

Causal: key step j is unmasked when all its keys are <= the tile's first query position; later steps
mask per row (key_pos <= row_pos). Query token i of request r sits at seq_lens[r] - q_len[r] + i.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from ._checks import validate_q_and_cache

_LOG2E = math.log2(math.e)
_M_INIT = -1e30                  # finite: rows with no unmasked key stay NaN-free until the division
_SMEM_BYTES = 227 * 1024         # H100 dynamic shared memory per CTA
_COMPUTE_WGS = 2
_JAX_VERSION = tuple(int(x) for x in jax.__version__.split(".")[:2])
# Columns of the schedule table sched i32[NT, 2 + 4 * 2]: request (-1: no work), K/V steps of the CTA,
# then per compute warpgroup: first row of its q tile, first row it writes, rows it writes (0: idle),
# position of the first written row.
_REQ, _STEPS, _WG0 = 0, 1, 2
_LOAD, _LO, _ROWS, _POS = 0, 1, 2, 3


def _interpret_params(interpret):
    """None on the GPU; an InterpretGPUParams (Mosaic GPU interpreter on the CPU) otherwise."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if interpret is False:
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # same path in 0.10/0.11
    return InterpretGPUParams() if interpret is True else interpret


def _compiler_params(lowering_semantics: str | None):
    # jax 0.10 defaults to Lane semantics, 0.11 to Warpgroup; None keeps each version's default (the one
    # its own attention_mgpu.py runs and is tested with).
    kw = {}
    if lowering_semantics is not None:
        kw["lowering_semantics"] = {"lane": plgpu.LoweringSemantics.Lane,
                                    "warpgroup": plgpu.LoweringSemantics.Warpgroup}[lowering_semantics]
    return plgpu.CompilerParams(approx_math=True, **kw)


def _qk(q_smem, k_slot, sched, interpret):
    """[BQ, D] x [BKV, D]^T -> f32[BQ, BKV]; runs the schedule barrier while the wgmma is in flight."""
    if interpret:  # the interpreter's wgmma takes neither transposed refs nor register operands
        qk = lax.dot_general(q_smem[...], k_slot[...], (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
        sched()
        return qk

    def compute(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_slot, (1, 0)))
        sched()
        return acc_ref[...]
    return pl.run_scoped(compute, plgpu.ACC(q_smem.shape[:1] + k_slot.shape[:1], jnp.float32))


def _pv(acc, p16, v_slot, after_issue, interpret):
    """acc + p16 @ v_slot, f32[BQ, D]; after_issue runs while the wgmma is in flight."""
    if interpret:  # run_state is not interpreted either: same math as a plain f32-accumulated dot
        acc = acc + lax.dot(p16, v_slot[...], preferred_element_type=jnp.float32)
        after_issue()
        return acc

    def compute(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_slot)
        after_issue()
    return pl.run_state(compute)(plgpu.ACC.init(acc))


def _smem_load(ref, layout):
    """The whole ref in registers: jax 0.10 wants plgpu.load's index positionally, 0.11 deprecates it."""
    if _JAX_VERSION < (0, 11):
        return plgpu.load(ref, (), layout=layout, optimized=False)
    return plgpu.load(ref, layout=layout, optimized=False)


def _layout(x, layout, interpret):  # layout_cast has no CPU lowering: the interpreter skips it
    return x if interpret else plgpu.layout_cast(x, layout)


def _iota(shape, dim, interpret):
    return _layout(lax.broadcasted_iota(jnp.int32, shape, dim), plgpu.Layout.WGMMA, interpret)


def _kv_step(j, carry, *, masked, row_pos0, num_steps, q_smem, k_smem, v_smem, bars, sched,
             qk_scale, interpret):
    """One BKV-key step of online softmax for one compute warpgroup (FA3 ping-pong order)."""
    acc, m, l = carry                                # f32[BQ, D], f32[BQ], f32[BQ] (log2 domain)
    k_bar, v_bar, k_free, v_free = bars
    num_slots, block_kv = k_smem.shape[0], k_smem.shape[1]
    slot = lax.rem(j, num_slots)
    qk = _qk(q_smem, k_smem.at[slot], sched, interpret)            # f32[BQ, BKV]
    plgpu.barrier_arrive(k_free.at[slot])
    if masked:
        rows = _iota(qk.shape, 0, interpret) + row_pos0
        cols = _iota(qk.shape, 1, interpret) + j * block_kv
        qk = jnp.where(cols <= rows, qk, -jnp.inf)
    m_new = jnp.maximum(m, qk.max(axis=1) * qk_scale)
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(qk * qk_scale - lax.broadcast_in_dim(m_new, qk.shape, [0]))
    acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
    l = l * alpha + p.sum(axis=1)
    p16 = p.astype(q_smem.dtype)
    acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
    plgpu.barrier_arrive(sched.barrier)              # softmax done: let the other warpgroup's wgmma go
    plgpu.barrier_wait(v_bar.at[slot])
    plgpu.barrier_wait(sched.barrier)                # wait until the tensor core is ours again

    def wait_next_k():
        @pl.when(j + 1 < num_steps)
        def _():
            plgpu.barrier_wait(k_bar.at[lax.rem(j + 1, num_slots)])
    acc = _pv(acc, p16, v_smem.at[slot], wait_next_k, interpret)
    plgpu.barrier_arrive(v_free.at[slot])
    return acc, m_new, l


class _Sched:
    """The barrier that makes the two compute warpgroups take turns on the tensor core."""

    def __init__(self, barrier):
        self.barrier = barrier

    def __call__(self):
        plgpu.barrier_arrive(self.barrier)
        plgpu.barrier_wait(self.barrier)


def _skip_step(j, carry, *, num_slots, bars, sched):
    """A step past this warpgroup's last key (or of an idle warpgroup): observe and free the slot.

    Waiting on the load barriers keeps every barrier phase observed by every waiter (the interpreter
    checks this; on the GPU it keeps the parity bookkeeping exact), and the two schedule barriers
    match the two a real step takes, so the other warpgroup's ping-pong never stalls.
    """
    k_bar, v_bar, k_free, v_free = bars
    slot = lax.rem(j, num_slots)
    plgpu.barrier_wait(k_bar.at[slot])
    plgpu.barrier_arrive(k_free.at[slot])
    plgpu.barrier_wait(v_bar.at[slot])
    plgpu.barrier_arrive(v_free.at[slot])
    sched()
    sched()
    return carry


def _store_rows(out, io_smem, o_ref, head, load, lo, rows):
    """Write rows [lo, lo + rows) of the tile out (dtype[BQ, D]) to o_ref rows load + lo + ...

    Through the untiled buffer (any row offset is addressable there, and TMA from untiled SMEM takes
    any GMEM row) in TMA stores of BQ, BQ/2, ..., 2, 1 rows picked by the bits of `rows`: a full tile
    is one store, and no row of a neighbouring request is touched.
    """
    io_smem[...] = out
    plgpu.commit_smem()
    first, size = lo, io_smem.shape[0]
    while size:
        @pl.when((rows & size) != 0)
        def _(first=first, size=size):
            plgpu.copy_smem_to_gmem(io_smem.at[pl.ds(first, size)],
                                    o_ref.at[pl.ds(load + first, size), head])
        first, size = first + (rows & size), size // 2
    plgpu.wait_smem_to_gmem(0)


def _load_q(q_ref, io_smem, q_smem, bar, head, load, interpret):
    """q rows [load, load + BQ) of one head -> the swizzled wgmma operand q_smem (dtype[BQ, D]).

    Mosaic's TMA into 8-row-tiled SMEM views GMEM as whole 8-row tiles, so a tile starting at any
    token goes through the untiled buffer and is re-laid out by one register round trip.
    """
    plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(load, q_smem.shape[0]), head], io_smem, bar)
    plgpu.barrier_wait(bar)
    q_smem[...] = io_smem[...] if interpret else _smem_load(io_smem, plgpu.Layout.WGMMA)
    plgpu.commit_smem()                              # generic-proxy writes -> visible to wgmma


def _compute_wg(wg, tile, head, cta_steps, sched_ref, q_ref, o_ref, smem, bars, *, scale, interpret):
    """Compute warpgroup wg: the BQ-row tile described by sched_ref[tile], online softmax over keys."""
    q_smem2, io_smem2, k_smem, v_smem = smem
    k_bar, v_bar, q_bar, k_free, v_free, sched_bar = bars
    plgpu.set_max_registers(232, action="increase")
    col = _WG0 + 4 * wg
    load, lo, rows, pos = (sched_ref[tile, col + c] for c in (_LOAD, _LO, _ROWS, _POS))
    q_smem, io_smem = q_smem2.at[wg], io_smem2.at[wg]              # [BQ, D] each
    block_q, head_dim = q_smem.shape
    num_slots, block_kv = k_smem.shape[0], k_smem.shape[1]
    sched = _Sched(sched_bar)
    # Steps that hold keys of this tile's rows: up to the position of its last written row.
    num_steps = jnp.where(rows > 0, pl.cdiv(pos + rows, block_kv), 0)

    pl.when(rows > 0)(lambda: _load_q(q_ref, io_smem, q_smem, q_bar.at[wg], head, load, interpret))

    m = _layout(jnp.full((block_q,), _M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1), interpret)
    l = _layout(jnp.full((block_q,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1), interpret)
    acc = _layout(jnp.full((block_q, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA, interpret)

    @pl.when(num_steps > 0)
    def _():
        plgpu.barrier_wait(k_bar.at[0])

    pl.when(wg == 1)(sched)                          # offset the two warpgroups by half a step
    load_bars = (k_bar, v_bar, k_free, v_free)
    step = functools.partial(_kv_step, row_pos0=pos - lo, num_steps=num_steps, q_smem=q_smem,
                             k_smem=k_smem, v_smem=v_smem, bars=load_bars, sched=sched,
                             qk_scale=scale * _LOG2E, interpret=interpret)
    # Steps whose keys all sit at or before the first written row's position need no causal mask.
    num_full = jnp.clip((pos + 1) // block_kv, 0, num_steps)  # idle warpgroups have pos < 0
    carry = lax.fori_loop(0, num_full, functools.partial(step, masked=False), (acc, m, l))
    acc, m, l = lax.fori_loop(num_full, num_steps, functools.partial(step, masked=True), carry)
    lax.fori_loop(num_steps, cta_steps, functools.partial(
        _skip_step, num_slots=num_slots, bars=load_bars, sched=sched), 0)
    pl.when(wg == 0)(sched)

    @pl.when(rows > 0)
    def _():
        out = acc / lax.broadcast_in_dim(l, acc.shape, [0])
        _store_rows(out.astype(o_ref.dtype), io_smem, o_ref, head, load, lo, rows)


def _memory_wg(head, req, cta_steps, layer_ref, tables_ref, kv_ref, smem, bars, *, group, num_blocks,
               num_kv_heads):
    """Memory warpgroup: gathers the request's K/V steps into the C slots, P TMA copies per slot."""
    _, _, k_smem, v_smem = smem
    k_bar, v_bar, _, k_free, v_free, _ = bars
    plgpu.set_max_registers(40, action="decrease")
    num_slots, block_kv = k_smem.shape[0], k_smem.shape[1]
    block_size = kv_ref.shape[1]
    per_step = block_kv // block_size
    # kv_ref rows are (layer, K/V, block, kv head) flattened: row of block b = row0 + b * K.
    k_row0 = layer_ref[0] * (2 * num_blocks * num_kv_heads) + head // group
    v_row0 = k_row0 + num_blocks * num_kv_heads

    def issue(j, slot, reuse):
        # Block ids are read before waiting for the slot, so their latency hides behind the wait.
        blocks = [tables_ref[req, j * per_step + i] for i in range(per_step)]
        for row0, dst, bar, free in ((k_row0, k_smem, k_bar, k_free), (v_row0, v_smem, v_bar, v_free)):
            if reuse:
                plgpu.barrier_wait(free.at[slot])
            for i, block in enumerate(blocks):
                plgpu.copy_gmem_to_smem(kv_ref.at[row0 + block * num_kv_heads],
                                        dst.at[slot, pl.ds(i * block_size, block_size)], bar.at[slot])

    for s in range(num_slots):
        pl.when(s < cta_steps)(functools.partial(issue, s, s, False))

    @pl.loop(num_slots, cta_steps)
    def _(j):
        issue(j, lax.rem(j, num_slots), True)

    # Observe the last frees too: every waiter sees every phase (the interpreter insists; free on HW).
    @pl.loop(jnp.maximum(cta_steps - num_slots, 0), cta_steps)
    def _(j):
        plgpu.barrier_wait(k_free.at[lax.rem(j, num_slots)])
        plgpu.barrier_wait(v_free.at[lax.rem(j, num_slots)])


def _kernel(sched_ref, layer_ref, tables_ref, q_ref, kv_ref, o_ref, *scratch, scale, group,
            num_blocks, num_kv_heads, interpret):
    # sched_ref:  i32[NT, 10]                 see _tile_schedule
    # layer_ref:  i32[1]
    # tables_ref: i32[R, Mp]                  Mp = M rounded up to P; padding is the null block 0
    # q_ref:      dtype[Tp, N, D]
    # kv_ref:     dtype[L * 2 * B * K, S, D]  the pool with its leading axes flattened
    # o_ref:      dtype[Tp, N, D]             rows of the requests written, the others untouched
    # scratch:    4 SMEM buffers (see _launch), then barriers k, v, q, k free, v free, schedule
    smem, bars = scratch[:4], scratch[4:]
    tile, head, wg = lax.axis_index("tiles"), lax.axis_index("heads"), lax.axis_index("wg")
    req = sched_ref[tile, _REQ]
    cta_steps = sched_ref[tile, _STEPS]

    pl.when((req >= 0) & (wg < _COMPUTE_WGS))(functools.partial(
        _compute_wg, wg, tile, head, cta_steps, sched_ref, q_ref, o_ref, smem, bars, scale=scale,
        interpret=interpret))
    pl.when((req >= 0) & (wg == _COMPUTE_WGS))(functools.partial(
        _memory_wg, head, req, cta_steps, layer_ref, tables_ref, kv_ref, smem, bars, group=group,
        num_blocks=num_blocks, num_kv_heads=num_kv_heads))


def _tile_schedule(query_start_loc, seq_lens, num_rows, block_q, block_kv):
    """sched i32[NT, 10] (columns: see _REQ ... _POS) and NT, longest CTAs first.

    # q_lens [3, 0, 200], BQ 64, Tp 203 -> CTA token ranges [0, 3) and [3, 131), [75, 203):
    #   CTA 0: WG0 loads rows [0, 64), writes 3 rows from 0; WG1 idle
    #   CTA 2: shifted back to end at token 203; both warpgroups full (WG1 rows [139, 203))
    """
    num_reqs = seq_lens.shape[0]
    cta_tokens = _COMPUTE_WGS * block_q
    num_tiles = -(-num_rows // cta_tokens) + num_reqs
    q_begin, q_end = query_start_loc[:-1], query_start_loc[1:]
    per_req = (q_end - q_begin + cta_tokens - 1) // cta_tokens
    cum = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per_req).astype(jnp.int32)])
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    req = jnp.minimum(jnp.searchsorted(cum[1:], tile, side="right").astype(jnp.int32), num_reqs - 1)
    real = tile < cum[num_reqs]
    qb, qe = q_begin[req], q_end[req]
    start = qb + (tile - cum[req]) * cta_tokens
    start = jnp.where(qe - qb >= cta_tokens, jnp.minimum(start, qe - cta_tokens), start)
    n = jnp.minimum(qe - start, cta_tokens)                         # tokens of this CTA
    full = n >= block_q
    load0 = jnp.where(full, start, jnp.minimum(start, num_rows - block_q))
    load1 = jnp.where(full, start + n - block_q, load0)
    ctx = seq_lens[req] - (qe - qb) - qb                            # flat token x sits at ctx + x
    steps = (ctx + start + n + block_kv - 1) // block_kv            # keys [0, last position] needed
    zero = jnp.zeros_like(tile)
    cols = [jnp.where(real, req, -1), jnp.where(real, steps, 0),
            load0, start - load0, jnp.where(real, jnp.minimum(n, block_q), 0), ctx + start,
            load1, zero, jnp.where(real & full, block_q, 0), ctx + load1]
    sched = jnp.stack(cols, axis=1).astype(jnp.int32)
    # Longest CTAs launch first: the tail of the grid is then made of short ones.
    return sched[jnp.argsort(-sched[:, _STEPS], stable=True)], num_tiles


def _launch(sched, layer, tables, qp, kv_rows, *, num_tiles, scale, group, num_blocks, num_kv_heads,
            block_q, block_kv, num_slots, interpret, lowering_semantics):
    _, num_heads, head_dim = qp.shape
    per_step = block_kv // kv_rows.shape[1]
    # 128-byte rows (64 bf16/fp16 columns) in 8-row tiles, swizzled: the layout wgmma reads.
    mma = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    scratch = [
        plgpu.SMEM((_COMPUTE_WGS, block_q, head_dim), qp.dtype, **mma),   # q (wgmma operand)
        plgpu.SMEM((_COMPUTE_WGS, block_q, head_dim), qp.dtype),          # q staging, then output
        plgpu.SMEM((num_slots, block_kv, head_dim), qp.dtype, **mma),     # K slots
        plgpu.SMEM((num_slots, block_kv, head_dim), qp.dtype, **mma),     # V slots
        plgpu.Barrier(num_arrivals=per_step, num_barriers=num_slots),     # K slot loaded (P copies)
        plgpu.Barrier(num_arrivals=per_step, num_barriers=num_slots),     # V slot loaded
        plgpu.Barrier(num_barriers=_COMPUTE_WGS),                         # q tile loaded
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=num_slots),  # K slot free
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=num_slots),  # V slot free
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS),                         # tensor-core ping-pong
    ]
    kernel = functools.partial(_kernel, scale=scale, group=group, num_blocks=num_blocks,
                               num_kv_heads=num_kv_heads, interpret=interpret is not None)
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct(qp.shape, qp.dtype), scratch_types=scratch,
        grid=(num_heads, num_tiles), grid_names=("heads", "tiles"),   # heads vary fastest: GQA
        num_threads=_COMPUTE_WGS + 1, thread_name="wg",               # siblings share K/V in L2
        compiler_params=_compiler_params(lowering_semantics), interpret=interpret,
    )(sched, layer, tables, qp, kv_rows)


def mgpu_supported(q, kv_cache, block_size, *, sliding_window=None, soft_cap=None) -> str | None:
    """None when the Mosaic GPU kernel handles this call, else the reason (callers fall back)."""
    if sliding_window is not None or soft_cap is not None:
        return "the Mosaic GPU kernel supports neither sliding windows nor soft caps"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or kv_cache.dtype != q.dtype:
        return f"the Mosaic GPU kernel needs bf16/fp16 q and cache; got {q.dtype}, {kv_cache.dtype}"
    head_dim = q.shape[-1]
    if head_dim not in (64, 128):
        return f"the Mosaic GPU kernel needs head dim 64 or 128; got {head_dim}"
    if block_size not in (8, 16, 32, 64) or kv_cache.shape[4] != block_size:
        return (f"the Mosaic GPU kernel needs block size 8/16/32/64 (whole 8-row tiles per TMA copy); "
                f"got {block_size}, cache {kv_cache.shape}")
    if q.shape[1] % kv_cache.shape[3]:
        return f"{q.shape[1]} query heads are not a multiple of {kv_cache.shape[3]} kv heads"
    try:
        from jax._src.lib import cuda_versions
        cuda = cuda_versions.cuda_runtime_get_version() if cuda_versions is not None else 0
    except Exception:  # no CUDA runtime (CPU jaxlib): the interpreter runs
        cuda = 0
    if 12080 <= cuda < 12091:  # the guard JAX's attention_mgpu.py has for its causal mask
        return f"CUDA runtime {cuda}: ptxas 12.8.0-12.9.0 miscompiles the causal mask"
    return None


def _validate(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc, *, scale, block_q,
              block_kv, max_concurrent_steps, sliding_window, soft_cap):
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
    need = (2 * _COMPUTE_WGS * block_q + 2 * max_concurrent_steps * block_kv) * q.shape[-1] * q.dtype.itemsize
    if need > _SMEM_BYTES:
        raise ValueError(f"{need} bytes of shared memory needed, {_SMEM_BYTES} available: lower "
                         "block_kv, block_q or max_concurrent_steps")


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_kv", "max_concurrent_steps",
                                             "sliding_window", "soft_cap", "interpret",
                                             "lowering_semantics"))
def ragged_paged_attention_mgpu(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc, *,
                                scale: float, block_q: int = 64, block_kv: int = 128,
                                max_concurrent_steps: int = 2, sliding_window: int | None = None,
                                soft_cap: float | None = None, interpret=None,
                                lowering_semantics: str | None = None):
    """Same contract as ragged_paged_attention_reference: q dtype[T, N, D] -> dtype[T, N, D].

    block_q: query tokens per compute warpgroup (a CTA holds 2 * block_q); block_kv: keys per pipeline
    step; max_concurrent_steps: K/V slots in flight. interpret: None (CPU -> Mosaic GPU interpreter),
    a bool, or an InterpretGPUParams. lowering_semantics: None (jax's default), "lane" or "warpgroup".
    """
    _validate(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc, scale=scale,
              block_q=block_q, block_kv=block_kv, max_concurrent_steps=max_concurrent_steps,
              sliding_window=sliding_window, soft_cap=soft_cap)
    num_tokens, num_heads, head_dim = q.shape
    num_layers, _, num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    per_step = block_kv // block_size
    num_rows = max(num_tokens, block_q)          # a clamped q tile always fits inside [0, Tp)
    qp = jnp.pad(q, ((0, num_rows - num_tokens), (0, 0), (0, 0)))
    # Whole steps of table entries; the extra entries point at the null block (keys masked anyway).
    max_blocks = block_tables.shape[1]
    tables = jnp.pad(block_tables, ((0, 0), (0, -(-max_blocks // per_step) * per_step - max_blocks)))
    sched, num_tiles = _tile_schedule(query_start_loc, seq_lens, num_rows, block_q, block_kv)
    kv_rows = kv_cache.reshape(num_layers * 2 * num_blocks * num_kv_heads, block_size, head_dim)
    layer = jnp.asarray(layer_idx, jnp.int32).reshape(1)
    out = _launch(sched, layer, tables, qp, kv_rows, num_tiles=num_tiles, scale=scale,
                  group=num_heads // num_kv_heads, num_blocks=num_blocks, num_kv_heads=num_kv_heads,
                  block_q=block_q, block_kv=block_kv, num_slots=max_concurrent_steps,
                  interpret=_interpret_params(interpret), lowering_semantics=lowering_semantics)
    # Rows no tile wrote (bucket padding past query_start_loc[R]) hold garbage: zero them.
    valid = jnp.arange(num_tokens) < query_start_loc[-1]
    return jnp.where(valid[:, None, None], out[:num_tokens], 0).astype(q.dtype)
