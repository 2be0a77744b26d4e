"""Paged decode attention for wide heads (head size 256: Gemma 2 and 3) on a persistent Mosaic GPU kernel
(Hopper), with soft caps and sliding windows.

Legend as in ragged_paged_attention.py (R requests, N query heads, K kv heads, G = N // K, D head dim, L
layers, B blocks, S block size, M max blocks per request), plus BKV keys per pipeline step (P = BKV // S
cache blocks), C pipeline slots, Gp = G rounded up to a multiple of 8 (rows of a pair's q and output).

Why a kernel of its own: the ragged kernel (ragged_paged_attention_mgpu.py, which paged_decode_attention_mgpu
packs decodes into) gives each of its two compute warpgroups three [64, D] tiles (q as the wgmma operand,
the next q and the output, untiled so that a tile can start at any row). At D = 256 those alone take
192 KiB of the 227 KiB of shared memory. A decode item is the G query heads of one (request, kv head) pair,
G rows of one 64-row tile, so one compute warpgroup is all it can use (the ragged kernel's second one idles
on decodes too), and its rows can be laid out so they start on the 8-row grid that TMA into swizzled
shared memory needs: the op pads each pair's G rows to Gp (a small copy of q) and TMA loads them straight
into rows [0, Gp) of the wgmma operand, with no untiled buffer. At D = 256, BKV = 64, C = 2:

  q, double-buffered (the next item's lands while this one computes)   2 x [64, D] bf16   64 KiB
  output (a wgmma-layout store, then a TMA store of rows [0, Gp))      [64, D] bf16       32 KiB
  K and V slots                                                        2 x C x [BKV, D]  128 KiB

Warp specialisation as in the ragged kernel: one compute warpgroup (wgmma, online softmax) and one memory
warpgroup that streams every item's K/V steps through the C slots, P TMA copies per slot, on one step count
across items (no pipeline drain between items). Persistent CTAs take the pairs longest first, dealt in
snake order (the ragged kernel's _Work).

Per key step the scores are scaled, soft-capped (cap * tanh(s / cap), Gemma's attention logit cap) and
masked to the keys a decode row sees: [seq_len - window, seq_len) with a sliding window, [0, seq_len)
without. Key steps wholly before the window are never loaded. A padding pair (seq_len 0) takes no step and
writes zeros.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import _mgpu_ops as ops
from ._checks import is_hopper
from .paged_decode_attention import device_num_sms, validate_decode_inputs
from .ragged_paged_attention_mgpu import _LOG2E, _M_INIT, _SMEM_BYTES, _online_softmax, _Work

_ROWS = 64                       # wgmma's M: the tile a pair's Gp rows sit in
_INTERPRET_CTAS = 3              # the interpreter's CTA count: several items a CTA


def mgpu_wide_decode_supported(q, kv_cache, *, alibi: bool = False) -> str | None:
    """None when paged_decode_attention_mgpu_wide takes this call (any soft cap or window; no ALiBi), else the
    reason."""
    if alibi:
        return "the wide Mosaic decode kernel has no ALiBi bias"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or kv_cache.dtype != q.dtype:
        return (f"the wide Mosaic decode kernel needs a bf16/fp16 q and a cache of its dtype; "
                f"got {q.dtype}, {kv_cache.dtype}")
    head_dim, num_kv_heads, block_size = q.shape[-1], kv_cache.shape[3], kv_cache.shape[4]
    if head_dim not in (128, 256):
        return f"the wide Mosaic decode kernel takes head dims 128 and 256; got {head_dim}"
    if q.shape[1] % num_kv_heads or q.shape[1] // num_kv_heads > _ROWS:
        return f"{q.shape[1]} query heads over {num_kv_heads} kv heads: not a group of at most {_ROWS} rows"
    if block_size not in (8, 16, 32, 64):
        return f"the wide Mosaic decode kernel needs block size 8/16/32/64 (whole 8-row TMA copies); got {block_size}"
    device = jax.devices()[0]
    if device.platform == "gpu" and not is_hopper(device):
        return f"the Mosaic GPU kernels need Hopper's wgmma (sm_90); this GPU is {device.device_kind}"
    return None


def smem_bytes(head_dim: int, block_kv: int, num_slots: int) -> int:
    """The kernel's shared memory (2-byte values): two q tiles, the output tile, C K and C V slots."""
    return (3 * _ROWS + 2 * num_slots * block_kv) * head_dim * 2


