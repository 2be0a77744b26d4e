"""pallas_kernels.attention(): which kernel each backend runs, checked by its numbers (interpret mode on the
CPU, compiled on the GPU) and by what it lowers to for CUDA (no GPU needed)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import INTERPRET, Layout, lowered_calls, mixed_batch, ragged_inputs, reference, rel_err, seeded_rng
from jaxpaged import pallas_kernels as pk

MOSAIC_AND_TRITON = ("mosaic_gpu_v2", "__gpu$xla.gpu.triton")
# A decode on the Triton kernel, as MOSAIC_AND_TRITON counts it: these tests' tables are split (a short table
# at few requests), so the decode kernel and the merge of its splits, two Triton calls.
TRITON_DECODE = (0, 2)


def mixed_inputs(name: str, dtype: str):
    """kernel_cases.mixed_batch with 8 query heads on 4 kv heads of 64, blocks of 16, its seed named `name`."""
    return ragged_inputs(seeded_rng(f"TestAttentionBackends/{name}"), Layout(16, 64, 8, 4, dtype), mixed_batch(16))


class TestAttentionBackends:
    def test_pallas_backend_matches_reference(self):
        q, pool, _, tables, lens, qsl = mixed_inputs("pallas", "float32").args
        kw = dict(scale=0.125)
        ref = reference(pk.attention, q, pool, 1, tables, lens, qsl, backend="reference", **kw)
        assert rel_err(pk.attention(q, pool, 1, tables, lens, qsl, backend="pallas", **kw), ref) <= 1e-5
        # decode_only: T == R, q_len 1 each, one padding request with seq_len 0
        seq_lens = jnp.asarray([5, 40, 0], jnp.int32)
        dq, dqsl, dtables = q[:3], jnp.arange(4, dtype=jnp.int32), tables[:3]
        ref = reference(pk.attention, dq, pool, 0, dtables, seq_lens, dqsl, backend="reference", **kw)
        out = pk.attention(dq, pool, 0, dtables, seq_lens, dqsl, backend="pallas", decode_only=True, **kw)
        assert rel_err(out, ref) <= 1e-5

    def test_mosaic_backend_falls_back_to_triton_where_unsupported(self):
        """backend="mosaic" on what the Mosaic GPU kernel does not take (float32 here) runs the Triton kernel."""
        q, pool, _, tables, lens, qsl = mixed_inputs("mosaic-f32", "float32").args
        ref = reference(pk.attention, q, pool, 1, tables, lens, qsl, backend="reference", scale=0.125)
        assert rel_err(pk.attention(q, pool, 1, tables, lens, qsl, backend="mosaic", scale=0.125), ref) <= 1e-5

    @pytest.mark.skipif(not INTERPRET, reason="the CPU's routing: on the GPU backend='mosaic' runs the Mosaic "
                        "GPU kernel (test_mosaic_gpu.py checks its numbers)")
    def test_mosaic_backend_runs_triton_on_the_cpu(self):
        """On the CPU backend="mosaic" is "pallas" (the Triton kernel, interpreted), bf16 included: the
        Mosaic GPU interpreter cannot be lowered inside the engine's jitted step."""
        q, pool, _, tables, lens, qsl = mixed_inputs("mosaic-bf16", "bfloat16").args
        args = (q, pool, 1, tables, lens, qsl)
        mosaic = jax.jit(functools.partial(pk.attention, backend="mosaic", scale=0.125))(*args)
        pallas = jax.jit(functools.partial(pk.attention, backend="pallas", scale=0.125))(*args)
        assert np.array_equal(np.asarray(mosaic, np.float32), np.asarray(pallas, np.float32))

    def test_mosaic_backend_lowers_to_mosaic_gpu(self, monkeypatch):
        """Lowered for CUDA: bf16 ragged attention under backend="mosaic" becomes two Mosaic GPU calls outside while
        loops (mixed_attention_mgpu: the one-token requests in the packed decode kernel, the rest in the ragged
        one) and one inside them, a soft cap sends it to Triton, and decodes take the Mosaic decode kernel from
        MOSAIC_DECODE_MIN_PAIRS (request, kv head) pairs, the Triton one below. The kernels' numbers:
        test_mosaic_gpu.py (the Mosaic GPU interpreter on the CPU, the kernels themselves on a Hopper GPU)."""
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")      # the ops' interpret=None -> compiled
        s = jax.ShapeDtypeStruct
        pool, layer = s((4, 2, 100, 2, 16, 64), jnp.bfloat16), s((), jnp.int32)

        def calls(q, reqs=8, **kw):
            fn = functools.partial(pk.attention, scale=0.1, backend="mosaic", **kw)
            return lowered_calls(fn, q, pool, layer, s((reqs, 32), jnp.int32), s((reqs,), jnp.int32),
                                 s((reqs + 1,), jnp.int32), names=MOSAIC_AND_TRITON)
        assert calls(s((256, 14, 64), jnp.bfloat16)) == (2, 0)
        assert calls(s((256, 14, 64), jnp.bfloat16), in_loop=True) == (1, 0)
        assert calls(s((256, 14, 64), jnp.bfloat16), soft_cap=30.0) == (0, 1)
        assert pk.MOSAIC_DECODE_MIN_PAIRS == 128                              # the measured default
        assert calls(s((8, 14, 64), jnp.bfloat16), decode_only=True) == TRITON_DECODE  # 16 pairs: Triton
        assert calls(s((64, 14, 64), jnp.bfloat16), reqs=64, decode_only=True) == (1, 0)   # 128 pairs: Mosaic
        # not inside a while loop, whose body's CUDA graphs XLA would have to break around the Mosaic call
        assert calls(s((64, 14, 64), jnp.bfloat16), reqs=64, decode_only=True, in_loop=True) == TRITON_DECODE
        # the Mosaic decode kernel, where switched on: from MOSAIC_DECODE_MIN_PAIRS (request, kv head) pairs
        monkeypatch.setattr(pk, "MOSAIC_DECODE_MIN_PAIRS", 16)                 # 8 requests x 2 kv heads
        assert calls(s((8, 14, 64), jnp.bfloat16), decode_only=True) == (1, 0)
        assert calls(s((8, 14, 64), jnp.bfloat16), decode_only=True, soft_cap=30.0) == TRITON_DECODE
        monkeypatch.setattr(pk, "MOSAIC_DECODE_MIN_PAIRS", 17)
        assert calls(s((8, 14, 64), jnp.bfloat16), decode_only=True) == TRITON_DECODE

    def test_mosaic_routing_of_e4m3_pools_and_alibi(self, monkeypatch):
        """Lowered for CUDA under backend="mosaic": an e4m3 pool's decode takes the Mosaic decode kernel at head
        size 128 (MOSAIC_FP8_DECODE_MIN_HEAD_DIM) and the Triton one at 64, its prefill the Triton kernel;
        ALiBi's prefill takes the Mosaic kernel, its decode too with one query head per kv head, Triton with
        grouped heads (and so a mixed batch's one-token requests: in the packed decode kernel with one query head
        per kv head, in the ragged one with grouped heads)."""
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")      # the ops' interpret=None -> compiled
        s = jax.ShapeDtypeStruct
        layer, reqs = s((), jnp.int32), 64

        def calls(q, pool, **kw):
            fn = functools.partial(pk.attention, scale=0.1, backend="mosaic", **kw)
            return lowered_calls(fn, q, pool, layer, s((reqs, 32), jnp.int32), s((reqs,), jnp.int32),
                                 s((reqs + 1,), jnp.int32), names=MOSAIC_AND_TRITON)
        scales = (jnp.float32(1.0), jnp.float32(1.0))
        for head_dim, decode in ((128, (1, 0)), (64, TRITON_DECODE)):
            pool8 = s((4, 2, 100, 2, 16, head_dim), pk.FP8_CACHE_DTYPE)
            q = s((reqs, 8, head_dim), jnp.bfloat16)                               # 128 (request, kv head) pairs
            assert calls(q, pool8, decode_only=True, kv_scales=scales) == decode, head_dim
            assert calls(s((256, 8, head_dim), jnp.bfloat16), pool8, kv_scales=scales) == (0, 1), head_dim
        pool = s((4, 2, 100, 2, 16, 128), jnp.bfloat16)
        slopes = jnp.asarray([0.5, 0.25], jnp.float32)
        assert calls(s((reqs, 2, 128), jnp.bfloat16), pool, decode_only=True, alibi_slopes=slopes) == (1, 0)
        assert calls(s((256, 2, 128), jnp.bfloat16), pool, alibi_slopes=slopes) == (2, 0)
        grouped = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32)
        assert calls(s((reqs, 4, 128), jnp.bfloat16), pool, decode_only=True, alibi_slopes=grouped) == TRITON_DECODE
        assert calls(s((256, 4, 128), jnp.bfloat16), pool, alibi_slopes=grouped) == (1, 0)

    def test_mosaic_routing_of_wide_heads_soft_caps_and_windows(self, monkeypatch):
        """Lowered for CUDA under backend="mosaic": from MOSAIC_DECODE_MIN_PAIRS pairs, the decodes the packed Mosaic
        kernel declines (head size 256, a soft cap, a sliding window) take the wide-head Mosaic kernel, one Mosaic
        GPU call; the Triton decode kernel keeps head size 64, e4m3 pools of head size 256, decodes inside loops
        and fewer pairs. Prefill with a soft cap or a window stays on the Triton kernel."""
        from jaxpaged.pallas_kernels import paged_decode_attention_mgpu_wide as wide
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")      # the ops' interpret=None -> compiled
        s = jax.ShapeDtypeStruct
        layer, reqs = s((), jnp.int32), 64
        taken = []
        real = wide.paged_decode_attention_mgpu_wide
        monkeypatch.setattr(wide, "paged_decode_attention_mgpu_wide", lambda *a, **k: taken.append(k) or real(*a, **k))

        def calls(head_dim, reqs=reqs, pool_dtype=jnp.bfloat16, **kw):
            pool = s((4, 2, 100, 2, 16, head_dim), pool_dtype)
            fn = functools.partial(pk.attention, scale=0.1, backend="mosaic", **kw)
            return lowered_calls(fn, s((reqs, 4, head_dim), jnp.bfloat16), pool, layer, s((reqs, 32), jnp.int32),
                                 s((reqs,), jnp.int32), s((reqs + 1,), jnp.int32), names=MOSAIC_AND_TRITON)
        gemma = dict(decode_only=True, soft_cap=50.0, sliding_window=4096)
        assert calls(256, **gemma) == (1, 0)                                # 128 pairs: the wide kernel
        assert taken[-1]["soft_cap"] == 50.0 and taken[-1]["sliding_window"] == 4096
        assert calls(256, decode_only=True) == (1, 0) and len(taken) == 2   # head size 256 alone
        assert calls(128, decode_only=True, sliding_window=4096) == (1, 0) and len(taken) == 3   # Mistral's window
        assert calls(128, decode_only=True) == (1, 0) and len(taken) == 3   # the packed kernel's own call
        assert calls(64, decode_only=True, sliding_window=4096) == TRITON_DECODE
        assert calls(256, reqs=32, **gemma) == TRITON_DECODE                       # 64 pairs
        assert calls(256, **gemma, in_loop=True) == TRITON_DECODE
        ones = (jnp.float32(1.0), jnp.float32(1.0))
        assert calls(256, pool_dtype=pk.FP8_CACHE_DTYPE, **gemma, kv_scales=ones) == TRITON_DECODE
        assert calls(256, reqs=256, soft_cap=50.0) == (0, 1)                # prefill
        assert len(taken) == 3

    def test_mosaic_decode_lowers_inside_a_layer_scan(self, monkeypatch):
        """The model calls attention() inside lax.scan over layers with a traced layer index: the Mosaic
        decode route lowers there for CUDA too (one Mosaic GPU call in the scan body)."""
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        monkeypatch.setattr(pk, "MOSAIC_DECODE_MIN_PAIRS", 1)
        s = jax.ShapeDtypeStruct

        def step(q, pool, tables, lens, qsl):
            def body(carry, layer):
                o = pk.attention(carry, pool, layer, tables, lens, qsl, scale=0.1, decode_only=True,
                                 backend="mosaic")
                return o, None
            return jax.lax.scan(body, q, jnp.arange(pool.shape[0], dtype=jnp.int32))[0]
        assert lowered_calls(step, s((8, 32, 128), jnp.bfloat16), s((4, 2, 100, 8, 16, 128), jnp.bfloat16),
                             s((8, 32), jnp.int32), s((8,), jnp.int32), s((9,), jnp.int32),
                             names=("mosaic_gpu_v2",)) == (1,)

    @pytest.mark.parametrize("platform,capability,expected", [
        ("cpu", None, "xla"), ("gpu", "9.0", "mosaic"), ("gpu", "8.0", "pallas"), ("gpu", "10.0", "pallas")])
    def test_default_backend_by_platform_and_gpu(self, monkeypatch, platform, capability, expected):
        """Hopper gets the Mosaic GPU prefill kernel, other GPUs Triton, the CPU the jnp path (the platform as
        config.detect_platform reads it, the choice config.resolve's); the Mosaic kernel itself refuses a
        GPU that is not Hopper (its wgmma is sm_90 only), so "mosaic" falls back."""
        import jax._src.lib

        from jaxpaged.config import EngineArgs, detect_platform, resolve
        from jaxpaged.pallas_kernels.ragged_paged_attention_mgpu import mgpu_supported

        class FakeGpu:
            device_kind = f"GPU sm_{capability}"

            def __init__(self):
                self.platform, self.compute_capability = platform, capability

            def memory_stats(self):
                return {"bytes_limit": 80 << 30}
        monkeypatch.setattr(jax, "default_backend", lambda: platform)
        monkeypatch.setattr(jax, "devices", lambda *a: [FakeGpu()])
        # no CUDA runtime version to refuse (as on the CPU): the answer does not depend on the machine's
        monkeypatch.setattr(jax._src.lib, "cuda_versions", None, raising=False)
        run = resolve(EngineArgs(), detect_platform(), layer_bytes=0, max_position_embeddings=64)
        assert run.attention_backend == expected
        q, pool = jnp.zeros((8, 4, 64), jnp.bfloat16), jnp.zeros((1, 2, 4, 2, 16, 64), jnp.bfloat16)
        reason = mgpu_supported(q, pool, 16)
        assert (reason is None) == (expected != "pallas"), reason

    def test_model_layer_takes_mosaic_decode_only_outside_loops(self, monkeypatch):
        """The runner's in_loop reaches attention() through the model: a decoder layer lowered for CUDA on a
        decode batch of 128 (request, kv head) pairs holds the Mosaic decode call with in_loop=False
        (per-layer programs of one step) and the Triton decode kernel with in_loop=True (layer scan,
        multi-step)."""
        from jaxpaged.models.config import decoder_config_from_hf
        from jaxpaged.models.decoder import AttentionMetadata, DecoderLayer, RuntimeOptions, layer_phase
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        cfg = decoder_config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 128,
                                      "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
                                      "num_key_value_heads": 1, "rms_norm_eps": 1e-5,
                                      "max_position_embeddings": 512})
        s, bf = jax.ShapeDtypeStruct, jnp.bfloat16
        r, m = 128, 8                                                     # 128 requests x 1 kv head
        meta = AttentionMetadata(s((r,), jnp.int32), s((r,), jnp.int32), s((r, m), jnp.int32), s((r,), jnp.int32),
                                 s((r + 1,), jnp.int32))
        h, cos, sin = s((r, 128), bf), s((1, r, 32), jnp.float32), s((1, r, 32), jnp.float32)   # one rope kind
        pool = s((2, 2, 64, 1, 16, 64), bf)

        def calls(in_loop):
            options = RuntimeOptions("mosaic", True, in_loop=in_loop)
            params = jax.eval_shape(lambda: DecoderLayer(cfg, bf, options).init(
                jax.random.PRNGKey(0), (jnp.zeros((r, 128), bf), jnp.zeros(pool.shape, bf), jnp.int32(0)),
                jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), meta), jnp.zeros((1, r, 32)),
                jnp.zeros((1, r, 32))))["params"]
            fn = lambda p, h, kv, meta, cos, sin: layer_phase(cfg, bf, options, p, h, kv, jnp.int32(0), meta, cos,
                                                              sin)
            return lowered_calls(fn, params, h, pool, meta, cos, sin, names=MOSAIC_AND_TRITON)
        mosaic_calls, triton_calls = calls(in_loop=False)
        assert mosaic_calls == 1                       # the decode; KV write stays the Triton kernel
        assert calls(in_loop=True) == (0, triton_calls + 1)


