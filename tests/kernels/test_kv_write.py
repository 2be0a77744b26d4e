"""The KV write kernel (new K/V scattered into the paged pool at slot_mapping) against its reference,
exactly: interpret mode on the CPU, compiled on the GPU, where it also runs at real sizes (kernel_cases.py
says how the switch works)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import (INTERPRET, REAL_LAYOUTS, Layout, case_id, gpu_only, lowered_calls, make_pool, normal,
                          seeded_rng)
from jaxpaged import pallas_kernels as pk


@dataclasses.dataclass(frozen=True)
class KVWriteCase:
    layout: Layout              # block size, kv heads, head dim, dtype
    num_layers: int             # the kernel writes the last layer
    num_blocks: int
    num_tokens: int             # the last 3 are padding tokens, written to the null block

    @property
    def id(self) -> str:
        return f"{self.layout.id}-L{self.num_layers}-B{self.num_blocks}-T{self.num_tokens}"


CASES = [KVWriteCase(Layout(8, 64, 2, 2, dtype), 3, 12, 20) for dtype in ("float32", "bfloat16")]
# Real sizes: 4k tokens into the pool of 64 requests x 4k tokens.
CASES += gpu_only(KVWriteCase(layout, 2, 64 * 256 + 1, 4096) for layout in REAL_LAYOUTS)


class TestKVWrite:
    @pytest.mark.parametrize("case", CASES, ids=case_id)
    def test_matches_reference(self, case):
        rng = seeded_rng(f"KVWriteCase/{case.id}")
        layout, layer = case.layout, case.num_layers - 1
        pool = make_pool(rng, case.num_layers, case.num_blocks, layout)          # the poison: random
        k, v = (normal(rng, (case.num_tokens, layout.num_kv_heads, layout.head_dim), layout.dtype) for _ in "kv")
        slots = rng.permutation(np.arange(layout.block_size, case.num_blocks * layout.block_size))[:case.num_tokens]
        slots[-3:] = [0, 0, 1]                                      # padding tokens -> the null block
        slots = jnp.asarray(slots, jnp.int32)
        out = pk.write_kv_pallas(pool, jnp.int32(layer), k, v, slots, interpret=INTERPRET)
        ref = pk.write_kv_reference(pool, layer, k, v, slots)
        # Everything but the null block must match exactly (racing padding writes land there).
        assert bool(jnp.array_equal(out[:, :, 1:], ref[:, :, 1:]))
        assert bool(jnp.array_equal(out[:layer], pool[:layer]))    # other layers untouched

    def test_lowers_to_triton(self):
        """Lowered for the CUDA platform (Pallas -> Triton IR; no GPU needed): one Triton call."""
        s = jax.ShapeDtypeStruct
        write = functools.partial(pk.write_kv_pallas, interpret=False)
        kv = s((256, 2, 64), jnp.bfloat16)
        assert lowered_calls(write, s((4, 2, 100, 2, 16, 64), jnp.bfloat16), s((), jnp.int32), kv, kv,
                             s((256,), jnp.int32)) == (1,)
