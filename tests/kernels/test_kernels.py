"""Pallas kernels vs their plain-jnp references, in interpret mode on the CPU.

Fresh random inputs every run (never zeros). Interpret mode fills every kernel output with NaN before
the kernel runs (jax.experimental.pallas poisons uninitialised outputs), so an element a kernel forgets
to write shows up as NaN: each check asserts every element finite and close to the reference.
Shapes are small: interpret mode runs the grid one program at a time.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import pallas_kernels as pk
from jaxpaged.pallas_kernels.paged_decode_attention import (paged_decode_attention,
                                                            paged_decode_attention_reference)
from jaxpaged.pallas_kernels.ragged_paged_attention_pallas import ragged_paged_attention_pallas

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def make_pool(rng, num_layers, num_blocks, num_kv_heads, block_size, head_dim, dtype):
    x = rng.standard_normal((num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim))
    return jnp.asarray(x, dtype)


def make_tables(rng, num_reqs, max_blocks, num_blocks, seq_lens, block_size):
    """Distinct random blocks for each request's used blocks; the unused tail points at the null block."""
    ids = rng.permutation(np.arange(1, num_blocks))[: num_reqs * max_blocks].reshape(num_reqs, max_blocks)
    used = np.arange(max_blocks)[None, :] < -(-np.asarray(seq_lens)[:, None] // block_size)
    return jnp.asarray(np.where(used, ids, 0), jnp.int32)


# (block size, head dim, query heads, kv heads, dtype): block sizes 8/16/32, head dims 64/128,
# GQA ratios 1/2/4/7/8, both dtypes
CASES = [
    (8, 64, 4, 4, jnp.float32),
    (16, 128, 8, 4, jnp.bfloat16),
    (32, 64, 8, 2, jnp.float32),
    (16, 64, 14, 2, jnp.bfloat16),
    (8, 128, 16, 2, jnp.float32),
    (16, 64, 7, 1, jnp.float32),
]


@pytest.mark.parametrize("block_size,head_dim,num_heads,num_kv_heads,dtype", CASES)
def test_decode_matches_reference(block_size, head_dim, num_heads, num_kv_heads, dtype):
    rng = np.random.default_rng()
    # lengths: 1, not a multiple of the block size, a full block, 0 (padding request), long
    seq_lens = np.array([1, block_size + 3, block_size, 0, 9 * block_size - 5])
    num_reqs, max_blocks = len(seq_lens), 10
    num_blocks = num_reqs * max_blocks + 1
    pool = make_pool(rng, 2, num_blocks, num_kv_heads, block_size, head_dim, dtype)
    tables = make_tables(rng, num_reqs, max_blocks, num_blocks, seq_lens, block_size)
    q = jnp.asarray(rng.standard_normal((num_reqs, num_heads, head_dim)), dtype)
    lens = jnp.asarray(seq_lens, jnp.int32)
    scale = head_dim ** -0.5
    ref = paged_decode_attention_reference(q, pool, 1, tables, lens, scale=scale)
    for num_splits in (1, 3):   # direct output, and split-K with the merge epilogue
        out = paged_decode_attention(q, pool, jnp.int32(1), tables, lens, scale=scale,
                                     num_splits=num_splits, blocks_per_iter=2)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert bool(jnp.all(jnp.isfinite(out)))
        assert rel_err(out, ref) <= TOL[dtype]
        assert bool(jnp.all(out[3] == 0))                       # seq_len 0 -> zeros


@pytest.mark.parametrize("sliding_window,soft_cap", [(20, None), (None, 5.0), (37, 3.0)])
def test_decode_window_and_soft_cap(sliding_window, soft_cap):
    rng = np.random.default_rng()
    block_size, head_dim, num_heads, num_kv_heads = 16, 64, 8, 2
    seq_lens = np.array([150, 7, 64])
    pool = make_pool(rng, 1, 40, num_kv_heads, block_size, head_dim, jnp.float32)
    tables = make_tables(rng, 3, 12, 40, seq_lens, block_size)
    q = jnp.asarray(rng.standard_normal((3, num_heads, head_dim)), jnp.float32)
    lens = jnp.asarray(seq_lens, jnp.int32)
    ref = paged_decode_attention_reference(q, pool, 0, tables, lens, scale=0.125,
                                           sliding_window=sliding_window, soft_cap=soft_cap)
    for num_splits in (1, 4):   # 4 splits of 3 blocks: the window starts mid-split
        out = paged_decode_attention(q, pool, 0, tables, lens, scale=0.125, num_splits=num_splits,
                                     blocks_per_iter=2, sliding_window=sliding_window, soft_cap=soft_cap)
        assert rel_err(out, ref) <= 1e-5


def ragged_batch(rng, block_size, num_heads, num_kv_heads, head_dim, dtype, *, pad_tokens=5):
    """A decode, a prefill from position 0, a chunk starting mid-sequence (not block aligned), a padding
    request (q_len 0, seq_len 0), a chunk ending exactly on a block, and bucket-padding tokens."""
    q_lens = np.array([1, 2 * block_size + 3, 11, 0, block_size])
    ctx = np.array([3 * block_size + 2, 0, block_size + 5, 0, 2 * block_size])   # tokens before the chunk
    seq_lens = q_lens + ctx
    num_reqs, max_blocks = len(q_lens), 6
    num_blocks = num_reqs * max_blocks + 1
    pool = make_pool(rng, 2, num_blocks, num_kv_heads, block_size, head_dim, dtype)
    tables = make_tables(rng, num_reqs, max_blocks, num_blocks, seq_lens, block_size)
    num_tokens = int(q_lens.sum()) + pad_tokens
    q = jnp.asarray(rng.standard_normal((num_tokens, num_heads, head_dim)), dtype)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    return q, pool, tables, jnp.asarray(seq_lens, jnp.int32), qsl, int(q_lens.sum())


@pytest.mark.parametrize("block_size,head_dim,num_heads,num_kv_heads,dtype", CASES)
def test_ragged_matches_reference(block_size, head_dim, num_heads, num_kv_heads, dtype):
    rng = np.random.default_rng()
    q, pool, tables, lens, qsl, num_real = ragged_batch(rng, block_size, num_heads, num_kv_heads,
                                                        head_dim, dtype)
    scale = head_dim ** -0.5
    ref = pk.ragged_paged_attention_reference(q, pool, 1, tables, lens, qsl, scale=scale)
    # small tiles: several tiles per request, tiles with a partial tail, several key iterations
    out = ragged_paged_attention_pallas(q, pool, jnp.int32(1), tables, lens, qsl, scale=scale,
                                       block_m=16 if num_heads // num_kv_heads <= 8 else 32, block_k=16)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert bool(jnp.all(jnp.isfinite(out)))
    assert rel_err(out, ref) <= TOL[dtype]
    assert bool(jnp.all(out[num_real:] == 0))                   # bucket padding -> zeros


@pytest.mark.parametrize("sliding_window,soft_cap", [(9, None), (None, 4.0), (20, 2.0)])
def test_ragged_window_and_soft_cap(sliding_window, soft_cap):
    rng = np.random.default_rng()
    q, pool, tables, lens, qsl, _ = ragged_batch(rng, 8, 8, 2, 64, jnp.float32)
    ref = pk.ragged_paged_attention_reference(q, pool, 1, tables, lens, qsl, scale=0.125,
                                              sliding_window=sliding_window, soft_cap=soft_cap)
    out = ragged_paged_attention_pallas(q, pool, 1, tables, lens, qsl, scale=0.125, block_m=16,
                                       block_k=16, sliding_window=sliding_window, soft_cap=soft_cap)
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_kv_matches_reference(dtype):
    rng = np.random.default_rng()
    block_size, num_kv_heads, head_dim = 8, 2, 64
    pool = make_pool(rng, 3, 12, num_kv_heads, block_size, head_dim, dtype)   # the poison: random
    num_tokens = 20
    k = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, head_dim)), dtype)
    slots = rng.permutation(np.arange(block_size, 12 * block_size))[:num_tokens]
    slots[-3:] = [0, 0, 1]                                      # padding tokens -> the null block
    slots = jnp.asarray(slots, jnp.int32)
    out = pk.write_kv_pallas(pool, jnp.int32(2), k, v, slots)
    ref = pk.write_kv_reference(pool, 2, k, v, slots)
    # Everything but the null block must match exactly (racing padding writes land there).
    assert bool(jnp.array_equal(out[:, :, 1:], ref[:, :, 1:]))
    assert bool(jnp.array_equal(out[:2], pool[:2]))            # other layers untouched


