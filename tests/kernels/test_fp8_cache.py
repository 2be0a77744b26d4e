"""An e4m3 KV pool (--kv-cache-dtype fp8, held as bytes: FP8_CACHE_DTYPE): the decode and ragged Triton
kernels (interpret mode on the CPU, compiled on the GPU) and the XLA path read it as their references do,
and the KV write saturates into it (kernel_cases.py says how the platform switch works); the CPU's bf16 pool,
held as its values' bits, likewise."""
from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import (INTERPRET, LAYER, SMALL_LAYOUTS, TOL, DecodeBatch, decode_inputs, mixed_batch,
                          ragged_inputs, reference, rel_err)
from jaxpaged import pallas_kernels as pk
from jaxpaged.pallas_kernels._checks import CPU_BF16_CACHE_DTYPE, FP8_CACHE_DTYPE, from_cache, to_cache
from jaxpaged.pallas_kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_reference
from jaxpaged.pallas_kernels.ragged_paged_attention import (ragged_paged_attention_reference,
                                                            ragged_paged_attention_xla)
from jaxpaged.pallas_kernels.ragged_paged_attention_pallas import ragged_paged_attention_pallas

LAYOUTS = [SMALL_LAYOUTS[1], SMALL_LAYOUTS[2]]          # bf16 and f32 queries over the e4m3 pool


def fp8_pool(pool):
    """A pool of the layout's dtype -> the same values rounded into e4m3 bytes."""
    return to_cache(pool, FP8_CACHE_DTYPE)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.id)
def test_decode_kernel_reads_an_fp8_pool(layout):
    x = decode_inputs(np.random.default_rng(0), layout, DecodeBatch("mixed", 10, (1, 19, 16, 0, 139)))
    pool = fp8_pool(x.kv_cache)
    assert pool.dtype == FP8_CACHE_DTYPE
    args = (x.q, pool, LAYER, x.block_tables, x.seq_lens)
    ref = reference(paged_decode_attention_reference, *args, scale=0.125)
    for splits in (1, 3):
        out = paged_decode_attention(*args, scale=0.125, num_splits=splits, blocks_per_iter=2, interpret=INTERPRET)
        assert out.dtype == x.q.dtype and rel_err(out, ref) <= TOL[layout.dtype]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.id)
def test_ragged_kernel_and_xla_path_read_an_fp8_pool(layout):
    x = ragged_inputs(np.random.default_rng(1), layout, mixed_batch(layout.block_size))
    args = (x.q, fp8_pool(x.kv_cache), LAYER, x.block_tables, x.seq_lens, x.query_start_loc)
    ref = reference(ragged_paged_attention_reference, *args, scale=0.125)
    out = ragged_paged_attention_pallas(*args, scale=0.125, interpret=INTERPRET)
    assert rel_err(out, ref) <= TOL[layout.dtype]
    assert rel_err(reference(ragged_paged_attention_xla, *args, scale=0.125), ref) <= TOL[layout.dtype]


