"""Small Mosaic GPU building blocks of ragged_paged_attention_mgpu.py, each with the plain path the
Mosaic GPU interpreter (the CPU) runs instead: wgmma matmuls, register layouts, jax 0.10/0.11 API
differences, compiler and interpreter parameters."""
from __future__ import annotations

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