def test_public_switch_pallas_backend():
    rng = np.random.default_rng()
    q, pool, tables, lens, qsl, _ = ragged_batch(rng, 16, 8, 4, 64, jnp.float32)
    kw = dict(scale=0.125)
    ref = pk.attention(q, pool, 1, tables, lens, qsl, backend="reference", **kw)
    assert rel_err(pk.attention(q, pool, 1, tables, lens, qsl, backend="pallas", **kw), ref) <= 1e-5
    # decode_only: T == R, q_len 1 each, one padding request with seq_len 0
    seq_lens = jnp.asarray([5, 40, 0], jnp.int32)
    dq = q[:3]
    dqsl = jnp.arange(4, dtype=jnp.int32)
    dtables = tables[:3]
    ref = pk.attention(dq, pool, 0, dtables, seq_lens, dqsl, backend="reference", **kw)
    out = pk.attention(dq, pool, 0, dtables, seq_lens, dqsl, backend="pallas", decode_only=True, **kw)
    assert rel_err(out, ref) <= 1e-5


def test_mosaic_backend_falls_back_to_triton_where_unsupported():
    """backend="mosaic" on what the Mosaic GPU kernel does not take (float32 here) runs the Triton kernel."""
    rng = np.random.default_rng()
    q, pool, tables, lens, qsl, _ = ragged_batch(rng, 16, 8, 4, 64, jnp.float32)
    ref = pk.attention(q, pool, 1, tables, lens, qsl, backend="reference", scale=0.125)
    assert rel_err(pk.attention(q, pool, 1, tables, lens, qsl, backend="mosaic", scale=0.125), ref) <= 1e-5