def _compute_wg(work, meta_ref, q_ref, o_ref, q_smem, o_smem, k_smem, v_smem, bars, *, scale, soft_cap,
                sliding_window, interpret):
    """Online softmax over each item's key steps; the item's rows [0, Gp) of the output stored by TMA."""
    k_bar, v_bar, q_bar, k_free, v_free = bars
    plgpu.set_max_registers(240, action="increase")
    num_slots, block_kv = k_smem.shape[0], k_smem.shape[1]
    rows = q_ref.shape[0] // meta_ref.shape[0]          # Gp
    head_dim = q_smem.shape[-1]
    # Rows Gp..63 of both q tiles hold zeros for the kernel's life: their scores are finite and never stored.
    for b in range(2):
        q_smem[b] = ops.layout(jnp.zeros((_ROWS, head_dim), q_smem.dtype), plgpu.Layout.WGMMA, interpret)
    plgpu.commit_smem()                                  # generic-proxy writes -> visible to TMA and wgmma

    def fetch_q(k):
        pair = meta_ref[work.item(k)[0], 0]
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(pair * rows, rows)], q_smem.at[lax.rem(k, 2), pl.ds(0, rows)],
                                q_bar.at[lax.rem(k, 2)])

    pl.when(work.num_iters > 0)(lambda: fetch_q(0))

    def run_item(k, first_step):
        pair, seq_len, step0, num_steps = (meta_ref[work.item(k)[0], c] for c in range(4))
        buf = lax.rem(k, 2)
        plgpu.barrier_wait(q_bar.at[buf])
        pl.when(k + 1 < work.num_iters)(lambda: fetch_q(k + 1))      # the other tile: item k - 1's is done
        q_tile = q_smem.at[buf]
        key_lo = 0 if sliding_window is None else seq_len - sliding_window        # keys [key_lo, seq_len)

        def step(j, carry):
            acc, m, l = carry                            # f32[64, D], f32[64], f32[64] (log2 domain)
            slot = lax.rem(first_step + j, num_slots)
            plgpu.barrier_wait(k_bar.at[slot])
            s = ops.qk(q_tile, k_smem.at[slot], lambda: None, interpret) * scale      # f32[64, BKV]
            plgpu.barrier_arrive(k_free.at[slot])
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s * (1.0 / soft_cap))
            keys = ops.iota(s.shape, 1, interpret) + (step0 + j) * block_kv
            s = jnp.where((keys < seq_len) & (keys >= key_lo), s, -jnp.inf)
            acc, m_new, l, p16 = _online_softmax(s, acc, m, l, _LOG2E, q_smem.dtype)
            plgpu.barrier_wait(v_bar.at[slot])
            acc = ops.pv(acc, p16, v_smem.at[slot], lambda: None, interpret)
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        m = ops.layout(jnp.full((_ROWS,), _M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1), interpret)
        l = ops.layout(jnp.full((_ROWS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1), interpret)
        acc = ops.layout(jnp.full((_ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA, interpret)
        acc, m, l = lax.fori_loop(0, num_steps, step, (acc, m, l))
        # l >= 1 on every row with a key (its maximum contributes exp2(0)); a padding pair's l is 0
        out = acc / lax.broadcast_in_dim(jnp.maximum(l, 1.0), acc.shape, [0])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last item's store has read o_smem
        o_smem[...] = out.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows)], o_ref.at[pl.ds(pair * rows, rows)])
        return first_step + num_steps

    lax.fori_loop(0, work.num_iters, run_item, jnp.int32(0))
    plgpu.wait_smem_to_gmem(0)


def _memory_wg(work, meta_ref, layer_ref, tables_ref, kv_ref, k_smem, v_smem, bars, *, num_blocks, num_kv_heads):
    """Gathers every item's K/V steps (from its first in the window) into the C slots, P TMA copies a slot."""
    k_bar, v_bar, _, k_free, v_free = bars
    plgpu.set_max_registers(40, action="decrease")

    def run_item(k, first_step):
        pair, _, step0, num_steps = (meta_ref[work.item(k)[0], c] for c in range(4))
        k_row0 = layer_ref[0] * (2 * num_blocks * num_kv_heads) + lax.rem(pair, num_kv_heads)
        ops.gather_kv_steps(kv_ref, tables_ref, pair // num_kv_heads, first_step, num_steps, k_row0,
                            k_row0 + num_blocks * num_kv_heads, (k_smem, v_smem), (k_bar, v_bar, k_free, v_free),
                            num_kv_heads=num_kv_heads, table_step0=step0)
        return first_step + num_steps

    total = lax.fori_loop(0, work.num_iters, run_item, jnp.int32(0))
    ops.observe_last_frees(total, k_free, v_free, k_smem.shape[0])