def test_the_reference_reads_e4m3_values():
    """from_cache reinterprets the bytes: the reference on an e4m3 pool equals it on the rounded values."""
    layout = LAYOUTS[1]
    x = decode_inputs(np.random.default_rng(2), layout, DecodeBatch("3", 4, (5, 17, 30)))
    pool = fp8_pool(x.kv_cache)
    rounded = x.kv_cache.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(from_cache(pool, jnp.float32)), np.asarray(rounded))
    a = paged_decode_attention_reference(x.q, pool, LAYER, x.block_tables, x.seq_lens, scale=0.125)
    b = paged_decode_attention_reference(x.q, rounded, LAYER, x.block_tables, x.seq_lens, scale=0.125)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_write_kv_saturates_into_e4m3_and_scales(backend):
    """Values beyond e4m3's 448 saturate (no NaN); kv_scales divide k and v before they are stored."""
    pool = jnp.zeros((2, 2, 4, 2, 8, 64), FP8_CACHE_DTYPE)
    k = jnp.full((3, 2, 64), 1000.0).at[1].set(-3.0).at[2].set(0.3)
    v = jnp.full((3, 2, 64), 2.0)
    slots = jnp.asarray([9, 10, 17], jnp.int32)                          # block 1 slots 1-2, block 2 slot 1
    scales = (jnp.float32(2.0), jnp.float32(0.5))
    out = pk.write_kv(pool, 1, k, v, slots, backend=backend, interpret=INTERPRET, kv_scales=scales)
    stored = np.asarray(from_cache(out, jnp.float32))
    np.testing.assert_array_equal(stored[1, 0, 1, :, 1], 448.0)          # 1000 / 2 saturates
    np.testing.assert_array_equal(stored[1, 0, 1, :, 2], -1.5)
    np.testing.assert_array_equal(stored[1, 0, 2, :, 1], np.float32(jnp.float8_e4m3fn(0.15)))
    np.testing.assert_array_equal(stored[1, 1, 1, :, 1], 4.0)            # 2 / 0.5
    assert np.isfinite(stored).all() and not stored[0].any()


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_write_kv_divides_by_the_float32_scale_once(backend):
    """k / k_scale and v / v_scale in float32, by the float32 scales attention multiplies back by, rounded once, to
    e4m3. (Dividing a bf16 k by the scale rounded to bf16 stores k / 0.30078 for a scale of 0.3, rounded twice:
    other e4m3 values on some of these elements.)"""
    rng = np.random.default_rng(0)
    pool = jnp.zeros((1, 2, 4, 2, 8, 64), FP8_CACHE_DTYPE)
    k, v = (jnp.asarray(rng.standard_normal((32, 2, 64)) * 4, jnp.bfloat16) for _ in range(2))
    scales = (jnp.float32(0.3), jnp.float32(0.7))
    out = pk.write_kv(pool, 0, k, v, jnp.arange(32, dtype=jnp.int32), backend=backend, interpret=INTERPRET,
                      kv_scales=scales)
    stored = np.asarray(from_cache(out, jnp.float32))[0]                # [2, B, K, S, D]; slot = block * 8 + s
    for i, (x, scale) in enumerate(zip((k, v), scales)):
        want = np.asarray((x.astype(jnp.float32) / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32))
        twice = np.asarray((x / scale.astype(jnp.bfloat16)).astype(jnp.float8_e4m3fn).astype(jnp.float32))
        assert (want != twice).any()                                     # the case tells the two apart
        np.testing.assert_array_equal(stored[i].transpose(0, 2, 1, 3).reshape(32, 2, 64), want)


def test_a_cpu_bf16_pool_holds_the_values_bits():
    """On the CPU a bf16 pool is its values' bits (uint16): the write stores them exactly and every path reads
    the same attention as from the bf16 pool, bit for bit."""
    from jaxpaged.models import kv_cache_dtype
    cfg = types.SimpleNamespace(kv_cache_dtype="auto")                 # all kv_cache_dtype reads of the config
    assert kv_cache_dtype(cfg, jnp.bfloat16, "cpu") == CPU_BF16_CACHE_DTYPE
    assert kv_cache_dtype(cfg, jnp.bfloat16, "gpu") == jnp.bfloat16
    assert kv_cache_dtype(cfg, jnp.float32, "cpu") == jnp.float32
    layout = SMALL_LAYOUTS[1]                                            # bf16
    x = ragged_inputs(np.random.default_rng(3), layout, mixed_batch(layout.block_size))
    bits = to_cache(x.kv_cache, CPU_BF16_CACHE_DTYPE)
    assert bits.dtype == CPU_BF16_CACHE_DTYPE
    np.testing.assert_array_equal(np.asarray(from_cache(bits, jnp.float32)), np.asarray(x.kv_cache, np.float32))
    args = (x.q, bits, LAYER, x.block_tables, x.seq_lens, x.query_start_loc)
    for op in (ragged_paged_attention_xla, ragged_paged_attention_reference):
        np.testing.assert_array_equal(np.asarray(op(*args, scale=0.125)),
                                      np.asarray(op(x.q, x.kv_cache, *args[2:], scale=0.125)))
    k = jnp.asarray(np.random.default_rng(4).normal(size=(3, layout.num_kv_heads, layout.head_dim)), jnp.bfloat16)
    slots = jnp.asarray([9, 10, 17], jnp.int32)
    for backend in ("xla", "pallas") if INTERPRET else ("xla",):      # (such pools exist on the CPU only)
        out = pk.write_kv(bits, LAYER, k, -k, slots, backend=backend, interpret=INTERPRET)
        ref = pk.write_kv(x.kv_cache, LAYER, k, -k, slots, backend=backend, interpret=INTERPRET)
        assert out.dtype == CPU_BF16_CACHE_DTYPE
        np.testing.assert_array_equal(np.asarray(from_cache(out, jnp.float32)), np.asarray(ref, np.float32))