def test_mosaic_backend_runs_triton_on_the_cpu():
    """On the CPU backend="mosaic" is "pallas" (the Triton kernel, interpreted), bf16 included: the
    Mosaic GPU interpreter cannot be lowered inside the engine's jitted step."""
    rng = np.random.default_rng()
    q, pool, tables, lens, qsl, _ = ragged_batch(rng, 16, 8, 4, 64, jnp.bfloat16)
    args = (q, pool, 1, tables, lens, qsl)
    mosaic = jax.jit(functools.partial(pk.attention, backend="mosaic", scale=0.125))(*args)
    pallas = jax.jit(functools.partial(pk.attention, backend="pallas", scale=0.125))(*args)
    assert np.array_equal(np.asarray(mosaic, np.float32), np.asarray(pallas, np.float32))


def test_mosaic_backend_lowers_to_mosaic_gpu(monkeypatch):
    """Lowered for CUDA here (no GPU): bf16 ragged attention under backend="mosaic" becomes one Mosaic GPU
    call, a soft cap sends it to Triton, and decodes take the Mosaic decode kernel from MOSAIC_DECODE_MIN_PAIRS
    (request, kv head) pairs, the Triton one below. The kernel's numbers are checked on
    the H100 (bench/adhoc/mgpu_probe.py, bench/bench_kernels.py): it runs on Hopper only."""
    from jax import export
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")      # the ops' interpret=None -> compiled
    s = jax.ShapeDtypeStruct
    pool, layer = s((4, 2, 100, 2, 16, 64), jnp.bfloat16), s((), jnp.int32)
    checks = [export.DisabledSafetyCheck.custom_call(n) for n in ("__gpu$xla.gpu.triton", "mosaic_gpu_v2")]

    def calls(q, reqs=8, **kw):
        fn = functools.partial(pk.attention, scale=0.1, backend="mosaic", **kw)
        text = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
            q, pool, layer, s((reqs, 32), jnp.int32), s((reqs,), jnp.int32), s((reqs + 1,), jnp.int32)
        ).mlir_module()
        return text.count("mosaic_gpu_v2"), text.count("__gpu$xla.gpu.triton")
    assert calls(s((256, 14, 64), jnp.bfloat16)) == (1, 0)
    assert calls(s((256, 14, 64), jnp.bfloat16), soft_cap=30.0) == (0, 1)
    assert pk.MOSAIC_DECODE_MIN_PAIRS == 128                              # the measured default
    assert calls(s((8, 14, 64), jnp.bfloat16), decode_only=True) == (0, 1)  # 16 pairs: Triton
    assert calls(s((64, 14, 64), jnp.bfloat16), reqs=64, decode_only=True) == (1, 0)   # 128 pairs: Mosaic
    # not inside a while loop, whose body's CUDA graphs XLA would have to break around the Mosaic call
    assert calls(s((64, 14, 64), jnp.bfloat16), reqs=64, decode_only=True, in_loop=True) == (0, 1)
    # the Mosaic decode kernel, where switched on: from MOSAIC_DECODE_MIN_PAIRS (request, kv head) pairs
    monkeypatch.setattr(pk, "MOSAIC_DECODE_MIN_PAIRS", 16)                 # 8 requests x 2 kv heads
    assert calls(s((8, 14, 64), jnp.bfloat16), decode_only=True) == (1, 0)
    assert calls(s((8, 14, 64), jnp.bfloat16), decode_only=True, soft_cap=30.0) == (0, 1)
    monkeypatch.setattr(pk, "MOSAIC_DECODE_MIN_PAIRS", 17)
    assert calls(s((8, 14, 64), jnp.bfloat16), decode_only=True) == (0, 1)