def test_gemma_layers_take_the_wide_mosaic_decode_outside_loops(monkeypatch):
    """A Gemma 2 decoder layer of each kind (global, sliding) lowered for CUDA on a decode of 128 (request, kv
    head) pairs at head size 256: its attention is the wide-head Mosaic decode call, with the layer's window and
    the model's soft cap; inside a loop the Triton decode kernel."""
    from jaxpaged.models.config import decoder_config_from_hf
    from jaxpaged.models.decoder import AttentionMetadata, DecoderLayer, RuntimeOptions, layer_phase
    from jaxpaged.pallas_kernels import paged_decode_attention_mgpu_wide as wide
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    taken = []
    real = wide.paged_decode_attention_mgpu_wide
    monkeypatch.setattr(wide, "paged_decode_attention_mgpu_wide", lambda *a, **k: taken.append(k) or real(*a, **k))
    cfg = decoder_config_from_hf({
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192})
    assert cfg.layer_kinds() == (1, 0) and cfg.attention_windows() == (None, 4096)
    s, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    r, m = 64, 8                                                      # 64 requests x 2 kv heads
    meta = AttentionMetadata(s((r,), jnp.int32), s((r,), jnp.int32), s((r, m), jnp.int32), s((r,), jnp.int32),
                             s((r + 1,), jnp.int32))
    rope = cfg.rope_dim // 2
    h, cos, sin = s((r, 128), bf), s((2, r, rope), jnp.float32), s((2, r, rope), jnp.float32)
    pool = s((2, 2, 64, 2, 16, 256), bf)

    def calls(kind, in_loop):
        options = RuntimeOptions("mosaic", True, in_loop=in_loop)
        params = jax.eval_shape(lambda: DecoderLayer(cfg, bf, options, kind).init(
            jax.random.PRNGKey(0), (jnp.zeros((r, 128), bf), jnp.zeros(pool.shape, bf), jnp.int32(0)),
            jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), meta), jnp.zeros(cos.shape), jnp.zeros(sin.shape)))

        def fn(p, h, kv, meta, cos, sin):
            return layer_phase(cfg, bf, options, p["params"], h, kv, jnp.int32(0), meta, cos, sin, kind)
        return lowered_calls(fn, params, h, pool, meta, cos, sin, names=MOSAIC_AND_TRITON)
    for kind, window in ((0, None), (1, 4096)):
        mosaic_calls, triton_calls = calls(kind, in_loop=False)
        assert mosaic_calls == 1 and taken[-1]["sliding_window"] == window and taken[-1]["soft_cap"] == 50.0
        assert calls(kind, in_loop=True) == (0, triton_calls + 1)