def test_an_fp8_pool_stays_out_of_tritons_32bit_window(monkeypatch):
    """JAX's Triton lowering gives an operand of at most 2**32 bytes 32-bit offsets: a 1-byte pool of 2-4 GiB has
    elements they cannot reach (its last blocks read back NaN on the H100). The Triton ops refuse such a pool
    (checked while tracing: nothing is allocated), and the engine sizes e4m3 pools outside the window."""
    import jax

    from jaxpaged import pallas_kernels as pk
    from jaxpaged.engine import cache_sizing
    block = 2 * 8 * 16 * 128                                          # one layer of llama3-8b's block, in bytes
    inside = 2**31 // block + 1
    assert pk.in_triton_32bit_window(inside * block, 1) and not pk.in_triton_32bit_window(inside * block, 2)
    assert not pk.in_triton_32bit_window(2**31, 1) and not pk.in_triton_32bit_window(2**32 + block, 1)
    assert pk.pool_blocks_outside_window(inside, block, 1) == 2**31 // block
    assert pk.pool_blocks_outside_window(inside, block, 2) == inside
    sds = jax.ShapeDtypeStruct
    q = sds((4, 32, 128), jnp.bfloat16)
    for blocks, ok in ((inside, False), (2**31 // block, True), (2**32 // block + 1, True)):
        pool = sds((1, 2, blocks, 8, 16, 128), FP8_CACHE_DTYPE)
        calls = [lambda q, p: paged_decode_attention(q, p, 0, jnp.zeros((4, 8), jnp.int32), jnp.ones((4,), jnp.int32),
                                                     scale=0.1, interpret=True),
                 lambda q, p: ragged_paged_attention_pallas(q, p, 0, jnp.zeros((4, 8), jnp.int32),
                                                            jnp.ones((4,), jnp.int32), jnp.arange(5, dtype=jnp.int32),
                                                            scale=0.1, interpret=True)]
        for call in calls:
            if ok:
                jax.eval_shape(call, q, pool)
            else:
                with pytest.raises(ValueError, match="32-bit offsets"):
                    jax.eval_shape(call, q, pool)
    # the engine's sizing: a 3 GiB e4m3 budget becomes 2 GiB; bf16's is kept; an override inside is refused. The
    # budget is JAXPAGED_CPU_KV_CACHE_MIB's on any platform: a device without memory statistics (on a GPU the
    # device's free memory would set it)
    monkeypatch.setattr(cache_sizing.envs, "JAXPAGED_CPU_KV_CACHE_MIB", 3 << 10)
    monkeypatch.setattr(cache_sizing.jax, "devices", lambda: [object()])
    assert cache_sizing.size_kv_cache(block, 0, 0, 0.9, None, itemsize=1).num_blocks * block <= 2**31
    assert cache_sizing.size_kv_cache(2 * block, 0, 0, 0.9, None, itemsize=2).num_blocks * 2 * block > 2**31
    with pytest.raises(ValueError, match="num_gpu_blocks_override"):
        cache_sizing.size_kv_cache(block, 0, 0, 0.9, inside, itemsize=1)
