"""The Mosaic GPU (Hopper) ragged paged attention kernel, run by JAX's Mosaic GPU interpreter on the CPU.

The interpreter simulates the three warpgroups as threads, TMA copies, barriers (strictly: every waiter
must observe every phase) and SMEM; it leaves out tiling/swizzling and wgmma (the kernel's matmuls take
a jnp path there), which the GPU run has to cover. Output buffers start as NaN (uninitialized_memory=
"nan"), so any element the kernel fails to write shows up.
"""
import os
import subprocess
import sys

# Each simulated warpgroup blocks an XLA CPU worker thread while it waits on a barrier: with the
# default pool (one thread per core) a 2-core machine deadlocks. The pool size is read once, when the
# CPU backend starts.
_NPROC_PRESET = "PJRT_NPROC" in os.environ or "NPROC" in os.environ
os.environ.setdefault("PJRT_NPROC", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax._src import xla_bridge  # noqa: E402

try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # pragma: no cover - jax without the Mosaic GPU interpreter
    InterpretGPUParams = None

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference  # noqa: E402
from pallas_kernels._mgpu_schedule import tile_schedule  # noqa: E402
from pallas_kernels.ragged_paged_attention_mgpu import mgpu_supported, ragged_paged_attention_mgpu  # noqa: E402
from pallas_kernels.paged_decode_attention import paged_decode_attention_reference  # noqa: E402
from pallas_kernels.paged_decode_attention_mgpu import paged_decode_attention_mgpu  # noqa: E402

pytestmark = pytest.mark.skipif(InterpretGPUParams is None, reason="jax has no Mosaic GPU interpreter")
# Started before this module could raise the pool size (another test module ran first) on a small box.
_POOL_TOO_SMALL = (xla_bridge.backends_are_initialized() and not _NPROC_PRESET
                   and (os.cpu_count() or 1) < 4)
needs_pool = pytest.mark.skipif(_POOL_TOO_SMALL, reason="XLA CPU pool too small here; "
                                "test_in_fresh_process runs these in a new process")


@pytest.fixture(scope="module", autouse=True)
def _interpreter_compile_cache():
    """jax 0.10's interpreter recompiles every thread's jaxpr at every grid point (a closure defeats
    jit's caches; jax 0.11 fixed it with a top-level function). Apply the same fix: ~8x faster."""
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


def _batch(q_lens, ctx_lens, *, num_heads, num_kv_heads, head_dim, dtype, pad_tokens, seed,
           block_size=16, num_layers=2):
    """Random q / pool / tables for requests with q_lens new tokens after ctx_lens cached ones."""
    rng = np.random.default_rng(seed)
    seq_lens = np.asarray(q_lens) + np.asarray(ctx_lens)
    max_blocks = -(-int(seq_lens.max()) // block_size) + 2           # + padding columns
    num_blocks = sum(-(-int(s) // block_size) for s in seq_lens) + 5
    tables = np.zeros((len(q_lens), max_blocks), np.int32)            # padding -> null block 0
    free = rng.permutation(np.arange(1, num_blocks))
    for r, s in enumerate(seq_lens):
        n = -(-int(s) // block_size)
        tables[r, :n], free = free[:n], free[n:]
    num_tokens = sum(q_lens) + pad_tokens
    q = rng.standard_normal((num_tokens, num_heads, head_dim))
    kv = rng.standard_normal((num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim))
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return (jnp.asarray(q, dtype), jnp.asarray(kv, dtype), jnp.int32(1), jnp.asarray(tables),
            jnp.asarray(seq_lens, jnp.int32), jnp.asarray(qsl))


# 37: not a multiple of BQ; 64: exactly BQ, mid-sequence; 1: a decode; 150: > 2 BQ (last CTA shifted
# back); 5: a short chunk mid-sequence. 7 bucket-padding tokens at the end.
_Q_LENS, _CTX_LENS = [37, 64, 1, 150, 5], [0, 19, 50, 21, 9]


@needs_pool
@pytest.mark.parametrize("head_dim,num_kv_heads,group,dtype,block_kv,block_size", [
    (64, 2, 1, jnp.bfloat16, 64, 16),
    (64, 1, 2, jnp.bfloat16, 64, 8),
    (128, 1, 4, jnp.float16, 128, 16),
    (128, 1, 7, jnp.bfloat16, 128, 16),
    (128, 1, 8, jnp.bfloat16, 128, 32),
])
def test_matches_reference(head_dim, num_kv_heads, group, dtype, block_kv, block_size):
    args = _batch(_Q_LENS, _CTX_LENS, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                  head_dim=head_dim, dtype=dtype, pad_tokens=7, seed=head_dim + group,
                  block_size=block_size)
    scale = head_dim ** -0.5
    # uninitialized_memory="nan": the output starts poisoned, so an unwritten element cannot pass.
    out = ragged_paged_attention_mgpu(*args, scale=scale, block_kv=block_kv,
                                      interpret=InterpretGPUParams(uninitialized_memory="nan"))
    ref = ragged_paged_attention_reference(*args, scale=scale)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape and np.isfinite(out).all()
    real = int(sum(_Q_LENS))
    assert (out[real:] == 0).all()                                   # bucket padding rows
    rel = np.abs(out - ref).max() / np.abs(ref).max()
    assert rel <= (1e-2 if dtype == jnp.bfloat16 else 3e-3), rel


@needs_pool
def test_short_requests_only_and_tiny_batch():
    """Only sub-tile requests (every CTA takes the clamped, partial-store path), T < BQ."""
    args = _batch([3, 1, 2], [30, 0, 17], num_heads=2, num_kv_heads=1, head_dim=64,
                  dtype=jnp.bfloat16, pad_tokens=2, seed=3)
    out = ragged_paged_attention_mgpu(*args, scale=0.125, block_kv=64,
                                      interpret=InterpretGPUParams(uninitialized_memory="nan"))
    ref = ragged_paged_attention_reference(*args, scale=0.125)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all() and (out[6:] == 0).all()
    assert np.abs(out - ref).max() / np.abs(ref).max() <= 1e-2


@pytest.mark.parametrize("pad", [0, 3, 200])
def test_tile_schedule_covers_every_row_once_per_owner(pad):
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


def test_rejects_unsupported():
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
        ragged_paged_attention_mgpu(q.astype(jnp.float32), kv.astype(jnp.float32), *args[2:],
                                    scale=0.125)


@pytest.mark.skipif(not _POOL_TOO_SMALL, reason="only needed when the XLA CPU pool started too small")
def test_in_fresh_process():
    env = dict(os.environ, PJRT_NPROC="8")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         env=env, capture_output=True, text=True, timeout=900,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]


@needs_pool
@pytest.mark.parametrize("num_ctas", [1, 3])
def test_no_races_with_slot_reuse(num_ctas):
    """Long context (5 K/V steps through 2 slots), items of several tiles and heads per persistent CTA
    (one CTA: every item, so slots, q and output buffers are reused across all of them), a zero tile:
    the interpreter's race detector sees no SMEM race."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as mgpu_interpret
    args = _batch([70, 2, 130], [250, 100, 3], num_heads=2, num_kv_heads=1, head_dim=64,
                  dtype=jnp.bfloat16, pad_tokens=5, seed=5 + num_ctas)
    out = ragged_paged_attention_mgpu(*args, scale=0.125, block_kv=64, max_concurrent_steps=2,
                                      num_ctas=num_ctas,
                                      interpret=InterpretGPUParams(detect_races=True,
                                                                   uninitialized_memory="nan"))
    ref = ragged_paged_attention_reference(*args, scale=0.125)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert not mgpu_interpret.get_races().races_found
    assert np.isfinite(out).all() and (out[202:] == 0).all()
    assert np.abs(out - ref).max() / np.abs(ref).max() <= 1e-2


@needs_pool
@pytest.mark.parametrize("head_dim,group,block_kv,num_ctas", [(64, 7, 64, 3), (128, 4, 128, 2)])
def test_decode_packed_heads_match_reference(head_dim, group, block_kv, num_ctas):
    """paged_decode_attention_mgpu: the G heads of a kv head as one tile (not causal). Contexts of 1
    (fewer keys than heads), 17, a whole 64-key step, 150 (three steps of 64 through two slots) and a
    padding request (seq_len 0: zeros); two kv heads; output poisoned with NaN first, races detected."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as mgpu_interpret
    q_lens, ctx = [1] * 5, [0, 16, 63, 149, 0]
    q, kv, layer, tables, seq_lens, _ = _batch(q_lens, ctx, num_heads=2 * group, num_kv_heads=2,
                                               head_dim=head_dim, dtype=jnp.bfloat16, pad_tokens=0,
                                               seed=head_dim + group)
    seq_lens = seq_lens.at[4].set(0)
    scale = head_dim ** -0.5
    out = paged_decode_attention_mgpu(q, kv, layer, tables, seq_lens, scale=scale, block_kv=block_kv,
                                      num_ctas=num_ctas,
                                      interpret=InterpretGPUParams(detect_races=True,
                                                                   uninitialized_memory="nan"))
    ref = paged_decode_attention_reference(q, kv, layer, tables, seq_lens, scale=scale)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert not mgpu_interpret.get_races().races_found
    assert out.shape == ref.shape and np.isfinite(out).all() and (out[4] == 0).all()
    assert np.abs(out - ref).max() / np.abs(ref).max() <= 1e-2


def test_decode_packed_heads_lower_for_cuda():
    """The packed decode call (llama3-8b's heads) lowers to a Mosaic GPU module for CUDA."""
    sds = jax.ShapeDtypeStruct
    args = (sds((64, 32, 128), jnp.bfloat16), sds((2, 2, 100, 8, 16, 128), jnp.bfloat16),
            sds((), jnp.int32), sds((64, 32), jnp.int32), sds((64,), jnp.int32))
    lowered = jax.jit(lambda *a: paged_decode_attention_mgpu(*a, scale=0.1, interpret=False)).trace(
        *args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("semantics", ["lane", "warpgroup"])
def test_gpu_path_lowers_for_cuda(semantics):
    """The real (wgmma, swizzled SMEM, TMA) path lowers to a Mosaic GPU module without a GPU: catches
    layout-inference and TMA-tiling errors the interpreter cannot see (e.g. unaligned tiled TMA)."""
    sds = jax.ShapeDtypeStruct
    args = (sds((300, 8, 128), jnp.bfloat16), sds((2, 2, 100, 2, 16, 128), jnp.bfloat16),
            sds((), jnp.int32), sds((4, 32), jnp.int32), sds((4,), jnp.int32), sds((5,), jnp.int32))
    lowered = ragged_paged_attention_mgpu.trace(*args, scale=0.1, interpret=False,
                                                lowering_semantics=semantics).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
