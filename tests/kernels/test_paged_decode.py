"""The paged decode kernel (Triton backend) against its plain-jnp reference: interpret mode on the CPU,
compiled on the GPU, where it also runs at real sizes (kernel_cases.py says how the switch works)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import (BAD_INPUTS, INTERPRET, REAL_DECODE, REAL_LAYOUTS, SMALL_LAYOUTS, TOL, Case, DecodeBatch,
                          Layout, bad_inputs, case_id, decode_inputs, gpu_only, lowered_calls, reference, rel_err)
from jaxpaged.pallas_kernels.paged_decode_attention import (choose_splits, paged_decode_attention,
                                                            paged_decode_attention_reference)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeCase(Case):
    num_splits: tuple[int | None, ...] = (1, 3)   # each checked: 1 writes the output directly, more merge
    blocks_per_iter: int | None = 2               # None (and num_splits None): the op's own choice


def short_and_long(block_size: int) -> DecodeBatch:
    """Lengths 1, not a multiple of the block size, a full block, 0 (padding request), long."""
    return DecodeBatch("mixed", max_blocks=10,
                       seq_lens=(1, block_size + 3, block_size, 0, 9 * block_size - 5))


CASES = [DecodeCase(layout=layout, batch=short_and_long(layout.block_size)) for layout in SMALL_LAYOUTS]
# Windows and soft caps; 4 splits of 3 blocks of the 12-column table: the window starts mid-split.
CASES += [DecodeCase(layout=Layout(16, 64, 8, 2, "float32"), batch=DecodeBatch("3reqs", 12, (150, 7, 64)),
                     num_splits=(1, 4), sliding_window=window, soft_cap=cap)
          for window, cap in [(20, None), (None, 5.0), (37, 3.0)]]
CASES += [DecodeCase(layout=Layout(16, 64, 8, 2, "float32"), batch=DecodeBatch("3reqs", 12, (150, 7, 64)),
                     num_splits=(1, 4), alibi=True),
          DecodeCase(layout=Layout(8, 64, 4, 4, "bfloat16"), batch=short_and_long(8), sliding_window=30, alibi=True)]
# More splits than the contexts fill (as at few requests, where the splits fill one wave): the merge reads only
# each request's non-empty splits, with and without a window, a padding request among them.
CASES += [DecodeCase(layout=Layout(16, 64, 8, 2, "float32"), batch=DecodeBatch("3reqs", 12, (150, 7, 64)),
                     num_splits=(12,), sliding_window=window) for window in (None, 20)]
CASES += [DecodeCase(layout=Layout(8, 64, 4, 4, "bfloat16"), batch=short_and_long(8), num_splits=(10,))]
# Head size 256 with Gemma 2's soft cap, at the op's own configuration.
CASES += [DecodeCase(layout=Layout(16, 256, 4, 2, "bfloat16"), batch=short_and_long(16), num_splits=(None, 3),
                     blocks_per_iter=None, soft_cap=50.0)]
CASES += gpu_only([DecodeCase(layout=Layout(16, 256, 16, 8, "bfloat16", "gemma-2-9b"), batch=REAL_DECODE,
                              num_splits=(None,), blocks_per_iter=None, soft_cap=50.0)])
# Real sizes: the op's default configuration (split count fitted to the GPU), plain and windowed + capped.
CASES += gpu_only(DecodeCase(layout=layout, batch=REAL_DECODE, num_splits=(None,), blocks_per_iter=None,
                             sliding_window=window, soft_cap=cap)
                  for layout in REAL_LAYOUTS for window, cap in [(None, None), (1000, 30.0)])


class TestPagedDecode:
    @pytest.mark.parametrize("case", CASES, ids=case_id)
    def test_matches_reference(self, case):
        x = decode_inputs(case.rng(), case.layout, case.batch)
        scale = case.layout.head_dim ** -0.5
        ref = reference(paged_decode_attention_reference, *x.args, scale=scale, **case.opts)
        for num_splits in case.num_splits:
            out = paged_decode_attention(*x.args, scale=scale, num_splits=num_splits,
                                         blocks_per_iter=case.blocks_per_iter, interpret=INTERPRET, **case.opts)
            assert out.shape == x.q.shape and out.dtype == x.q.dtype
            assert bool(jnp.all(jnp.isfinite(out)))
            assert rel_err(out, ref) <= TOL[case.layout.dtype], num_splits
            assert (np.asarray(out)[np.asarray(x.seq_lens) == 0] == 0).all()     # seq_len 0 -> zeros

    @pytest.mark.parametrize("bad", BAD_INPUTS)
    def test_rejects_bad_inputs(self, bad):
        q, pool, tables, lens, _ = bad_inputs(bad)
        with pytest.raises(ValueError):
            paged_decode_attention(q, pool, 0, tables, lens, scale=0.1, interpret=INTERPRET)

    @pytest.mark.parametrize("alibi", [False, True])
    @pytest.mark.parametrize("num_splits", [None, 1])
    def test_lowers_to_triton(self, alibi, num_splits):
        """Lowered for the CUDA platform (Pallas -> Triton IR; no GPU needed), ALiBi's slope load included:
        one Triton call for one split, two (the decode kernel and its merge) where the op splits the
        context (its own choice here: 4 splits)."""
        s = jax.ShapeDtypeStruct
        fn = functools.partial(paged_decode_attention, scale=0.1, interpret=False, sliding_window=64,
                               soft_cap=None if alibi else 30.0, num_splits=num_splits)
        op = (lambda *a: fn(*a[:-1], alibi_slopes=a[-1])) if alibi else fn
        slopes = (s((14,), jnp.float32),) if alibi else ()
        assert lowered_calls(op, s((8, 14, 64), jnp.bfloat16), s((4, 2, 100, 2, 16, 64), jnp.bfloat16),
                             s((), jnp.int32), s((8, 32), jnp.int32), s((8,), jnp.int32),
                             *slopes) == (1 if num_splits == 1 else 2,)

    def test_split_count_fills_one_wave(self):
        """choose_splits: the most splits whose programs fit one wave (8 per SM on 132 SMs), each split at
        least two tiles of the table, at least one split (the H100 shapes of bench_kernels)."""
        assert choose_splits(256, 2, 256, 4) == 2        # qwen2-0.5b 256 x 4k: 1,024 programs (3 would spill)
        assert choose_splits(64, 2, 256, 4) == 8         # qwen2-0.5b 64 x 4k
        assert choose_splits(16, 2, 512, 4) == 33        # qwen2-0.5b 16 x 8k
        assert choose_splits(16, 2, 64, 4) == 8          # 16 x 1k: two 64-key tiles per split at least
        assert choose_splits(256, 8, 512, 4) == 1        # llama3-8b 256 x 8k: the pairs fill the GPU
        assert choose_splits(64, 8, 256, 4, programs_per_sm=16) == 4
        assert choose_splits(64, 2, 256, 4, sms=114) == 7          # an H100 PCIe's 114 SMs: 896 programs
