"""The Mosaic GPU (Hopper) kernels against their references: ragged paged attention, and the decode that
packs a kv head's query heads into one tile of it.

On the CPU JAX's Mosaic GPU interpreter runs them: it simulates the three warpgroups as threads, TMA
copies, barriers (strictly: every waiter must observe every phase) and SMEM, with output buffers poisoned
with NaN (uninitialized_memory="nan": an element the kernel fails to write shows up) and, where a case
asks, its race detector on. It leaves out tiling/swizzling and wgmma (the kernel's matmuls take a jnp path
there): the GPU run covers those, and the CUDA lowering tests below catch layout and TMA errors without a
GPU. On a Hopper GPU the compiled kernels run the same cases, plus the real sizes; other GPUs skip them.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import (INTERPRET, POOL_TOO_SMALL, REAL_DECODE, REAL_LAYOUTS, REAL_RAGGED, Case, DecodeBatch, Layout,
                          RaggedBatch, case_id, chunked_reference, decode_inputs, gpu_only, max_rel_err,
                          ragged_inputs, reference)
from jaxpaged.pallas_kernels._checks import FP8_CACHE_DTYPE, to_cache
from jaxpaged.pallas_kernels._mgpu_schedule import tile_schedule
from jaxpaged.pallas_kernels.paged_decode_attention import paged_decode_attention_reference
from jaxpaged.pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

try:
    from jaxpaged.pallas_kernels.paged_decode_attention_mgpu import (mgpu_decode_supported, mixed_attention_mgpu,
                                                                     paged_decode_attention_mgpu)
    from jaxpaged.pallas_kernels.paged_decode_attention_mgpu_wide import (mgpu_wide_decode_supported,
                                                                          paged_decode_attention_mgpu_wide)
    from jaxpaged.pallas_kernels.ragged_paged_attention_mgpu import mgpu_supported, ragged_paged_attention_mgpu
    _NO_MGPU = None
except ImportError as e:  # pragma: no cover - a jax without Pallas's Mosaic GPU module
    _NO_MGPU = f"no Mosaic GPU Pallas here: {e}"
try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # pragma: no cover - jax without the Mosaic GPU interpreter
    InterpretGPUParams = None

pytestmark = [pytest.mark.skipif(_NO_MGPU is not None, reason=_NO_MGPU or ""), pytest.mark.cost(140)]


def _unsupported_here() -> str | None:
    """Why the Mosaic GPU kernel cannot take a plain bf16 call on this GPU (not Hopper, a bad ptxas)."""
    if INTERPRET or _NO_MGPU:
        return None
    sds = jax.ShapeDtypeStruct
    return mgpu_supported(sds((8, 4, 64), jnp.bfloat16), sds((1, 2, 4, 2, 16, 64), jnp.bfloat16), 16)


def _cannot_run() -> str | None:
    if not INTERPRET:
        return _unsupported_here()
    if InterpretGPUParams is None:
        return "jax has no Mosaic GPU interpreter"
    if POOL_TOO_SMALL:
        return "XLA CPU pool too small here; test_in_fresh_process runs these in a new process"
    return None


on_hopper = pytest.mark.skipif(_unsupported_here() is not None, reason=str(_unsupported_here()))
runs_kernel = pytest.mark.skipif(_cannot_run() is not None, reason=str(_cannot_run()))
TOL = {"bfloat16": 1e-2, "float16": 3e-3}          # max |out - ref| / max |ref|


def interpret_arg(detect_races: bool):
    """The kernels' interpret argument: on the CPU the interpreter, outputs poisoned with NaN and the race
    detector on where asked; on the GPU False (compiled)."""
    if not INTERPRET:
        return False
    return InterpretGPUParams(detect_races=detect_races, uninitialized_memory="nan")


def races_found() -> bool:
    """The interpreter's race detector's verdict on the last run (compiled kernels have none)."""
    if not INTERPRET:
        return False
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    return interpret_pallas_call.get_races().races_found


@pytest.fixture(scope="module", autouse=True)
def _interpreter_compile_cache():
    """jax 0.10's interpreter recompiles every thread's jaxpr at every grid point (a closure defeats
    jit's caches; jax 0.11 fixed it with a top-level function). Apply the same fix: ~8x faster."""
    if not INTERPRET:
        yield
        return
    from jax._src import core as jax_core
    from jax._src.pallas.mosaic.interpret import thread_map
    if hasattr(thread_map, "_run"):                  # already fixed upstream
        yield
        return

    def _run_jaxpr(jaxpr, consts, *args):
        jax.jit(_eval_jaxpr, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()(
            consts, *args)

    def _eval_jaxpr(jaxpr, consts, *args):
        jax_core.eval_jaxpr(jaxpr, consts, *args)

    mp = pytest.MonkeyPatch()
    mp.setattr(thread_map, "_run_jaxpr", _run_jaxpr)
    yield
    mp.undo()


@pytest.fixture(scope="module", autouse=True)
def _callbacks_take_numpy():
    """The interpreter runs each load, store, copy and barrier of a kernel as an io_callback. jax's io_callback
    puts the operands XLA hands it (NumPy arrays) on the CPU device as jax Arrays before it calls the callback,
    and the interpreter's callbacks turn them straight back into Python ints and NumPy arrays: a third of an
    interpreted kernel's time. Hand the callbacks copies of XLA's NumPy arrays instead: the same values and
    dtypes, each call's own buffers as before, so the callbacks (and the race detector's bookkeeping) compute the
    same; the kernels' outputs are bit for bit those of jax's own path."""
    from jax._src import callback as jax_callback
    if not INTERPRET or not hasattr(jax_callback, "io_callback_impl"):
        yield
        return
    from jax._src import config, tree_util
    from jax._src import xla_bridge as xb

    def io_callback_impl(*args, result_avals, callback, sharding, ordered):
        del result_avals, sharding, ordered
        cpu_device, *_ = xb.local_devices(backend="cpu")
        with config.default_device(cpu_device):
            return tree_util.tree_map(np.asarray, callback(*(np.array(a) for a in args)))

    mp = pytest.MonkeyPatch()
    mp.setattr(jax_callback, "io_callback_impl", io_callback_impl)
    yield
    mp.undo()


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicCase(Case):
    block_kv: int = 128                 # keys per pipeline step
    max_concurrent_steps: int = 2       # K/V slots in flight
    num_ctas: int | None = None         # persistent CTAs; None: the kernel's (3 interpreted, one per SM)
    detect_races: bool = False          # the interpreter's race detector (the CPU only)
    chunked_reference: bool = False     # real sizes: the XLA path in f32 (kernel_cases.chunked_reference)
    fp8: bool = False                   # the pool rounded into e4m3 bytes (--kv-cache-dtype fp8)
    alibi: bool = False                 # ALiBi slopes (ALiBi's geometric series over the query heads)
    split_keys: bool = False            # decode: the two compute warpgroups share each pair's key steps

    @property
    def id(self) -> str:
        ctas = f"-ctas{self.num_ctas}" if self.num_ctas else ""
        return (f"{super().id}-kv{self.block_kv}x{self.max_concurrent_steps}{ctas}" + ("-fp8" if self.fp8 else "")
                + ("-alibi" if self.alibi else "") + ("-split" if self.split_keys else ""))

    @property
    def slopes(self):
        """{} or {"alibi_slopes": f32[N]}: the keyword both the kernel and its reference take."""
        n = self.layout.num_heads
        return {"alibi_slopes": 2.0 ** (-8.0 * jnp.arange(1, n + 1, dtype=jnp.float32) / n)} if self.alibi else {}

    def pool(self, kv_cache):
        """The case's pool: as made, or its values rounded into e4m3 bytes."""
        return to_cache(kv_cache, FP8_CACHE_DTYPE) if self.fp8 else kv_cache


# 37: not a multiple of BQ; 64: exactly BQ, mid-sequence; 1: a decode; 150: > 2 BQ (last CTA shifted
# back); 5: a short chunk mid-sequence. 7 bucket-padding tokens at the end.
_MIXED = RaggedBatch("mixed", (37, 64, 1, 150, 5), (0, 19, 50, 21, 9), 7)
# (head dim, kv heads, group, dtype, block_kv, block size)
RAGGED_CASES = [MosaicCase(layout=Layout(block_size, head_dim, kv * group, kv, dtype), batch=_MIXED, block_kv=block_kv)
                for head_dim, kv, group, dtype, block_kv, block_size in [
                    (64, 2, 1, "bfloat16", 64, 16), (64, 1, 2, "bfloat16", 64, 8), (128, 1, 4, "float16", 128, 16),
                    (128, 1, 7, "bfloat16", 128, 16), (128, 1, 8, "bfloat16", 128, 32)]]
# Only sub-tile requests (every CTA takes the clamped, partial-store path), T < BQ.
RAGGED_CASES += [MosaicCase(layout=Layout(16, 64, 2, 1, "bfloat16"),
                            batch=RaggedBatch("short-only", (3, 1, 2), (30, 0, 17), 2), block_kv=64)]
# Long context (5 K/V steps through 2 slots), items of several tiles and heads per persistent CTA (one CTA:
# every item, so slots, q and output buffers are reused across all of them), a zero tile: the
# interpreter's race detector sees no SMEM race.
RAGGED_CASES += [MosaicCase(layout=Layout(16, 64, 2, 1, "bfloat16"),
                            batch=RaggedBatch("long-context", (70, 2, 130), (250, 100, 3), 5), block_kv=64,
                            num_ctas=num_ctas, detect_races=True) for num_ctas in (1, 3)]
# An e4m3 pool: every slot widened to float16 by each compute warpgroup before its wgmma (a bf16 q computed in
# float16); long contexts through two slots, several items per CTA, the race detector on (head size 64's
# 64-byte swizzle: the decode cases below).
RAGGED_CASES += [MosaicCase(layout=Layout(16, 128, 4, 2, "bfloat16"), batch=_MIXED, block_kv=64, num_ctas=2,
                            detect_races=True, fp8=True)]
# ALiBi: multi-head (Baichuan's layout) and grouped, the bias on every key step, masked or not.
RAGGED_CASES += [MosaicCase(layout=Layout(16, 64, 2 * group, 2, "bfloat16"), batch=_MIXED, block_kv=64, num_ctas=2,
                            alibi=True) for group in (1, 2)]
# Real sizes: the kernel's defaults (one CTA per SM).
RAGGED_CASES += gpu_only(MosaicCase(layout=layout, batch=REAL_RAGGED, chunked_reference=True)
                         for layout in REAL_LAYOUTS)

# Contexts of 1 (fewer keys than heads), 17, a whole 64-key step, 150 (three steps of 64 through two
# slots) and a padding request (seq_len 0: zeros, though its table holds real blocks); two kv heads.
_DECODES = DecodeBatch("5reqs", 12, (1, 17, 64, 150, 0), full_tables=True)
DECODE_CASES = [MosaicCase(layout=Layout(16, head_dim, 2 * group, 2, "bfloat16"), batch=_DECODES, block_kv=block_kv,
                           num_ctas=num_ctas, detect_races=True)
                for head_dim, group, block_kv, num_ctas in [(64, 7, 64, 3), (128, 4, 128, 2)]]
DECODE_CASES += [MosaicCase(layout=Layout(16, head_dim, 2 * group, 2, "bfloat16"), batch=_DECODES, block_kv=block_kv,
                            num_ctas=2, detect_races=True, fp8=True)
                 for head_dim, group, block_kv in [(64, 7, 64), (128, 4, 128)]]
# ALiBi decodes: one query head per kv head (the packed tile's one row takes its pair's slope).
DECODE_CASES += [MosaicCase(layout=Layout(16, 128, 3, 3, "bfloat16"), batch=_DECODES, block_kv=64, num_ctas=2,
                            alibi=True)]
# split_keys: odd and even step counts (1-4 steps of 64 keys), a padding request, several items a CTA (the
# exchange's barriers across items), bf16 and e4m3 pools, ALiBi.
_SPLIT_DECODES = DecodeBatch("7reqs", 13, (1, 17, 64, 150, 0, 128, 200), full_tables=True)
_SPLIT_LAYOUTS = [(128, 2, 4, {}), (64, 2, 7, dict(fp8=True)), (128, 2, 4, dict(fp8=True)),
                  (128, 3, 1, dict(alibi=True))]
DECODE_CASES += [MosaicCase(layout=Layout(16, head_dim, kv * group, kv, "bfloat16"), batch=_SPLIT_DECODES, block_kv=64,
                            num_ctas=2, detect_races=True, split_keys=True, **kw)
                 for head_dim, kv, group, kw in _SPLIT_LAYOUTS]
DECODE_CASES += gpu_only(MosaicCase(layout=layout, batch=REAL_DECODE, fp8=fp8) for layout in REAL_LAYOUTS
                         for fp8 in (False, True))
DECODE_CASES += gpu_only(MosaicCase(layout=layout, batch=REAL_DECODE, fp8=True, block_kv=64, split_keys=True)
                         for layout in REAL_LAYOUTS)
DECODE_CASES += gpu_only([MosaicCase(layout=Layout(16, 128, 40, 40, "bfloat16", "baichuan2-13b"), batch=REAL_DECODE,
                                     alibi=True)])


def _check(out, ref, case, padding_rows):
    assert out.dtype == case.layout.dtype                             # an e4m3 pool's float16 math returns q's dtype
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert not (case.detect_races and races_found())
    assert out.shape == ref.shape and np.isfinite(out).all()
    assert (out[padding_rows] == 0).all()                             # bucket padding / seq_len 0
    assert max_rel_err(out, ref) <= TOL[case.layout.dtype]


class TestRaggedPrefillMosaic:
    @runs_kernel
    @pytest.mark.parametrize("case", RAGGED_CASES, ids=case_id)
    def test_matches_reference(self, case):
        x = ragged_inputs(case.rng(), case.layout, case.batch)
        x = x._replace(kv_cache=case.pool(x.kv_cache))
        scale = case.layout.head_dim ** -0.5
        out = ragged_paged_attention_mgpu(*x.args, scale=scale, block_kv=case.block_kv,
                                          max_concurrent_steps=case.max_concurrent_steps, num_ctas=case.num_ctas,
                                          interpret=interpret_arg(case.detect_races), **case.slopes)
        ref_fn = chunked_reference if case.chunked_reference else ragged_paged_attention_reference
        _check(out, reference(ref_fn, *x.args, scale=scale, **case.slopes), case, slice(x.num_real_tokens, None))

    @on_hopper
    def test_rejects_unsupported(self):
        q = jnp.zeros((8, 4, 64), jnp.bfloat16)
        kv = jnp.zeros((1, 2, 4, 2, 16, 64), jnp.bfloat16)
        args = (q, kv, 0, jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32),
                jnp.array([0, 1], jnp.int32))
        assert mgpu_supported(q, kv, 16) is None
        assert "sliding" in mgpu_supported(q, kv, 16, sliding_window=8)
        assert "head dim" in mgpu_supported(jnp.zeros((8, 4, 256), jnp.bfloat16),
                                            jnp.zeros((1, 2, 4, 2, 16, 256), jnp.bfloat16), 16)
        assert "bf16" in mgpu_supported(q.astype(jnp.float32), kv.astype(jnp.float32), 16)
        for kw in (dict(sliding_window=4), dict(soft_cap=30.0), dict(block_kv=96), dict(block_q=32),
                   dict(max_concurrent_steps=1), dict(block_kv=128, max_concurrent_steps=8)):
            with pytest.raises(ValueError):
                ragged_paged_attention_mgpu(*args, scale=0.125, **kw)
        with pytest.raises(ValueError):
            ragged_paged_attention_mgpu(q.astype(jnp.float32), kv.astype(jnp.float32), *args[2:], scale=0.125)

    @on_hopper
    @pytest.mark.parametrize("semantics", ["lane", "warpgroup"])
    @pytest.mark.parametrize("cache", ["bfloat16", "fp8"])
    def test_lowers_for_cuda(self, semantics, cache):
        """The real (wgmma, swizzled SMEM, TMA) path lowers to a Mosaic GPU module without a GPU: catches
        layout-inference and TMA-tiling errors the interpreter cannot see (e.g. unaligned tiled TMA), and
        over an e4m3 pool the widening's 8-bit loads, conversions and relayout."""
        sds = jax.ShapeDtypeStruct
        cache_dtype = FP8_CACHE_DTYPE if cache == "fp8" else jnp.bfloat16
        args = (sds((300, 8, 128), jnp.bfloat16), sds((2, 2, 100, 2, 16, 128), cache_dtype),
                sds((), jnp.int32), sds((4, 32), jnp.int32), sds((4,), jnp.int32), sds((5,), jnp.int32))
        lowered = ragged_paged_attention_mgpu.trace(*args, scale=0.1, interpret=False,
                                                    lowering_semantics=semantics).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()


def _packed_decode_lowers(semantics, pairs, group, **kw):
    """The ragged kernel on a packed decode (pairs (request, kv head) pairs of group rows, not causal) lowers for
    CUDA over a bf16 and an e4m3 pool, with kw (ALiBi, split_keys)."""
    sds = jax.ShapeDtypeStruct
    for cache_dtype in (jnp.bfloat16, FP8_CACHE_DTYPE):
        args = (sds((pairs * group, 1, 128), jnp.bfloat16), sds((2, 2, 4000, 1, 16, 128), cache_dtype),
                sds((), jnp.int32), sds((pairs, 32), jnp.int32), sds((pairs,), jnp.int32),
                sds((pairs + 1,), jnp.int32))
        traced = ragged_paged_attention_mgpu.trace(*args, scale=0.1, causal=False, interpret=False,
                                                   lowering_semantics=semantics, **kw)
        lowered = traced.lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()


class TestPagedDecodeMosaic:
    @runs_kernel
    @pytest.mark.parametrize("case", DECODE_CASES, ids=case_id)
    def test_matches_reference(self, case):
        """paged_decode_attention_mgpu: the G heads of a kv head as one tile (not causal)."""
        x = decode_inputs(case.rng(), case.layout, case.batch)
        x = x._replace(kv_cache=case.pool(x.kv_cache))
        scale = case.layout.head_dim ** -0.5
        out = paged_decode_attention_mgpu(*x.args, scale=scale, block_kv=case.block_kv,
                                          max_concurrent_steps=case.max_concurrent_steps, num_ctas=case.num_ctas,
                                          split_keys=case.split_keys, interpret=interpret_arg(case.detect_races),
                                          **case.slopes)
        ref = reference(paged_decode_attention_reference, *x.args, scale=scale, **case.slopes)
        _check(out, ref, case, np.asarray(x.seq_lens) == 0)

    @on_hopper
    @pytest.mark.parametrize("semantics", ["lane", "warpgroup"])
    def test_alibi_lowers_for_cuda(self, semantics):
        """ALiBi's per-item slope (a scalar load) and its bias on every key step lower for CUDA, over both pools,
        packed as a multi-head decode's pairs (one row a tile, one slope a pair)."""
        _packed_decode_lowers(semantics, 64 * 40, 1, alibi_slopes=jax.ShapeDtypeStruct((64 * 40, 1), jnp.float32))

    @on_hopper
    @pytest.mark.parametrize("semantics", ["lane", "warpgroup"])
    def test_split_keys_lowers_for_cuda(self, semantics):
        """split_keys: each warpgroup's own code, the exchange's [BQ, 8] broadcasts and f32 tile through SMEM."""
        _packed_decode_lowers(semantics, 64 * 8, 4, block_kv=64, split_keys=True)

    def test_alibi_needs_one_query_head_per_kv_head(self):
        q, kv = jnp.zeros((4, 8, 128), jnp.bfloat16), jnp.zeros((1, 2, 4, 2, 16, 128), jnp.bfloat16)
        assert "ALiBi" in mgpu_decode_supported(q, kv, alibi=True)
        assert "ALiBi" not in (mgpu_decode_supported(q[:, :2], kv, alibi=True) or "")

    @on_hopper
    @pytest.mark.parametrize("cache", ["bfloat16", "fp8"])
    @pytest.mark.parametrize("head_dim", [64, 128])
    def test_lowers_for_cuda(self, cache, head_dim):
        """The packed decode call (llama3-8b's heads; qwen2-0.5b's head size) lowers to a Mosaic GPU module for
        CUDA, over a bf16 or an e4m3 pool."""
        sds = jax.ShapeDtypeStruct
        cache_dtype = FP8_CACHE_DTYPE if cache == "fp8" else jnp.bfloat16
        args = (sds((64, 32, head_dim), jnp.bfloat16), sds((2, 2, 100, 8, 16, head_dim), cache_dtype),
                sds((), jnp.int32), sds((64, 32), jnp.int32), sds((64,), jnp.int32))
        lowered = jax.jit(lambda *a: paged_decode_attention_mgpu(*a, scale=0.1, interpret=False)).trace(
            *args).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()


# The wide-head decode kernel: Gemma's head size 256 with a soft cap low enough to bend the scores and a window
# that cuts inside a key step (150 - 100 = 50 keys masked of step 0, steps of 64); head size 128 with 4 query
# heads a kv head (8-row pair tiles) and 9 (16-row tiles, 128-key steps over blocks of 32), windows on and off;
# blocks of 8 (8 copies a slot) and 64 (one copy of a 128-key step's two); the contexts and padding request of
# the decodes above, several items a CTA, the race detector on.
WIDE_DECODE_CASES = [MosaicCase(layout=Layout(block_size, head_dim, kv * group, kv, "bfloat16"),
                                batch=_DECODES if block_size > 8 else dataclasses.replace(_DECODES, max_blocks=24),
                                block_kv=block_kv, num_ctas=2, detect_races=True, **kw)
                     for block_size, head_dim, kv, group, block_kv, kw in [
                         (16, 256, 2, 2, 64, dict(soft_cap=2.0, sliding_window=100)),
                         (16, 128, 2, 4, 64, {}), (32, 128, 1, 9, 128, dict(sliding_window=33)),
                         (8, 256, 1, 2, 64, dict(soft_cap=3.0)), (64, 128, 2, 1, 128, dict(sliding_window=70))]]
# Real sizes: gemma-2-9b's heads, its soft cap of 50, and a window inside the 4k contexts.
WIDE_DECODE_CASES += gpu_only(MosaicCase(layout=Layout(16, 256, 16, 8, "bfloat16", "gemma-2-9b"), batch=REAL_DECODE,
                                         block_kv=64, soft_cap=50.0, sliding_window=window) for window in (None, 1000))


class TestPagedDecodeMosaicWide:
    @runs_kernel
    @pytest.mark.parametrize("case", WIDE_DECODE_CASES, ids=case_id)
    def test_matches_reference(self, case):
        """paged_decode_attention_mgpu_wide: one compute warpgroup, a pair's rows on the 8-row grid."""
        x = decode_inputs(case.rng(), case.layout, case.batch)
        scale = case.layout.head_dim ** -0.5
        opts = dict(soft_cap=case.soft_cap, sliding_window=case.sliding_window)
        out = paged_decode_attention_mgpu_wide(*x.args, scale=scale, block_kv=case.block_kv,
                                               max_concurrent_steps=case.max_concurrent_steps, num_ctas=case.num_ctas,
                                               interpret=interpret_arg(case.detect_races), **opts)
        _check(out, reference(paged_decode_attention_reference, *x.args, scale=scale, **opts), case,
               np.asarray(x.seq_lens) == 0)

    @on_hopper
    def test_declines_what_it_does_not_take(self):
        q, kv = jnp.zeros((4, 16, 256), jnp.bfloat16), jnp.zeros((1, 2, 4, 8, 16, 256), jnp.bfloat16)
        assert mgpu_wide_decode_supported(q, kv) is None
        assert "head dims" in mgpu_wide_decode_supported(q[..., :64], kv[..., :64])
        assert "dtype" in mgpu_wide_decode_supported(q, kv.astype(jnp.uint8))
        assert "group" in mgpu_wide_decode_supported(jnp.zeros((4, 65, 128), jnp.bfloat16),
                                                     jnp.zeros((1, 2, 4, 1, 16, 128), jnp.bfloat16))
        args = (q, kv, 0, jnp.zeros((4, 2), jnp.int32), jnp.ones((4,), jnp.int32))
        for kw in (dict(block_kv=32), dict(max_concurrent_steps=1), dict(max_concurrent_steps=3),
                   dict(soft_cap=0.0), dict(sliding_window=0)):
            with pytest.raises(ValueError):
                paged_decode_attention_mgpu_wide(*args, scale=0.0625, **kw)

    @on_hopper
    @pytest.mark.parametrize("semantics", ["lane", "warpgroup"])
    @pytest.mark.parametrize("head_dim", [128, 256])
    def test_lowers_for_cuda(self, semantics, head_dim):
        """gemma-2-9b's decode (16 heads over 8 kv heads, its soft cap and window) lowers to a Mosaic GPU module
        for CUDA: the TMA loads of a pair's rows into the swizzled q tile and its output rows out of one."""
        sds = jax.ShapeDtypeStruct
        args = (sds((64, 16, head_dim), jnp.bfloat16), sds((2, 2, 100, 8, 16, head_dim), jnp.bfloat16),
                sds((), jnp.int32), sds((64, 32), jnp.int32), sds((64,), jnp.int32))
        lowered = jax.jit(lambda *a: paged_decode_attention_mgpu_wide(
            *a, scale=0.0625, soft_cap=50.0, sliding_window=4096, interpret=False, lowering_semantics=semantics)
        ).trace(*args).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()


# A mixed step's batch: decodes (one query token) beside prompt chunks, as the scheduler orders them (running
# requests first) and out of that order, and a one-token chunk mid-prompt (the decode kernel's computation too).
_DECODES_AND_CHUNKS = RaggedBatch("decodes+chunks", (1, 1, 37, 1, 150, 5, 1), (40, 130, 0, 3, 21, 9, 70), 7)
MIXED_CASES = [MosaicCase(layout=Layout(16, head_dim, kv * group, kv, "bfloat16"), batch=_DECODES_AND_CHUNKS,
                          block_kv=block_kv, num_ctas=2, **kw)
               for head_dim, kv, group, block_kv, kw in [(64, 2, 7, 64, {}), (128, 2, 4, 128, {}),
                                                         (64, 3, 1, 64, dict(alibi=True))]]
# Fewer rows than a q tile (T < BQ: the ragged kernel's clamped loads), and no one-token request at all (the decode
# kernel's pairs all empty, nothing scattered).
MIXED_CASES += [MosaicCase(layout=Layout(16, 64, 4, 2, "bfloat16"), batch=batch, block_kv=64, num_ctas=2)
                for batch in (RaggedBatch("short+decodes", (3, 1, 2, 1), (30, 40, 17, 0), 2),
                              RaggedBatch("no-decodes", (37, 64, 150), (0, 19, 21), 7))]
MIXED_CASES += gpu_only(MosaicCase(layout=layout, batch=REAL_RAGGED, chunked_reference=True) for layout in REAL_LAYOUTS)


class TestMixedMosaic:
    @runs_kernel
    @pytest.mark.parametrize("case", MIXED_CASES, ids=case_id)
    def test_matches_reference(self, case):
        """mixed_attention_mgpu: one-token requests through the packed decode kernel, the rest through the ragged
        kernel, which leaves their rows unwritten (the interpreter poisons them with NaN): every row as the
        reference's."""
        x = ragged_inputs(case.rng(), case.layout, case.batch)
        scale = case.layout.head_dim ** -0.5
        out = mixed_attention_mgpu(*x.args, scale=scale, num_ctas=case.num_ctas,
                                   interpret=interpret_arg(case.detect_races), **case.slopes)
        ref_fn = chunked_reference if case.chunked_reference else ragged_paged_attention_reference
        _check(out, reference(ref_fn, *x.args, scale=scale, **case.slopes), case, slice(x.num_real_tokens, None))


class TestTileSchedule:
    def test_skip_single_gives_one_token_requests_no_tile(self):
        """skip_single: the tiles of the other requests as without it; one-token requests none."""
        q_lens = np.array([1, 37, 1, 150, 0, 1, 5])
        qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
        seq_lens = jnp.asarray(q_lens + 11, jnp.int32)
        full, live_full, _ = tile_schedule(qsl, seq_lens, 200, 200, 64, 64)
        skip, live_skip, _ = tile_schedule(qsl, seq_lens, 200, 200, 64, 64, skip_single=True)
        full, skip = np.asarray(full)[:int(live_full)], np.asarray(skip)[:int(live_skip)]
        assert sorted(full[:, 0].tolist()) == [-1, 0, 1, 2, 3, 3, 5, 6]       # -1: the zero tile over rows [195, 200)
        assert sorted(skip[:, 0].tolist()) == [-1, 1, 3, 3, 6]
        assert sorted(map(tuple, full[~np.isin(full[:, 0], [0, 2, 5])].tolist())) == sorted(map(tuple, skip.tolist()))

    @pytest.mark.parametrize("pad", [0, 3, 200])
    def test_covers_every_row_once_per_owner(self, pad):
        """Every token is written by some warpgroup tile, and only by tiles of its own request; the bucket
        padding only by zero tiles; live tiles come first, those with K/V steps longest first."""
        q_lens = np.array([37, 64, 1, 150, 5, 128, 0, 129])
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        num_rows = int(qsl[-1]) + pad
        seq_lens = q_lens + 11
        sched, live, num_tiles = tile_schedule(jnp.asarray(qsl), jnp.asarray(seq_lens, jnp.int32), num_rows,
                                               num_rows, 64, 64)
        sched, live = np.asarray(sched), int(live)
        owner = np.searchsorted(qsl[1:], np.arange(num_rows), side="right")
        written, zeroed = np.zeros(num_rows, int), np.zeros(num_rows, int)
        steps_col = sched[:, 1]
        assert (steps_col[:live][steps_col[:live] > 0] == np.sort(steps_col[steps_col > 0])[::-1]).all()
        assert (steps_col[live:] == 0).all() and (sched[live:, 4] == 0).all() and (sched[live:, 8] == 0).all()
        for t, (req, steps, *wgs) in enumerate(sched[:live]):
            if req < 0:                                                  # a zero tile
                assert steps == 0 and wgs[2] > 0
                for load, lo, rows, _ in (wgs[:4], wgs[4:]):
                    assert lo == 0 and load >= qsl[-1] and load + rows <= num_rows
                    zeroed[load:load + rows] += 1
                continue
            for load, lo, rows, pos in (wgs[:4], wgs[4:]):
                assert 0 <= load <= num_rows - 64 and 0 <= lo and lo + rows <= 64
                toks = np.arange(load + lo, load + lo + rows)
                assert (owner[toks] == req).all()
                # position of the first written row: context + offset inside the request's chunk
                if rows:
                    assert pos == seq_lens[req] - q_lens[req] + (load + lo - qsl[req])
                    assert steps * 64 >= pos + rows
                written[toks] += 1
        assert (written[:qsl[-1]] >= 1).all() and (written[qsl[-1]:] == 0).all()
        assert (zeroed[:qsl[-1]] == 0).all() and (zeroed[qsl[-1]:] == 1).all()
        assert num_tiles == sched.shape[0]


@pytest.mark.skipif(not POOL_TOO_SMALL, reason="only needed when the XLA CPU pool started too small")
def test_in_fresh_process():
    env = dict(os.environ, PJRT_NPROC="8")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         env=env, capture_output=True, text=True, timeout=900,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