def _kernel(meta_ref, layer_ref, tables_ref, q_ref, kv_ref, o_ref, q_smem, o_smem, k_smem, v_smem, *bars,
            num_ctas, num_blocks, num_kv_heads, scale, soft_cap, sliding_window, interpret):
    # meta_ref:   i32[R * K, 4]           per item, longest first: pair (r * K + h), seq_len, first key step,
    #                                     key steps
    # layer_ref:  i32[1]
    # tables_ref: i32[R, Mp]              Mp = M rounded up to P; padding is the null block 0
    # q_ref:      dtype[R * K * Gp, D]    pair p's G query heads at rows [p * Gp, p * Gp + G), then zeros
    # kv_ref:     dtype[L * 2 * B * K, S, D]  the pool with its leading axes flattened
    # o_ref:      dtype[R * K * Gp, D]    as q_ref (rows G..Gp-1 of a pair are not the caller's)
    # q_smem:     dtype[2, 64, D]         swizzled wgmma operands, rows [0, Gp) an item's q (two: prefetch)
    # o_smem:     dtype[64, D]            swizzled; rows [0, Gp) stored
    # k_smem, v_smem: dtype[C, BKV, D]    swizzled slots
    # bars:       k loaded, v loaded (P arrivals), q loaded [2], k free, v free
    work = _Work(meta_ref.shape[0], num_ctas, 1)
    wg = lax.axis_index("wg")
    pl.when(wg == 0)(functools.partial(
        _compute_wg, work, meta_ref, q_ref, o_ref, q_smem, o_smem, k_smem, v_smem, bars, scale=scale,
        soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret))
    pl.when(wg == 1)(functools.partial(
        _memory_wg, work, meta_ref, layer_ref, tables_ref, kv_ref, k_smem, v_smem, bars, num_blocks=num_blocks,
        num_kv_heads=num_kv_heads))


def _launch(meta, layer, tables, qp, kv_rows, *, num_ctas, num_blocks, num_kv_heads, block_kv, num_slots, scale,
            soft_cap, sliding_window, interpret, lowering_semantics):
    head_dim, dtype = qp.shape[-1], qp.dtype
    per_step = block_kv // kv_rows.shape[1]
    # 128-byte rows (64 2-byte columns) in 8-row tiles, swizzled: the layout wgmma reads.
    mma = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    scratch = [
        plgpu.SMEM((2, _ROWS, head_dim), dtype, **mma),                   # q tiles
        plgpu.SMEM((_ROWS, head_dim), dtype, **mma),                      # output tile
        plgpu.SMEM((num_slots, block_kv, head_dim), dtype, **mma),        # K slots
        plgpu.SMEM((num_slots, block_kv, head_dim), dtype, **mma),        # V slots
        plgpu.Barrier(num_arrivals=per_step, num_barriers=num_slots),     # K slot loaded (P copies)
        plgpu.Barrier(num_arrivals=per_step, num_barriers=num_slots),     # V slot loaded
        plgpu.Barrier(num_barriers=2),                                    # q tile loaded
        plgpu.Barrier(num_barriers=num_slots),                            # K slot free
        plgpu.Barrier(num_barriers=num_slots),                            # V slot free
    ]
    kernel = functools.partial(_kernel, num_ctas=num_ctas, num_blocks=num_blocks, num_kv_heads=num_kv_heads,
                               scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
                               interpret=interpret is not None)
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct(qp.shape, dtype), scratch_types=scratch, grid=(num_ctas,),
        grid_names=("ctas",), num_threads=2, thread_name="wg",
        compiler_params=ops.compiler_params(lowering_semantics), interpret=interpret,
    )(meta, layer, tables, qp, kv_rows)


