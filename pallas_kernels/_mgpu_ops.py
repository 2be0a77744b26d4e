"""Small Mosaic GPU building blocks of the Mosaic kernels (ragged_paged_attention_mgpu.py and
paged_decode_attention_mgpu_wide.py), each with the plain path the Mosaic GPU interpreter (the CPU) runs instead
where it differs: wgmma matmuls, register layouts, jax 0.10/0.11 API differences, compiler and interpreter
parameters, and the memory warpgroup's K/V gather."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_JAX_VERSION = tuple(int(x) for x in jax.__version__.split(".")[:2])


def interpret_params(interpret):
    """None on the GPU; an InterpretGPUParams (Mosaic GPU interpreter on the CPU) otherwise."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if interpret is False:
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # same path in 0.10/0.11
    return InterpretGPUParams() if interpret is True else interpret


def compiler_params(lowering_semantics: str | None):
    # jax 0.10 defaults to Lane semantics, 0.11 to Warpgroup; None keeps each version's default (the one
    # its own attention_mgpu.py runs and is tested with).
    kw = {}
    if lowering_semantics is not None:
        kw["lowering_semantics"] = {"lane": plgpu.LoweringSemantics.Lane,
                                    "warpgroup": plgpu.LoweringSemantics.Warpgroup}[lowering_semantics]
    return plgpu.CompilerParams(approx_math=True, **kw)


def qk(q_smem, k_slot, sched, interpret):
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


def pv(acc, p16, v_slot, after_issue, interpret):
    """acc + p16 @ v_slot, f32[BQ, D]; after_issue runs while the wgmma is in flight."""
    if interpret:  # run_state is not interpreted either: same math as a plain f32-accumulated dot
        acc = acc + lax.dot(p16, v_slot[...], preferred_element_type=jnp.float32)
        after_issue()
        return acc

    def compute(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_slot)
        after_issue()
    return pl.run_state(compute)(plgpu.ACC.init(acc))


def smem_load(ref, layout):
    """The whole ref in registers: jax 0.10 wants plgpu.load's index positionally, 0.11 deprecates it."""
    if _JAX_VERSION < (0, 11):
        return plgpu.load(ref, (), layout=layout, optimized=False)
    return plgpu.load(ref, layout=layout, optimized=False)


def layout(x, layout, interpret):  # layout_cast has no CPU lowering: the interpreter skips it
    return x if interpret else plgpu.layout_cast(x, layout)


def iota(shape, dim, interpret):
    return layout(lax.broadcasted_iota(jnp.int32, shape, dim), plgpu.Layout.WGMMA, interpret)


def gather_kv_steps(kv_ref, tables_ref, req, first_step, num_steps, k_row0, v_row0, slots, bars, *, num_kv_heads,
                    table_step0=None):
    """The memory warpgroup's part of one item: its num_steps K/V steps into the slots, the CTA's steps first_step
    on, P = BKV // S TMA copies a slot from request req's block table, each slot refilled once its consumers
    freed it. kv_ref rows are (layer, K/V, block, kv head) flattened: block b's K row is k_row0 + b * K (V's
    v_row0 + ...). table_step0: the item's first key step in the table (None: its first)."""
    k_smem, v_smem = slots
    k_bar, v_bar, k_free, v_free = bars
    num_slots, block_kv = k_smem.shape[0], k_smem.shape[1]
    block_size = kv_ref.shape[1]
    per_step = block_kv // block_size

    @pl.loop(0, num_steps)
    def _(j):
        step = first_step + j
        slot = lax.rem(step, num_slots)
        key_step = j if table_step0 is None else table_step0 + j
        # Block ids are read before waiting for the slot, so their latency hides behind the wait.
        blocks = [tables_ref[req, key_step * per_step + i] for i in range(per_step)]
        for row0, dst, bar, free in ((k_row0, k_smem, k_bar, k_free), (v_row0, v_smem, v_bar, v_free)):
            pl.when(step >= num_slots)(functools.partial(plgpu.barrier_wait, free.at[slot]))
            for i, block in enumerate(blocks):
                plgpu.copy_gmem_to_smem(kv_ref.at[row0 + block * num_kv_heads],
                                        dst.at[slot, pl.ds(i * block_size, block_size)], bar.at[slot])


def observe_last_frees(total, k_free, v_free, num_slots: int):
    """The memory warpgroup's end: wait on the frees of the last slots it filled (total steps in all), so every
    waiter sees every barrier phase (the interpreter insists; free on the GPU)."""
    @pl.loop(jnp.maximum(total - num_slots, 0), total)
    def _(step):
        plgpu.barrier_wait(k_free.at[lax.rem(step, num_slots)])
        plgpu.barrier_wait(v_free.at[lax.rem(step, num_slots)])
