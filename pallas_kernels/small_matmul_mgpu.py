"""x @ w for a few rows of x (decode batches) on a persistent Mosaic GPU kernel (Hopper) that streams the
weight by TMA, with a plain-jnp reference.

Legend: M rows of x (tokens), Mp = M rounded up to 8 (at most 64), K input features, N output features,
BK x BN the weight tile of one pipeline step, NS splits of K, C pipeline slots.

Why: at decode sizes a linear layer reads its whole weight for a few rows of work, so its time is its bytes,
and a one-request step of llama3-8b is over 90% such reads. XLA's dot (cuBLAS) reads llama3-8b's four bf16
layers at 44-78% of the HBM's bandwidth at M = 1 (bench/bench_matmul.py), and a Triton-lowered Pallas GEMV
was no faster. What keeps a Hopper SM's share of the HBM busy is bytes in flight: this kernel keeps up to C
weight tiles of 32 KiB in flight per SM by TMA.

The product is computed transposed, out^T = w^T @ x^T, so that the weight is wgmma's A operand (its M is N,
in steps of 64) and x's Mp rows are its N (any multiple of 8): the tensor core does Mp, not 64, rows of work,
and a slot holds a [BK, BN] weight tile (A, transposed: N fastest, as stored) beside a [Mp, BK] x tile (B,
K fastest), so most of the shared memory goes to weight in flight.

Work: items (column tile n, split s), each BN columns by K / NS rows of the weight, all of one length;
persistent CTAs (one per SM) take items round-robin. One memory warpgroup streams every item's steps
through the C slots on one step count across items (no pipeline drain between items); one compute
warpgroup runs a wgmma per step. An item's f32[BN, Mp] partial sum leaves through an untiled buffer by TMA
into out f32[NS, N, Mp]; the caller's sum over splits, its transpose and its rounding to x's dtype are a
small XLA op that fuses into the consumer (one rounding of an f32 sum, what XLA's bf16 dot computes).
Shared memory at BK = BN = 128: C x (32 KiB of w + Mp x 256 bytes of x) + BN x Mp x 4 bytes of output; C
as many as fit (6 at Mp = 8, 4 at Mp = 64).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import _mgpu_ops as ops
from ._checks import is_hopper
from .paged_decode_attention import device_num_sms
from .ragged_paged_attention_mgpu import _SMEM_BYTES

# Rows of x the kernel takes: decode batches up to 64 requests. Past a few dozen rows a linear layer's time is
# no longer its bytes alone, and x's slots grow with its rows.
MAX_ROWS = 64
MAX_SLOTS = 8
_INTERPRET_CTAS = 3             # the interpreter's CTA count: several items a CTA
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def small_matmul_supported(x, w) -> str | None:
    """None when small_matmul_mgpu takes x @ w, else the reason: x dtype[M <= 64, K] and w of its dtype
    (bf16/fp16) [K, N], K and N multiples of 64, on Hopper (or the CPU's interpreter)."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        return f"x {x.shape} @ w {w.shape}: not a 2-d matmul"
    if jnp.dtype(x.dtype) not in _DTYPES or w.dtype != x.dtype:
        return f"the small Mosaic matmul takes bf16/fp16 x and w of one dtype; got {x.dtype}, {w.dtype}"
    if x.shape[0] > MAX_ROWS:
        return f"{x.shape[0]} rows: the small Mosaic matmul takes at most {MAX_ROWS}"
    k, n = w.shape
    if k % 64 or n % 64:
        return f"K {k} and N {n} must be multiples of 64"
    device = jax.devices()[0]
    if device.platform == "gpu" and not is_hopper(device):
        return f"the Mosaic GPU kernels need Hopper's wgmma (sm_90); this GPU is {device.device_kind}"
    return None


def smem_bytes(rows: int, block_k: int, block_n: int, num_slots: int, itemsize: int = 2) -> int:
    """C slots of x ([Mp, BK]) and w ([BK, BN]), and the f32 output tile [BN, Mp]."""
    return num_slots * (rows * block_k + block_k * block_n) * itemsize + block_n * rows * 4


def most_slots(rows: int, block_k: int, block_n: int) -> int:
    """The most pipeline slots (up to MAX_SLOTS) that fit in shared memory."""
    per_slot = smem_bytes(rows, block_k, block_n, 1) - smem_bytes(rows, block_k, block_n, 0)
    return min(MAX_SLOTS, (_SMEM_BYTES - smem_bytes(rows, block_k, block_n, 0)) // per_slot)


def choose_tiling(m: int, k: int, n: int, sms: int) -> tuple[int, int, int]:
    """(block_k, block_n, num_splits): 128-wide tiles where K and N allow (else 64), and the split of K that
    makes the busiest CTA's share of weight bytes smallest, counting the f32 partial sums' write and read.

    # llama3-8b at M = 1 on 132 SMs: qkv (4096 x 6144) 48 column tiles x 32 steps -> 8 splits (384 items, 3 a
    # CTA of 4 steps each: 12 steps against the even share's 11.6); gate_up (4096 x 28672) -> 4 splits
    """
    block_k = 128 if k % 128 == 0 else 64
    block_n = 128 if n % 128 == 0 else 64
    rows = _padded_rows(m)
    tiles, steps = n // block_n, k // block_k
    tile_bytes = block_k * block_n * 2

    def cost(splits):
        items = tiles * splits
        per_cta = -(-items // min(sms, items))
        return per_cta * (steps // splits) * tile_bytes * sms + 2 * splits * rows * n * 4

    splits = min((d for d in range(1, steps + 1) if steps % d == 0), key=lambda d: (cost(d), d))
    return block_k, block_n, splits


def _padded_rows(m: int) -> int:
    return max(8, -(-m // 8) * 8)


class _Items:
    """This CTA's items, round-robin over items split-major: item i is column tile i % NT, split i // NT (all of
    one length). So the CTAs of one round read the same rows of the weight side by side, whole rows of it
    where the round spans every column tile, rather than a few 256-byte pieces of many rows each."""

    def __init__(self, num_tiles, num_ctas, num_splits):
        self.cta, self.num_ctas, self.num_tiles = lax.axis_index("ctas"), num_ctas, num_tiles
        num_items = num_tiles * num_splits
        self.num_iters = num_items // num_ctas + (self.cta < num_items % num_ctas).astype(jnp.int32)

    def item(self, k):
        """-> (column tile, split) of this CTA's k-th item."""
        i = k * self.num_ctas + self.cta
        return lax.rem(i, self.num_tiles), i // self.num_tiles


def _mma(acc, x_ref, w_ref, interpret):
    """acc + (x @ w)^T = w^T @ x^T, f32[BN, Mp]: x [Mp, BK] and w [BK, BN] in shared memory, w^T wgmma's A
    operand (transposed: N fastest) and x^T its B (K fastest)."""
    if interpret:  # the interpreter has no wgmma: the same f32-accumulated product
        return acc + lax.dot_general(w_ref[...], x_ref[...], (((0,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)

    def compute(acc_ref):
        plgpu.wgmma(acc_ref, plgpu.transpose_ref(w_ref, (1, 0)), plgpu.transpose_ref(x_ref, (1, 0)))
    return pl.run_state(compute)(plgpu.ACC.init(acc))


def _compute_wg(items, o_ref, x_smem, w_smem, o_smem, bars, *, steps_per_item, interpret):
    """Each item: wgmma over its steps' slots, then its f32 sum out^T [BN, Mp] stored by TMA."""
    loaded, free = bars
    plgpu.set_max_registers(232, action="increase")
    block_n, rows = w_smem.shape[2], x_smem.shape[1]       # BN, Mp
    num_slots = w_smem.shape[0]

    def run_item(k, first_step):
        tile, split = items.item(k)

        def step(j, acc):
            slot = lax.rem(first_step + j, num_slots)
            plgpu.barrier_wait(loaded.at[slot])
            acc = _mma(acc, x_smem.at[slot], w_smem.at[slot], interpret)
            plgpu.barrier_arrive(free.at[slot])
            return acc

        acc = ops.layout(jnp.zeros((block_n, rows), jnp.float32), plgpu.Layout.WGMMA, interpret)
        acc = lax.fori_loop(0, steps_per_item, step, acc)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)    # the last item's store has read o_smem
        o_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[split, pl.ds(tile * block_n, block_n)])
        return first_step + steps_per_item

    lax.fori_loop(0, items.num_iters, run_item, jnp.int32(0))
    plgpu.wait_smem_to_gmem(0)


def _memory_wg(items, x_ref, w_ref, x_smem, w_smem, bars, *, steps_per_item):
    """Every item's steps into the C slots, x's rows and the weight tile a slot, each slot refilled once the
    compute warpgroup freed it."""
    loaded, free = bars
    plgpu.set_max_registers(40, action="decrease")
    num_slots, block_k, block_n = w_smem.shape

    def run_item(k, first_step):
        tile, split = items.item(k)

        @pl.loop(0, steps_per_item)
        def _(j):
            step = first_step + j
            slot = lax.rem(step, num_slots)
            k0 = (split * steps_per_item + j) * block_k
            pl.when(step >= num_slots)(functools.partial(plgpu.barrier_wait, free.at[slot]))
            plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(k0, block_k)], x_smem.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(k0, block_k), pl.ds(tile * block_n, block_n)], w_smem.at[slot],
                                    loaded.at[slot])
        return first_step + steps_per_item

    total = lax.fori_loop(0, items.num_iters, run_item, jnp.int32(0))

    @pl.loop(jnp.maximum(total - num_slots, 0), total)     # every waiter sees every phase (the interpreter)
    def _(step):
        plgpu.barrier_wait(free.at[lax.rem(step, num_slots)])


def _kernel(x_ref, w_ref, o_ref, x_smem, w_smem, o_smem, *bars, num_ctas, num_splits, steps_per_item, interpret):
    # x_ref: dtype[Mp, K]; w_ref: dtype[K, N]; o_ref: f32[NS, N, Mp] (out^T's partial sums)
    # x_smem: dtype[C, Mp, BK] and w_smem: dtype[C, BK, BN], swizzled wgmma operands; o_smem: f32[BN, Mp] untiled
    # bars: slot loaded (two TMA copies), slot free
    items = _Items(w_ref.shape[1] // w_smem.shape[2], num_ctas, num_splits)
    wg = lax.axis_index("wg")
    pl.when(wg == 0)(functools.partial(_compute_wg, items, o_ref, x_smem, w_smem, o_smem, bars,
                                       steps_per_item=steps_per_item, interpret=interpret))
    pl.when(wg == 1)(functools.partial(_memory_wg, items, x_ref, w_ref, x_smem, w_smem, bars,
                                       steps_per_item=steps_per_item))


@functools.partial(jax.jit, static_argnames=("block_k", "block_n", "num_splits", "max_concurrent_steps", "num_ctas",
                                             "interpret", "lowering_semantics"))
def small_matmul_mgpu(x, w, *, block_k: int | None = None, block_n: int | None = None, num_splits: int | None = None,
                      max_concurrent_steps: int | None = None, num_ctas: int | None = None, interpret=None,
                      lowering_semantics: str | None = None):
    """x dtype[M, K] @ w dtype[K, N] -> dtype[M, N] (small_matmul_supported: M <= 64, bf16/fp16), summed in f32
    and rounded once.

    block_k, block_n, num_splits: None takes choose_tiling's; max_concurrent_steps: pipeline slots (C >= 2; None:
    most_slots'); num_ctas: persistent CTAs (None: one per SM on the GPU, 3 in the interpreter; the tiling is
    sized by it); interpret: None (the CPU -> Mosaic GPU interpreter), a bool or an InterpretGPUParams;
    lowering_semantics: None, "lane" or "warpgroup".
    """
    reason = small_matmul_supported(x, w)
    if reason:
        raise ValueError(reason)
    m, k = x.shape
    n = w.shape[1]
    interpret = ops.interpret_params(interpret)
    if num_ctas is None:
        num_ctas = _INTERPRET_CTAS if interpret is not None else device_num_sms()
    bk, bn, ns = choose_tiling(m, k, n, num_ctas)
    block_k, block_n, num_splits = block_k or bk, block_n or bn, num_splits or ns
    rows = _padded_rows(m)
    slots = max_concurrent_steps or most_slots(rows, block_k, block_n)
    if (block_k not in (64, 128) or block_n not in (64, 128, 256) or k % block_k or n % block_n
            or (k // block_k) % num_splits or slots < 2):
        raise ValueError(f"K {k} / N {n} do not divide into tiles {block_k} x {block_n} (64/128 x 64/128/256) and "
                         f"{num_splits} splits, or max_concurrent_steps {slots} < 2")
    if smem_bytes(rows, block_k, block_n, slots) > _SMEM_BYTES:
        raise ValueError(f"{smem_bytes(rows, block_k, block_n, slots)} bytes of shared memory needed, "
                         f"{_SMEM_BYTES} available: lower block_k, block_n or max_concurrent_steps")
    xp = jnp.pad(x, ((0, rows - m), (0, 0)))
    num_items = n // block_n * num_splits
    # 128-byte rows (64 2-byte columns) in 8-row tiles, swizzled: the layout wgmma reads.
    mma = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch: list[Any] = [
        plgpu.SMEM((slots, rows, block_k), x.dtype, transforms=mma),      # x slots (wgmma's B, transposed)
        plgpu.SMEM((slots, block_k, block_n), x.dtype, transforms=mma),   # w slots (its A, transposed)
        plgpu.SMEM((block_n, rows), jnp.float32),                         # output tile out^T, untiled
        plgpu.Barrier(num_arrivals=2, num_barriers=slots),                # slot loaded (x and w)
        plgpu.Barrier(num_barriers=slots),                                # slot free
    ]
    ctas = min(num_ctas, num_items)
    kernel = functools.partial(_kernel, num_ctas=ctas, num_splits=num_splits,
                               steps_per_item=k // block_k // num_splits, interpret=interpret is not None)
    out = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((num_splits, n, rows), jnp.float32), scratch_types=scratch,
        grid=(ctas,), grid_names=("ctas",), num_threads=2, thread_name="wg",
        compiler_params=ops.compiler_params(lowering_semantics), interpret=interpret,
    )(xp, w)
    return jnp.sum(out, axis=0).T[:m].astype(x.dtype)


def small_matmul_reference(x, w):
    """x @ w summed in f32, rounded once to x's dtype."""
    return lax.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


__all__ = ["MAX_ROWS", "MAX_SLOTS", "choose_tiling", "most_slots", "small_matmul_mgpu", "small_matmul_reference",
           "small_matmul_supported", "smem_bytes"]