def _item_table(seq_lens, num_kv_heads: int, block_kv: int, sliding_window: int | None):
    """i32[R * K, 4]: (pair, seq_len, first key step, key steps) of every (request, kv head) pair, longest first.

    # seq_lens [130, 0], K 1, BKV 64, window 100 -> keys [30, 130): steps 0..2 -> rows [0, 130, 0, 3], [1, 0, 0, 0]
    """
    lens = jnp.repeat(seq_lens, num_kv_heads)
    pairs = jnp.arange(lens.shape[0], dtype=jnp.int32)
    first = 0 if sliding_window is None else jnp.maximum(lens - sliding_window, 0) // block_kv
    steps = jnp.maximum(pl.cdiv(lens, block_kv) - first, 0)
    first = jnp.broadcast_to(first, lens.shape)
    table = jnp.stack([pairs, lens, first, steps], axis=1).astype(jnp.int32)
    return table[jnp.argsort(-steps, stable=True)]


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "max_concurrent_steps", "num_ctas",
                                             "sliding_window", "soft_cap", "interpret", "lowering_semantics"))
def paged_decode_attention_mgpu_wide(q, kv_cache, layer_idx, block_tables, seq_lens, *, scale: float,
                                     block_kv: int = 64, max_concurrent_steps: int = 2, num_ctas: int | None = None,
                                     sliding_window: int | None = None, soft_cap: float | None = None,
                                     interpret=None, lowering_semantics: str | None = None):
    """Same contract as paged_decode_attention_reference: q dtype[R, N, D] -> dtype[R, N, D], D 128 or 256, a
    cache of q's dtype (bf16/fp16), G = N // K <= 64, any soft cap and sliding window (mgpu_wide_decode_supported).

    block_kv: keys a pipeline step (64 or 128, a multiple of S); max_concurrent_steps: K/V slots (C >= 2);
    num_ctas: persistent CTAs (None: one per SM on the GPU, 3 in the interpreter); interpret: None (the CPU ->
    Mosaic GPU interpreter), a bool or an InterpretGPUParams; lowering_semantics: None, "lane" or "warpgroup".
    """
    validate_decode_inputs(q, kv_cache, layer_idx, block_tables, seq_lens)
    reason = mgpu_wide_decode_supported(q, kv_cache)
    if reason:
        raise ValueError(reason)
    num_reqs, num_heads, head_dim = q.shape
    num_layers, _, num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    if block_kv not in (64, 128) or block_kv % block_size or max_concurrent_steps < 2:
        raise ValueError(f"block_kv must be 64 or 128 and a multiple of the block size {block_size}, "
                         f"max_concurrent_steps >= 2; got {block_kv}, {max_concurrent_steps}")
    if smem_bytes(head_dim, block_kv, max_concurrent_steps) > _SMEM_BYTES:
        raise ValueError(f"{smem_bytes(head_dim, block_kv, max_concurrent_steps)} bytes of shared memory needed, "
                         f"{_SMEM_BYTES} available: lower block_kv or max_concurrent_steps")
    if not scale > 0 or (soft_cap is not None and not soft_cap > 0) or (sliding_window is not None
                                                                        and sliding_window < 1):
        raise ValueError(f"scale and soft_cap must be > 0 and sliding_window >= 1; got {scale}, {soft_cap}, "
                         f"{sliding_window}")
    group = num_heads // num_kv_heads
    rows = -(-group // 8) * 8                            # Gp
    pairs = num_reqs * num_kv_heads
    # [R, N, D] -> [R * K, G, D] (a kv head's query heads are adjacent) -> each pair's rows on the 8-row grid
    qp = jnp.pad(q.reshape(pairs, group, head_dim), ((0, 0), (0, rows - group), (0, 0))).reshape(-1, head_dim)
    per_step = block_kv // block_size
    max_blocks = block_tables.shape[1]
    tables = jnp.pad(block_tables, ((0, 0), (0, -(-max_blocks // per_step) * per_step - max_blocks)))
    kv_rows = kv_cache.reshape(num_layers * 2 * num_blocks * num_kv_heads, block_size, head_dim)
    interpret = ops.interpret_params(interpret)
    if num_ctas is None:
        num_ctas = _INTERPRET_CTAS if interpret is not None else device_num_sms()
    out = _launch(_item_table(seq_lens, num_kv_heads, block_kv, sliding_window),
                  jnp.asarray(layer_idx, jnp.int32).reshape(1), tables, qp, kv_rows,
                  num_ctas=min(num_ctas, pairs), num_blocks=num_blocks, num_kv_heads=num_kv_heads,
                  block_kv=block_kv, num_slots=max_concurrent_steps, scale=scale, soft_cap=soft_cap,
                  sliding_window=sliding_window, interpret=interpret, lowering_semantics=lowering_semantics)
    return out.reshape(pairs, rows, head_dim)[:, :group].reshape(num_reqs, num_heads, head_dim)