def test_mosaic_decode_lowers_inside_a_layer_scan(monkeypatch):
    """The model calls attention() inside lax.scan over layers with a traced layer index: the Mosaic
    decode route lowers there for CUDA too (one Mosaic GPU call in the scan body)."""
    from jax import export
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(pk, "MOSAIC_DECODE_MIN_PAIRS", 1)
    s = jax.ShapeDtypeStruct

    def step(q, pool, tables, lens, qsl):
        def body(carry, layer):
            o = pk.attention(carry, pool, layer, tables, lens, qsl, scale=0.1, decode_only=True,
                             backend="mosaic")
            return o, None
        return jax.lax.scan(body, q, jnp.arange(pool.shape[0], dtype=jnp.int32))[0]
    checks = [export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")]
    text = export.export(jax.jit(step), platforms=["cuda"], disabled_checks=checks)(
        s((8, 32, 128), jnp.bfloat16), s((4, 2, 100, 8, 16, 128), jnp.bfloat16), s((8, 32), jnp.int32),
        s((8,), jnp.int32), s((9,), jnp.int32)).mlir_module()
    assert text.count("mosaic_gpu_v2") == 1


@pytest.mark.parametrize("platform,capability,expected", [
    ("cpu", None, "xla"), ("gpu", "9.0", "mosaic"), ("gpu", "8.0", "pallas"), ("gpu", "10.0", "pallas")])
def test_default_backend_by_platform_and_gpu(monkeypatch, platform, capability, expected):
    """Hopper gets the Mosaic GPU prefill kernel, other GPUs Triton, the CPU the jnp path; the Mosaic
    kernel itself refuses a GPU that is not Hopper (its wgmma is sm_90 only), so "mosaic" falls back."""
    from pallas_kernels.ragged_paged_attention_mgpu import mgpu_supported

    class FakeGpu:
        device_kind = f"GPU sm_{capability}"

        def __init__(self):
            self.platform, self.compute_capability = platform, capability
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    monkeypatch.setattr(jax, "devices", lambda *a: [FakeGpu()])
    assert pk.default_backend() == expected
    q, pool = jnp.zeros((8, 4, 64), jnp.bfloat16), jnp.zeros((1, 2, 4, 2, 16, 64), jnp.bfloat16)
    reason = mgpu_supported(q, pool, 16)
    assert (reason is None) == (expected != "pallas"), reason


@pytest.mark.parametrize("bad", ["heads", "dtype", "tables", "head_dim"])
def test_validation_errors(bad):
    q = jnp.ones((2, 8, 64), jnp.float32)
    pool = jnp.ones((1, 2, 4, 2, 16, 64), jnp.float32)
    tables = jnp.zeros((2, 3), jnp.int32)
    lens = jnp.ones((2,), jnp.int32)
    qsl = jnp.arange(3, dtype=jnp.int32)
    if bad == "heads":
        q = jnp.ones((2, 7, 64), jnp.float32)
    elif bad == "dtype":
        q = q.astype(jnp.bfloat16)
    elif bad == "tables":
        tables = jnp.zeros((3, 3), jnp.int32)
    else:
        q, pool = jnp.ones((2, 8, 48), jnp.float32), jnp.ones((1, 2, 4, 2, 16, 48), jnp.float32)
    with pytest.raises(ValueError):
        paged_decode_attention(q, pool, 0, tables, lens, scale=0.1)
    with pytest.raises(ValueError):
        ragged_paged_attention_pallas(q, pool, 0, tables, lens, qsl, scale=0.1)


def _triton_calls(fn, *args) -> int:
    """Lower for the CUDA platform on this CPU machine (Pallas -> Triton IR; no GPU needed)."""
    from jax import export
    exp = export.export(jax.jit(fn), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])
    return exp(*args).mlir_module().count("__gpu$xla.gpu.triton")


