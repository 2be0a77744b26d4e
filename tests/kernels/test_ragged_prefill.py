"""The ragged paged attention kernel (Triton backend: prefill chunks and decodes in one flat batch) against
its reference: interpret mode on the CPU, compiled on the GPU, where it also runs at real sizes
(kernel_cases.py says how the switch works)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import (BAD_INPUTS, INTERPRET, REAL_LAYOUTS, REAL_RAGGED, SMALL_LAYOUTS, TOL, Case, Layout,
                          bad_inputs, case_id, chunked_reference, gpu_only, lowered_calls, mixed_batch,
                          ragged_inputs, reference, rel_err)
from jaxpaged import pallas_kernels as pk
from jaxpaged.pallas_kernels.ragged_paged_attention_pallas import ragged_paged_attention_pallas


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedCase(Case):
    block_m: int | None = 16        # rows (tokens x heads of a group) per tile; None: the op's default
    block_k: int | None = 16        # keys per inner iteration
    chunked_reference: bool = False  # check against the XLA path in f32 (real sizes) instead of the reference


# Small tiles: several tiles per request, tiles with a partial tail, several key iterations (32 rows where
# a tile must hold more than 8 heads of a group).
CASES = [RaggedCase(layout=layout, batch=mixed_batch(layout.block_size),
                    block_m=16 if layout.num_heads // layout.num_kv_heads <= 8 else 32)
         for layout in SMALL_LAYOUTS]
CASES += [RaggedCase(layout=Layout(8, 64, 8, 2, "float32"), batch=mixed_batch(8), sliding_window=window, soft_cap=cap)
          for window, cap in [(9, None), (None, 4.0), (20, 2.0)]]
CASES += [RaggedCase(layout=Layout(8, 64, 8, 2, "float32"), batch=mixed_batch(8), alibi=True),
          RaggedCase(layout=Layout(16, 64, 4, 4, "bfloat16"), batch=mixed_batch(16), sliding_window=20, alibi=True)]
# Real sizes: the op's default tiles, plain and windowed + capped.
CASES += gpu_only(RaggedCase(layout=layout, batch=REAL_RAGGED, block_m=None, block_k=None, chunked_reference=True,
                             sliding_window=window, soft_cap=cap)
                  for layout in REAL_LAYOUTS for window, cap in [(None, None), (600, 30.0)])


class TestRaggedPrefill:
    @pytest.mark.parametrize("case", CASES, ids=case_id)
    def test_matches_reference(self, case):
        x = ragged_inputs(case.rng(), case.layout, case.batch)
        kw = dict(scale=case.layout.head_dim ** -0.5, **case.opts)
        ref_fn = chunked_reference if case.chunked_reference else pk.ragged_paged_attention_reference
        ref = reference(ref_fn, *x.args, **kw)
        out = ragged_paged_attention_pallas(*x.args, block_m=case.block_m, block_k=case.block_k,
                                            interpret=INTERPRET, **kw)
        assert out.shape == x.q.shape and out.dtype == x.q.dtype
        assert bool(jnp.all(jnp.isfinite(out)))
        assert rel_err(out, ref) <= TOL[case.layout.dtype]
        assert (np.asarray(out[x.num_real_tokens:]) == 0).all()               # bucket padding -> zeros
        if case.alibi:                                                        # the XLA path's bias too
            assert rel_err(reference(pk.ragged_paged_attention_xla, *x.args, **kw), ref) <= TOL[case.layout.dtype]

    @pytest.mark.parametrize("bad", BAD_INPUTS)
    def test_rejects_bad_inputs(self, bad):
        q, pool, tables, lens, qsl = bad_inputs(bad)
        with pytest.raises(ValueError):
            ragged_paged_attention_pallas(q, pool, 0, tables, lens, qsl, scale=0.1, interpret=INTERPRET)

    @pytest.mark.parametrize("alibi", [False, True])
    def test_lowers_to_triton(self, alibi):
        """Lowered for the CUDA platform (Pallas -> Triton IR; no GPU needed): one Triton call, ALiBi's
        per-row slope gather included."""
        s = jax.ShapeDtypeStruct
        fn = functools.partial(ragged_paged_attention_pallas, scale=0.1, interpret=False)
        op = (lambda *a: fn(*a[:-1], alibi_slopes=a[-1])) if alibi else fn
        slopes = (s((14,), jnp.float32),) if alibi else ()
        assert lowered_calls(op, s((256, 14, 64), jnp.bfloat16), s((4, 2, 100, 2, 16, 64), jnp.bfloat16),
                             s((), jnp.int32), s((8, 32), jnp.int32), s((8,), jnp.int32), s((9,), jnp.int32),
                             *slopes) == (1,)


def test_xla_path_in_a_layer_scan_copies_no_layer_out_of_the_pool():
    """The XLA path inside a scan over layers with the pool as its donated carry (as the engine's step runs
    it): the compiled program holds no buffer of one layer's pool. A layer sliced out before the path's loop
    over key chunks would be materialized as the loop's operand, a copy of the layer every step (on the CPU
    it made a 2-layer model's decode step ~100 ms with the default 512 MiB pool, against ~2 ms)."""
    layers, blocks, kv_heads, block_size, head_dim = 2, 4099, 2, 16, 32          # 4099: a shape nothing else has
    pool = jax.ShapeDtypeStruct((layers, 2, blocks, kv_heads, block_size, head_dim), jnp.float32)

    def step(kv_cache, q, tables, lens, qsl):
        def layer(cache, idx):
            cache = cache.at[idx, 0, tables[0, 0], :, 0, :].set(q[0, :kv_heads])    # the KV write
            out = pk.ragged_paged_attention_xla(q, cache, idx, tables, lens, qsl, scale=0.1)
            return cache, out
        return jax.lax.scan(layer, kv_cache, jnp.arange(layers))

    s = jax.ShapeDtypeStruct
    hlo = jax.jit(step, donate_argnums=0).lower(
        pool, s((4, 4, head_dim), jnp.float32), s((2, 8), jnp.int32), s((2,), jnp.int32),
        s((3,), jnp.int32)).compile().as_text()
    layer_shape = f"f32[2,{blocks},{kv_heads},{block_size},{head_dim}]"
    assert f"= {layer_shape}" not in hlo, "a layer of the pool is materialized"
    assert f"{blocks}," in hlo                                                    # (the pool itself is there)