def test_kernels_lower_to_triton():
    s = jax.ShapeDtypeStruct
    pool = s((4, 2, 100, 2, 16, 64), jnp.bfloat16)
    tables, lens, qsl = s((8, 32), jnp.int32), s((8,), jnp.int32), s((9,), jnp.int32)
    decode = functools.partial(paged_decode_attention, scale=0.1, interpret=False, sliding_window=64,
                               soft_cap=30.0)
    assert _triton_calls(decode, s((8, 14, 64), jnp.bfloat16), pool, s((), jnp.int32), tables, lens) == 1
    ragged = functools.partial(ragged_paged_attention_pallas, scale=0.1, interpret=False)
    assert _triton_calls(ragged, s((256, 14, 64), jnp.bfloat16), pool, s((), jnp.int32), tables, lens,
                         qsl) == 1
    write = functools.partial(pk.write_kv_pallas, interpret=False)
    kv = s((256, 2, 64), jnp.bfloat16)
    assert _triton_calls(write, pool, s((), jnp.int32), kv, kv, s((256,), jnp.int32)) == 1


def test_decode_split_count_fills_one_wave():
    """choose_splits: the most splits whose programs fit one wave (8 per SM on 132 SMs), each split at
    least two tiles of the table, at least one split (the H100 shapes of bench_kernels)."""
    from pallas_kernels.paged_decode_attention import choose_splits
    assert choose_splits(256, 2, 256, 4) == 2        # qwen2-0.5b 256 x 4k: 1,024 programs (3 would spill)
    assert choose_splits(64, 2, 256, 4) == 8         # qwen2-0.5b 64 x 4k
    assert choose_splits(16, 2, 512, 4) == 33        # qwen2-0.5b 16 x 8k
    assert choose_splits(16, 2, 64, 4) == 8          # 16 x 1k: two 64-key tiles per split at least
    assert choose_splits(256, 8, 512, 4) == 1        # llama3-8b 256 x 8k: the pairs fill the GPU
    assert choose_splits(64, 8, 256, 4, programs_per_sm=16) == 4
    assert choose_splits(64, 2, 256, 4, sms=114) == 7          # an H100 PCIe's 114 SMs: 896 programs


def test_model_layer_takes_mosaic_decode_only_outside_loops(monkeypatch):
    """The runner's in_loop reaches attention() through the model: a decoder layer lowered for CUDA on a
    decode batch of 128 (request, kv head) pairs holds the Mosaic decode call with in_loop=False (per-layer
    programs of one step) and the Triton decode kernel with in_loop=True (layer scan, multi-step)."""
    from jax import export

    from jaxpaged.models.config import decoder_config_from_hf
    from jaxpaged.models.decoder import AttentionMetadata, DecoderLayer, RuntimeOptions, layer_phase
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    cfg = decoder_config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 128,
                                  "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
                                  "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "max_position_embeddings": 512})
    s, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    r, m = 128, 8                                                     # 128 requests x 1 kv head
    meta = AttentionMetadata(s((r,), jnp.int32), s((r,), jnp.int32), s((r, m), jnp.int32), s((r,), jnp.int32),
                             s((r + 1,), jnp.int32))
    h, cos, sin = s((r, 128), bf), s((r, 32), jnp.float32), s((r, 32), jnp.float32)
    pool = s((2, 2, 64, 1, 16, 64), bf)
    checks = [export.DisabledSafetyCheck.custom_call(n) for n in ("__gpu$xla.gpu.triton", "mosaic_gpu_v2")]

    def calls(in_loop):
        options = RuntimeOptions("mosaic", True, in_loop=in_loop)
        params = jax.eval_shape(lambda: DecoderLayer(cfg, bf, options).init(
            jax.random.PRNGKey(0), (jnp.zeros((r, 128), bf), jnp.zeros(pool.shape, bf), jnp.int32(0)),
            jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), meta), jnp.zeros((r, 32)), jnp.zeros((r, 32))))["params"]
        fn = lambda p, h, kv, meta, cos, sin: layer_phase(cfg, bf, options, p, h, kv, jnp.int32(0), meta, cos, sin)
        text = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
            params, h, pool, meta, cos, sin).mlir_module()
        return text.count("mosaic_gpu_v2"), text.count("__gpu$xla.gpu.triton")
    mosaic_calls, triton_calls = calls(in_loop=False)
    assert mosaic_calls == 1                       # the decode; KV write stays the Triton kernel
    assert calls(in_loop=True) == (0, triton_calls + 1)
