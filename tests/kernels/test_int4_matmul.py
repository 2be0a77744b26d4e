"""The W4A16 kernel (Triton backend) against its plain-jnp reference: interpret mode on the CPU, compiled on
the GPU, where it also runs llama3-8b's decode shapes (kernel_cases.py says how the switch works)."""
from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import INTERPRET, TOL, gpu_only, lowered_calls, rel_err
from jaxpaged.pallas_kernels.int4_matmul import (GEMV_MAX_ROWS, check_group_size, choose_int4_tiling,
                                                 dequantize_int4, int4_matmul, int4_matmul_reference, pack_bits,
                                                 pack_int4, unpack_bits, unpack_int4, use_f16x2)


@dataclasses.dataclass(frozen=True)
class MatmulCase:
    m: int
    k: int
    n: int
    group_size: int
    dtype: str = "float32"
    num_splits: int | None = None       # None: the op's own tiling
    slabs_per_iter: int = 1
    offsets: bool = False               # the offset form (GGUF's 4-bit blocks): float32 scales and mins
    gemv_math: str | None = None        # None: the op's choice (f16x2 for a half-precision row, else f32)
    bits: int = 4                       # 8: byte values (GGUF's wider types repacked)
    prepare_x: bool = False             # the f16x2 GEMV with x's pairs made before the kernel (x_amax given)

    def __str__(self):
        form = "-min" if self.offsets else ""
        math = f"-{self.gemv_math}" if self.gemv_math else ""
        width = "" if self.bits == 4 else f"-u{self.bits}"
        prep = "-prep" if self.prepare_x else ""
        return (f"{self.m}x{self.k}x{self.n}-g{self.group_size}{form}-{self.dtype}-ns{self.num_splits}"
                f"-it{self.slabs_per_iter}{math}{width}{prep}")


def make_inputs(case: MatmulCase):
    """x, qweight, scales, and the zeros (uint8, 0..2**bits - 1) or, in the offset form, the mins (floats of
    either sign, scales and mins float32 as the GGUF loader holds them); random values, scales > 0; and q."""
    rng = np.random.default_rng(zlib.crc32(str(case).encode()))
    levels = 1 << case.bits
    q = rng.integers(0, levels, (case.k, case.n), dtype=np.uint8)
    groups = case.k // case.group_size
    dtype = jnp.dtype(case.dtype)
    affine_dtype = jnp.float32 if case.offsets else dtype
    scales = jnp.asarray(rng.uniform(0.005, 0.05, (groups, case.n)) * 16 / levels, affine_dtype)
    if case.offsets:
        b = jnp.asarray(rng.uniform(-0.4, 0.1, (groups, case.n)), jnp.float32)
    else:
        b = jnp.asarray(rng.integers(0, levels, (groups, case.n)), jnp.uint8)
    x = jnp.asarray(rng.standard_normal((case.m, case.k)), dtype)
    return x, jnp.asarray(pack_bits(q, case.bits)), scales, b, q


def amax_of(x):
    """max |x| f32[1] of a one-row x: int4_matmul's x_amax."""
    return jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1)


def affine(case: MatmulCase, b) -> dict:
    """The zeros= or mins= keyword for the case's form."""
    return {"mins": b} if case.offsets else {"zeros": b}


CASES = [
    MatmulCase(1, 256, 128, 128),                   # one decode row (the GEMV kernel), one group per slab
    MatmulCase(1, 256, 128, 32, num_splits=2),      # GEMV: four groups per slab, K split in two (f32 partials)
    MatmulCase(1, 384, 64, 64, "bfloat16"),         # GEMV, bf16, three slabs in one split
    MatmulCase(1, 512, 128, 32, num_splits=1, slabs_per_iter=2),    # GEMV loading two slabs an iteration
    MatmulCase(3, 256, 128, 32, num_splits=2),      # the dot kernel from two rows: 3 in a 16-row tile, K split
    MatmulCase(20, 512, 192, 64, "bfloat16"),       # the dot kernel: rows past one 16-row tile, N not / 128
    MatmulCase(5, 256, 64, 256, num_splits=1),      # one group over all of K (per-channel)
    MatmulCase(1, 256, 128, 32, num_splits=2, offsets=True),           # GEMV, offsets, K split
    MatmulCase(1, 384, 64, 32, "bfloat16", offsets=True),              # GEMV, offsets, bf16
    MatmulCase(1, 512, 128, 32, num_splits=1, slabs_per_iter=2, offsets=True),
    MatmulCase(3, 256, 128, 32, num_splits=2, offsets=True),           # the dot kernel, offsets
    MatmulCase(20, 512, 192, 32, "bfloat16", offsets=True),
    MatmulCase(1, 512, 128, 128, "bfloat16", num_splits=2),              # f16x2 GEMV: lanes summed, K split
    MatmulCase(1, 512, 128, 32, "bfloat16", num_splits=1),               # f16x2: two calls a word, zero points
    MatmulCase(1, 512, 64, 256, "bfloat16"),                             # f16x2: a group over two slabs
    MatmulCase(1, 512, 128, 64, "bfloat16", num_splits=2, slabs_per_iter=2),   # f16x2, two slabs an iteration
    MatmulCase(1, 768, 128, 128, "bfloat16", num_splits=2),              # f16x2: x's scale read in 256 + 128 rows
    # the f16x2 GEMV on x prepared before the kernel (prepare_gemv_x), by both forms
    *(MatmulCase(1, 512, 128, g, "bfloat16", num_splits=ns, offsets=o, prepare_x=True)
      for g, ns, o in ((128, 2, False), (32, 1, False), (64, 2, True), (256, 1, False), (32, 4, True))),
    MatmulCase(1, 512, 128, 64, "bfloat16", num_splits=2, slabs_per_iter=2, prepare_x=True),
    MatmulCase(1, 384, 64, 64, "bfloat16", gemv_math="f32"),             # the f32 GEMV on a bf16 row
    MatmulCase(1, 384, 64, 32, "bfloat16", offsets=True, gemv_math="f32"),
    MatmulCase(1, 256, 128, 16, "bfloat16", num_splits=2),               # groups of 16: the f32 GEMV
    # 8-bit values: 64-row slabs, bytes 0-1 masked in place and 2-3 after the shift
    MatmulCase(1, 256, 128, 16, offsets=True, num_splits=2, bits=8),    # GEMV, four groups a slab, K split
    MatmulCase(1, 192, 64, 32, "bfloat16", offsets=True, bits=8),       # GEMV, bf16, three slabs
    MatmulCase(1, 256, 128, 64, num_splits=1, slabs_per_iter=2, bits=8),   # zero points, two slabs an iteration
    MatmulCase(1, 256, 128, 128, "bfloat16", bits=8),                   # a group over two slabs
    MatmulCase(3, 256, 128, 16, offsets=True, num_splits=2, bits=8),    # the dot kernel
    MatmulCase(20, 320, 192, 32, "bfloat16", offsets=True, bits=8),
]
CASES += gpu_only(MatmulCase(m, 4096, n, 128, "bfloat16") for m in (1, 3, 8, 64) for n in (6144, 4096))
CASES += gpu_only([MatmulCase(1, 14336, 4096, 128, "bfloat16"), MatmulCase(256, 4096, 28672, 128, "bfloat16")])
CASES += gpu_only(MatmulCase(m, 4096, n, 32, "bfloat16", offsets=True) for m in (1, 8) for n in (6144, 28672))
CASES += gpu_only(MatmulCase(1, k, n, g, "bfloat16", offsets=g == 32, gemv_math=math)
                  for k, n in ((4096, 6144), (14336, 4096)) for g in (32, 128) for math in ("f32", "f16x2-jnp"))
CASES += gpu_only([MatmulCase(1, 4096, 28672, 128, "bfloat16")])
CASES += gpu_only(MatmulCase(m, k, n, g, "bfloat16", offsets=True, bits=8)
                  for m in (1, 8) for k, n in ((4096, 6144), (14336, 4096)) for g in (16, 32))


class TestInt4Matmul:
    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_matches_reference(self, case):
        x, qweight, scales, b, _ = make_inputs(case)
        ref = int4_matmul_reference(x, qweight, scales, **affine(case, b), bits=case.bits)
        block_n = None if case.n % 128 == 0 else 64
        out = int4_matmul(x, qweight, scales, **affine(case, b), num_splits=case.num_splits, block_n=block_n,
                          slabs_per_iter=case.slabs_per_iter, gemv_math=case.gemv_math, bits=case.bits,
                          x_amax=amax_of(x) if case.prepare_x else None, interpret=INTERPRET)
        assert out.shape == (case.m, case.n) and out.dtype == x.dtype
        assert bool(jnp.all(jnp.isfinite(out)))
        assert rel_err(out, ref) <= TOL[case.dtype]

    @pytest.mark.parametrize("prepare_x", [False, True], ids=["in-kernel", "prepared"])
    @pytest.mark.parametrize("offsets", [False, True], ids=["zeros", "mins"])
    @pytest.mark.parametrize("magnitude", [1e4, 1e-6])
    def test_f16x2_scales_the_row_into_range(self, magnitude, offsets, prepare_x):
        """Rows far outside float16's comfortable range (products past 65504, values below its normals): the
        power-of-two scale (each split's, or the row's when prepared) keeps the f16x2 GEMV as close to the
        reference as at unit scale."""
        case = MatmulCase(1, 256, 128, 32 if offsets else 128, "bfloat16", offsets=offsets)
        x, qweight, scales, b, _ = make_inputs(case)
        x = (x.astype(jnp.float32) * magnitude).astype(jnp.bfloat16)
        ref = int4_matmul_reference(x, qweight, scales, **affine(case, b))
        out = int4_matmul(x, qweight, scales, **affine(case, b), gemv_math="f16x2",
                          x_amax=amax_of(x) if prepare_x else None, interpret=INTERPRET)
        assert bool(jnp.all(jnp.isfinite(out))) and rel_err(out, ref) <= TOL["bfloat16"]
        zero = int4_matmul(jnp.zeros_like(x), qweight, scales, **affine(case, b),
                           x_amax=jnp.zeros(1) if prepare_x else None, interpret=INTERPRET)
        assert not bool(jnp.any(zero))

    @pytest.mark.parametrize("prepare_x", [False, True], ids=["in-kernel", "prepared"])
    @pytest.mark.parametrize("outlier", [1e3, 3e4])
    def test_f16x2_keeps_small_values_beside_an_outlier(self, outlier, prepare_x):
        """One element of x far above the rest (LLMs' massive activations) sets the power-of-two scale (its split's,
        or the row's when prepared); its weights are zero (q = z), so the output is the small values' sum alone,
        computed at that scale: still as close to the reference as a row without the outlier."""
        case = MatmulCase(1, 512, 128, 128, "bfloat16")
        x, _, scales, b, q = make_inputs(case)
        q = q.copy()
        q[37] = np.asarray(b[0]).astype(np.uint8)                 # row 37 (group 0): q = z, zero weights
        qweight = jnp.asarray(pack_int4(q))
        x = x.at[0, 37].set(outlier)
        ref = int4_matmul_reference(x, qweight, scales, zeros=b)
        out = int4_matmul(x, qweight, scales, zeros=b, num_splits=1, gemv_math="f16x2",
                          x_amax=amax_of(x) if prepare_x else None, interpret=INTERPRET)
        assert rel_err(out, ref) <= TOL["bfloat16"], rel_err(out, ref)

    @pytest.mark.parametrize("offsets", [False, True], ids=["zeros", "mins"])
    @pytest.mark.parametrize("factor", [1 / 8, 1.0, 64.0, 4096.0])
    def test_prepared_x_takes_any_bound_near_its_maximum(self, factor, offsets):
        """x_amax is a bound of |x| a norm gives from its own reduction, not the exact maximum: any value within a
        few powers of two of it gives the same result within bf16's tolerance (above it down to float16's normals;
        below it by up to 16x, as far as a lane's four products stay in float16's range)."""
        case = MatmulCase(1, 512, 128, 32 if offsets else 128, "bfloat16", num_splits=2, offsets=offsets)
        x, qweight, scales, b, _ = make_inputs(case)
        ref = int4_matmul_reference(x, qweight, scales, **affine(case, b))
        out = int4_matmul(x, qweight, scales, **affine(case, b), x_amax=amax_of(x) * factor, interpret=INTERPRET)
        assert bool(jnp.all(jnp.isfinite(out))) and rel_err(out, ref) <= TOL["bfloat16"], rel_err(out, ref)

    def test_prepared_x_only_for_the_f16x2_gemv(self):
        """x's pairs are the f16x2 GEMV's operands: asking for them elsewhere (the f32 GEMV, the dot kernel) is an
        error, not a silent no-op."""
        for case in (MatmulCase(1, 256, 128, 128, "bfloat16", gemv_math="f32"),
                     MatmulCase(3, 256, 128, 128, "bfloat16"), MatmulCase(1, 256, 128, 128)):
            x, qweight, scales, b, _ = make_inputs(case)
            with pytest.raises(ValueError, match="x_amax"):
                int4_matmul(x, qweight, scales, zeros=b, gemv_math=case.gemv_math, x_amax=amax_of(x),
                            interpret=INTERPRET)

    def test_f16x2_only_for_half_rows_and_groups_of_32_up(self):
        """A float32 row keeps float32 math (a float32 model computes in float32); groups of 16 too."""
        assert use_f16x2(jnp.bfloat16, 32) and use_f16x2(jnp.float16, 128)
        assert not use_f16x2(jnp.float32, 128) and not use_f16x2(jnp.bfloat16, 16)
        case = MatmulCase(1, 256, 128, 16, "bfloat16")
        x, qweight, scales, b, _ = make_inputs(case)
        with pytest.raises(ValueError, match="groups of 32"):
            int4_matmul(x, qweight, scales, b, gemv_math="f16x2", interpret=INTERPRET)
        with pytest.raises(ValueError, match="gemv_math"):
            int4_matmul(x, qweight, scales, b, gemv_math="f8", interpret=INTERPRET)

    @pytest.mark.skipif(INTERPRET, reason="PTX runs only on a GPU (interpret mode runs the jnp form)")
    @pytest.mark.parametrize("offsets", [False, True], ids=["zeros", "mins"])
    @pytest.mark.parametrize("prepare_x", [False, True], ids=["in-kernel", "prepared"])
    def test_f16x2_ptx_equals_its_jnp_form(self, offsets, prepare_x):
        """On the GPU: the PTX and the jnp form of the f16x2 GEMV, both compiled, agree to float16's last bits
        (the PTX's FMA rounds once, the jnp form twice), at llama3-8b's qkv size."""
        case = MatmulCase(1, 4096, 6144, 32 if offsets else 128, "bfloat16", offsets=offsets)
        x, qweight, scales, b, _ = make_inputs(case)
        amax = amax_of(x) if prepare_x else None
        ptx = int4_matmul(x, qweight, scales, **affine(case, b), gemv_math="f16x2", x_amax=amax)
        emulated = int4_matmul(x, qweight, scales, **affine(case, b), gemv_math="f16x2-jnp", x_amax=amax)
        assert rel_err(ptx, emulated) <= 2e-3

    def test_packing_round_trip_and_layout(self):
        """pack_int4 then unpack_int4 gives the values back; nibble j of int32 row 16t + r is input row
        128t + 16j + r (the layout the kernel's dots rely on)."""
        q = np.random.default_rng(0).integers(0, 16, (256, 3), dtype=np.uint8)
        packed = pack_int4(q)
        assert packed.shape == (32, 3) and packed.dtype == np.int32
        assert (np.asarray(unpack_int4(jnp.asarray(packed))) == q).all()
        word = int(packed[16 + 5, 2]) & 0xFFFFFFFF                       # slab 1, row r = 5
        assert [(word >> (4 * j)) & 15 for j in range(8)] == [q[128 + 16 * j + 5, 2] for j in range(8)]
        # bytes: byte j of int32 row 16t + r is input row 64t + 16j + r
        q8 = np.random.default_rng(1).integers(0, 256, (128, 3), dtype=np.uint8)
        packed8 = pack_bits(q8, 8)
        assert packed8.shape == (32, 3) and (np.asarray(unpack_bits(jnp.asarray(packed8), 8)) == q8).all()
        word = int(packed8[16 + 5, 1]) & 0xFFFFFFFF
        assert [(word >> (8 * j)) & 255 for j in range(4)] == [q8[64 + 16 * j + 5, 1] for j in range(4)]

    def test_dequantize_is_affine_per_group(self):
        case = MatmulCase(1, 128, 4, 32)
        _, qweight, scales, zeros, q = make_inputs(case)
        w = np.asarray(dequantize_int4(qweight, scales, zeros))
        group = np.arange(128) // 32
        expect = (q.astype(np.float32) - np.asarray(zeros)[group]) * np.asarray(scales)[group]
        np.testing.assert_allclose(w, expect, rtol=1e-6)
        case = MatmulCase(1, 128, 4, 32, offsets=True)
        _, qweight, scales, mins, q = make_inputs(case)
        w = np.asarray(dequantize_int4(qweight, scales, mins=mins))
        expect = q.astype(np.float32) * np.asarray(scales)[group] + np.asarray(mins)[group]
        np.testing.assert_array_equal(w, expect)

    @pytest.mark.parametrize("k,group,ok", [(4096, 128, True), (4096, 32, True), (4096, 4096, True),
                                            (4096, 96, False), (576, 32, False), (4864, 128, True)])
    def test_group_sizes(self, k, group, ok):
        assert (check_group_size(k, group) is None) == ok
        assert check_group_size(576, 32, bits=8) is None and check_group_size(576, 64, bits=8) is None
        assert check_group_size(608, 32, bits=8) is not None

    def test_rejects_bad_inputs(self):
        case = MatmulCase(1, 256, 128, 128)
        x, qweight, scales, zeros, _ = make_inputs(case)
        with pytest.raises(ValueError, match="qweight"):
            int4_matmul(x[:, :128], qweight, scales, zeros, interpret=INTERPRET)
        with pytest.raises(ValueError, match="scales"):
            int4_matmul(x, qweight, scales[:, :64], zeros, interpret=INTERPRET)
        with pytest.raises(ValueError, match="group size"):
            int4_matmul(x, qweight, jnp.ones((32, 128)), jnp.ones((32, 128), jnp.uint8), interpret=INTERPRET)  # G 8
        with pytest.raises(ValueError, match="integer zero points"):
            int4_matmul(x, qweight, scales, zeros.astype(jnp.float32), interpret=INTERPRET)
        for both in ({}, {"zeros": zeros, "mins": zeros}):
            with pytest.raises(ValueError, match="zero points .* or the offsets"):
                int4_matmul(x, qweight, scales, interpret=INTERPRET, **both)
        with pytest.raises(ValueError, match="bits 5"):
            int4_matmul(x, qweight, scales, zeros, bits=5, interpret=INTERPRET)
        with pytest.raises(ValueError, match=r"int32 \[K/4, N\]"):                # 4-bit words read as bytes
            int4_matmul(x, qweight, scales, zeros, bits=8, interpret=INTERPRET)
        x8, qweight8, scales8, zeros8, _ = make_inputs(MatmulCase(1, 256, 128, 128, "bfloat16", bits=8))
        with pytest.raises(ValueError, match="8-bit ones take f32"):
            int4_matmul(x8, qweight8, scales8, zeros8, bits=8, gemv_math="f16x2", interpret=INTERPRET)

    def test_tiling_fills_the_gpu_at_decode_sizes(self):
        """choose_int4_tiling: llama3-8b's decode GEMVs get about eight programs of 64 columns per SM of the
        H100's 132 (the dot kernel four of 128); up to GEMV_MAX_ROWS rows all go to one program (the GEMV
        kernel), more are tiles of 16 to 64. The GEMV's f16x2 form takes four programs of 128 columns, the same
        splits, and N not a multiple of 128 falls back to 64 columns."""
        for k, n, splits in ((4096, 6144, 8), (4096, 4096, 16), (14336, 4096, 16), (4096, 28672, 2)):
            assert choose_int4_tiling(1, k, n, f16x2=True) == (1, 128, splits)
        assert choose_int4_tiling(1, 512, 192, f16x2=True) == choose_int4_tiling(1, 512, 192) == (1, 64, 4)
        assert choose_int4_tiling(1, 4096, 6144) == (1, 64, 8)          # 96 column tiles x 8 splits
        assert choose_int4_tiling(1, 4096, 4096) == (1, 64, 16)         # 64 x 16
        assert choose_int4_tiling(1, 14336, 4096) == (1, 64, 16)        # 112 slabs: 16 divides
        assert choose_int4_tiling(1, 4096, 28672) == (1, 64, 2)
        assert choose_int4_tiling(GEMV_MAX_ROWS, 4096, 4096) == (GEMV_MAX_ROWS, 64, 16)
        assert choose_int4_tiling(GEMV_MAX_ROWS + 1, 4096, 4096) == (16, 128, 16)
        assert choose_int4_tiling(256, 4096, 28672) == (64, 128, 1)

    def test_lowers_to_triton(self):
        """Lowered for the CUDA platform (Pallas -> Triton IR; no GPU needed): one Triton call, 4- and 8-bit."""
        s = jax.ShapeDtypeStruct
        op = functools.partial(int4_matmul, interpret=False)
        for rows in (1, GEMV_MAX_ROWS + 1):                            # the GEMV kernel, the dot kernel
            assert lowered_calls(op, s((rows, 4096), jnp.bfloat16), s((512, 6144), jnp.int32),
                                 s((32, 6144), jnp.bfloat16), s((32, 6144), jnp.uint8)) == (1,)
            offsets = lambda x, w, sc, m: op(x, w, sc, mins=m)              # noqa: E731
            assert lowered_calls(offsets, s((rows, 4096), jnp.bfloat16), s((512, 6144), jnp.int32),
                                 s((128, 6144), jnp.float32), s((128, 6144), jnp.float32)) == (1,)
            bytes_ = lambda x, w, sc, m: op(x, w, sc, mins=m, bits=8)       # noqa: E731
            assert lowered_calls(bytes_, s((rows, 4096), jnp.bfloat16), s((1024, 6144), jnp.int32),
                                 s((256, 6144), jnp.float32), s((256, 6144), jnp.float32)) == (1,)
        # x's operands made before the GEMV: by XLA from a bound (x_amax), or by the norm's kernel (x_pairs)
        from jaxpaged.pallas_kernels.int4_operands import rms_norm_gemv_x
        weights = (s((512, 6144), jnp.int32), s((32, 6144), jnp.bfloat16), s((32, 6144), jnp.uint8))
        bound = lambda x, w, sc, z: op(x, w, sc, z, x_amax=jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1))  # noqa
        assert lowered_calls(bound, s((1, 4096), jnp.bfloat16), *weights) == (1,)

        def normed(h, g, w, sc, z):
            y, pairs, amax = rms_norm_gemv_x(h, g, eps=1e-6, interpret=False)
            return op(y, w, sc, z, x_pairs=(pairs, amax))
        assert lowered_calls(normed, s((1, 4096), jnp.bfloat16), s((4096,), jnp.bfloat16), *weights) == (2,)
        qwen2_7b = (s((448, 4608), jnp.int32), s((28, 4608), jnp.bfloat16), s((28, 4608), jnp.uint8))
        assert lowered_calls(normed, s((1, 3584), jnp.bfloat16), s((3584,), jnp.bfloat16), *qwen2_7b) == (2,)

        # the SwiGLU product's operands from the gate/up GEMV's partial sums (llama3-8b's MLP: 2 and 16 splits)
        from jaxpaged.pallas_kernels.int4_operands import silu_mul_gemv_x

        def mlp(x, gu_w, gu_s, gu_z, w, sc, z):
            partials = op(x, gu_w, gu_s, gu_z, keep_splits=True)
            x_pairs = silu_mul_gemv_x(partials, dtype=jnp.bfloat16, interpret=False)
            return op(jnp.zeros((1, 14336), jnp.bfloat16), w, sc, z, x_pairs=x_pairs)
        from jaxpaged.pallas_kernels.int4_operands import rope_qkv

        def qkv(x, w, sc, z, cos, sin):
            return rope_qkv(op(x, w, sc, z, keep_splits=True), cos, sin, q_heads=32, kv_heads=8, dtype=jnp.bfloat16,
                            interpret=False)
        assert lowered_calls(qkv, s((1, 4096), jnp.bfloat16), *weights, s((1, 64), jnp.float32),
                             s((1, 64), jnp.float32)) == (2,)

        def qkv_normed(x, w, sc, z, cos, sin, bias, qn, kn):                # Qwen2's bias, Qwen3's norms
            return rope_qkv(op(x, w, sc, z, keep_splits=True), cos, sin, bias, (qn, kn), q_heads=32, kv_heads=8,
                            dtype=jnp.bfloat16, eps=1e-6, interpret=False)
        def qkv_written(x, w, sc, z, cos, sin, pool, slot):              # k and v stored into the pool
            return rope_qkv(op(x, w, sc, z, keep_splits=True), cos, sin, kv_write=(pool, 3, slot, None), q_heads=32,
                            kv_heads=8, dtype=jnp.bfloat16, interpret=False)
        assert lowered_calls(qkv_written, s((1, 4096), jnp.bfloat16), *weights, s((1, 64), jnp.float32),
                             s((1, 64), jnp.float32), s((4, 2, 64, 8, 16, 128), jnp.bfloat16),
                             s((1,), jnp.int32)) == (2,)
        assert lowered_calls(qkv_normed, s((1, 4096), jnp.bfloat16), *weights, s((1, 64), jnp.float32),
                             s((1, 64), jnp.float32), s((6144,), jnp.bfloat16), s((128,), jnp.bfloat16),
                             s((128,), jnp.bfloat16)) == (2,)
        assert lowered_calls(mlp, s((1, 4096), jnp.bfloat16), s((512, 28672), jnp.int32), s((32, 28672), jnp.bfloat16),
                             s((32, 28672), jnp.uint8), s((1792, 4096), jnp.int32), s((112, 4096), jnp.bfloat16),
                             s((112, 4096), jnp.uint8)) == (3,)


@pytest.mark.parametrize("plus_one", [False, True], ids=["llama-norm", "gemma-norm"])
def test_a_norms_bound_feeds_the_w4a16_decode_row(plus_one):
    """The model's path for a one-row bf16 decode: RMSNorm's bound (its inverse RMS times max |x w|, from a
    reduction beside its mean's) bounds its output (to bf16's rounding), and Int4Linear given it takes the
    prepared f16x2 GEMV: equal to the same layer without the bound, and to the dequantized reference, within
    bf16's tolerance."""
    from jaxpaged.models.decoder import Int4Linear, RMSNorm, RuntimeOptions
    k, n, g = 512, 128, 128
    rng = np.random.default_rng(7)
    h = jnp.asarray(rng.standard_normal((1, k)) * 3, jnp.bfloat16).at[0, 5].set(200.0)    # an outlier
    norm = RMSNorm(1e-6, jnp.bfloat16, plus_one)
    w = jnp.asarray(rng.uniform(-2, 2, k), jnp.bfloat16)
    x, bound = norm.apply({"params": {"scale": w}}, h, bound=True)
    assert x.dtype == jnp.bfloat16 and bound.shape == (1,)
    assert float(jnp.max(jnp.abs(x.astype(jnp.float32)))) <= float(bound[0]) * (1 + 2 ** -7)
    assert float(jnp.max(jnp.abs(x.astype(jnp.float32)))) >= float(bound[0]) * (1 - 2 ** -7)
    assert (norm.apply({"params": {"scale": w}}, h) == x).all()
    q = rng.integers(0, 16, (k, n), dtype=np.uint8)
    params = {"qweight": jnp.asarray(pack_int4(q)),
              "scales": jnp.asarray(rng.uniform(0.005, 0.05, (k // g, n)), jnp.bfloat16),
              "zeros": jnp.asarray(rng.integers(0, 16, (k // g, n)), jnp.uint8)}
    layer = Int4Linear(n, k, g, False, False, jnp.bfloat16, RuntimeOptions("pallas", interpret=INTERPRET))
    prepared = layer.apply({"params": params}, x, bound)
    plain = layer.apply({"params": params}, x)
    ref = int4_matmul_reference(x, params["qweight"], params["scales"], zeros=params["zeros"])
    assert rel_err(prepared, ref) <= TOL["bfloat16"] and rel_err(plain, ref) <= TOL["bfloat16"]
    assert rel_err(prepared, plain) <= TOL["bfloat16"]


def _f16_pair_values(pairs):
    """int32 words of float16 pairs -> their (low, high) halves as float32."""
    words = np.asarray(pairs).astype(np.uint32)
    return ((words & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32),
            (words >> 16).astype(np.uint16).view(np.float16).astype(np.float32))


@pytest.mark.parametrize("k", [128, 512, 896])               # 896: 7 slabs, in chunks of 4, 2 and 1 (Qwen2-7B's 28)
@pytest.mark.parametrize("plus_one", [False, True], ids=["llama-norm", "gemma-norm"])
def test_rms_norm_gemv_x_is_the_norm_and_its_gemv_operands(plus_one, k):
    """rms_norm_gemv_x: one kernel for RMSNorm's output (as models/decoder.py computes it), its maximum, and the f16x2
    GEMV's float16 pairs of it (prepare_gemv_x's), which int4_matmul takes as x_pairs to the same result."""
    from jaxpaged.models.decoder import RMSNorm
    from jaxpaged.pallas_kernels.int4_matmul import prepare_gemv_x
    from jaxpaged.pallas_kernels.int4_operands import norm_gemv_x_supported, rms_norm_gemv_x
    rng = np.random.default_rng(k + plus_one)
    x = jnp.asarray(rng.standard_normal((1, k)) * 3, jnp.bfloat16).at[0, 3].set(150.0)
    w = jnp.asarray(rng.uniform(-2, 2, k), jnp.bfloat16)
    y, pairs, amax = rms_norm_gemv_x(x, w, eps=1e-6, plus_one=plus_one, interpret=INTERPRET)
    ref = RMSNorm(1e-6, jnp.bfloat16, plus_one).apply({"params": {"scale": w}}, x)
    assert y.dtype == jnp.bfloat16 and pairs.shape == (1, k // 2) and amax.shape == (1,)
    assert rel_err(y, ref) <= 2 ** -8
    assert abs(float(amax[0]) - float(jnp.max(jnp.abs(ref.astype(jnp.float32))))) <= float(amax[0]) * 2 ** -7
    expect, _ = prepare_gemv_x(ref, 128, False, amax)
    for got, want in zip(_f16_pair_values(pairs), _f16_pair_values(expect)):
        np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)
    case = MatmulCase(1, k, 128, 128, "bfloat16", num_splits=1)
    _, qweight, scales, b, _ = make_inputs(case)
    out = int4_matmul(y, qweight, scales, zeros=b, x_pairs=(pairs, amax), interpret=INTERPRET)
    assert rel_err(out, int4_matmul_reference(y, qweight, scales, zeros=b)) <= TOL["bfloat16"]
    assert norm_gemv_x_supported(4096) and norm_gemv_x_supported(3584) and not norm_gemv_x_supported(64)
    assert not norm_gemv_x_supported(128 * 129)
    with pytest.raises(ValueError, match="whole slabs"):
        rms_norm_gemv_x(jnp.zeros((1, 320), jnp.bfloat16), jnp.ones(320, jnp.bfloat16), eps=1e-6)
    with pytest.raises(ValueError, match="x_pairs"):
        int4_matmul(y, qweight, scales, zeros=b, x_pairs=(pairs, amax), x_amax=amax, interpret=INTERPRET)


@pytest.mark.parametrize("parts", [1, 3])
def test_silu_mul_gemv_x_is_the_swiglu_product_and_its_gemv_operands(parts):
    """silu_mul_gemv_x: from the gate/up GEMV's partial sums (parts of them, or its output), silu(gate) * up as MLP
    computes it in bf16, each 128-row slab's maximum of it and the float16 pairs scaled by that slab's bound, which
    int4_matmul takes as x_pairs (one bound a slab, with splits of several slabs) to the dequantized reference's
    result."""
    from jaxpaged.pallas_kernels.int4_operands import silu_mul_gemv_x
    inter, n = 896, 128
    slabs = inter // 128
    rng = np.random.default_rng(parts)
    gate_up = rng.standard_normal((parts, 1, 2 * inter)) * 2
    gate_up[0, 0, [5, inter + 5]] = 30.0                                                 # an outlier in one slab
    gate_up = jnp.asarray(gate_up, jnp.float32 if parts > 1 else jnp.bfloat16)
    pairs, amax = silu_mul_gemv_x(gate_up, dtype=jnp.bfloat16, interpret=INTERPRET)
    gate, up = jnp.split(jnp.sum(gate_up.astype(jnp.float32), axis=0).astype(jnp.bfloat16), 2, axis=-1)
    hidden = jax.nn.silu(gate) * up                                                      # MLP's, in bf16
    slab_max = np.abs(np.asarray(hidden, np.float32)[0]).reshape(slabs, -1).max(axis=1)
    assert pairs.shape == (1, inter // 2) and amax.shape == (slabs,)
    np.testing.assert_allclose(np.asarray(amax), slab_max, rtol=2 ** -6)
    assert slab_max[0] > 8 * slab_max[1:].max()                                          # the slabs' bounds differ
    values = np.asarray(hidden, np.float32)[0].reshape(-1, 8, 16)                         # [slab, j, r]
    scale = 2.0 ** (5 - np.floor(np.log2(np.asarray(amax))))                              # [slab]
    lo, hi = _f16_pair_values(pairs.reshape(-1, 4, 16))
    odd = np.asarray([1, 1 / 16, 1, 1 / 16])[None, :, None]
    np.testing.assert_allclose(lo, values[:, :4] * scale[:, None, None] * odd, rtol=2 ** -6, atol=1e-3)
    np.testing.assert_allclose(hi, values[:, 4:] * scale[:, None, None] * odd, rtol=2 ** -6, atol=1e-3)
    q = rng.integers(0, 16, (inter, n), dtype=np.uint8)
    w = jnp.asarray(pack_int4(q))
    ref = None
    for g in (32, 128):                                                                  # groups within a slab, or one
        sc = jnp.asarray(rng.uniform(0.005, 0.05, (inter // g, n)), jnp.bfloat16)
        z = jnp.asarray(rng.integers(0, 16, (inter // g, n)), jnp.uint8)
        ref = int4_matmul_reference(hidden, w, sc, zeros=z)
        for splits, per_iter in ((1, 1), (7, 1), (1, 7)):      # the bounds loaded an iteration ahead, 1 or 7 a time
            out = int4_matmul(hidden, w, sc, zeros=z, x_pairs=(pairs, amax), num_splits=splits,
                              slabs_per_iter=per_iter, interpret=INTERPRET)
            assert rel_err(out, ref) <= TOL["bfloat16"], (g, splits, per_iter)
    with pytest.raises(ValueError, match="one for each"):
        int4_matmul(hidden, w, sc, zeros=z, x_pairs=(pairs, amax[:2]), interpret=INTERPRET)
    with pytest.raises(ValueError, match="whole slabs"):
        silu_mul_gemv_x(gate_up[:, :, :200], dtype=jnp.bfloat16, interpret=INTERPRET)


@pytest.mark.parametrize("parts,dtype,bias,qk_norm", [(1, "bfloat16", False, False), (3, "bfloat16", False, False),
                                                      (2, "float16", False, False), (2, "bfloat16", True, False),
                                                      (2, "bfloat16", False, True)])
def test_rope_qkv_is_the_attention_layers_q_k_v(parts, dtype, bias, qk_norm):
    """rope_qkv: from the q/k/v GEMV's partial sums (parts of them, or its output), a bias (Qwen2's) and q/k norms
    (Qwen3's), q and k rotated and v as models/decoder.py's Attention computes them in half precision (the splits'
    sum rounded, the bias added, each head normed, then _rotate)."""
    from jaxpaged.models.decoder import RMSNorm, _rotate
    from jaxpaged.pallas_kernels.int4_operands import rope_qkv
    hq, hk, d = 4, 2, 128
    dt = jnp.dtype(dtype)
    rng = np.random.default_rng(parts)
    qkv_parts = jnp.asarray(rng.standard_normal((parts, 1, (hq + 2 * hk) * d)) * 3,
                            jnp.float32 if parts > 1 else dt)
    angles = rng.uniform(0, 100, (1, d // 2))
    cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
    b = jnp.asarray(rng.standard_normal((hq + 2 * hk) * d), dt) if bias else None
    norms = tuple(jnp.asarray(rng.uniform(0.5, 2, d), dt) for _ in range(2)) if qk_norm else None
    q, k, v = rope_qkv(qkv_parts, cos, sin, b, norms, q_heads=hq, kv_heads=hk, dtype=dt, eps=1e-6 if qk_norm else None,
                       interpret=INTERPRET)
    qkv = jnp.sum(qkv_parts.astype(jnp.float32), axis=0).astype(dt)
    qkv = qkv + b if bias else qkv
    q_in, k_in = qkv[:, :hq * d].reshape(1, hq, d), qkv[:, hq * d:(hq + hk) * d].reshape(1, hk, d)
    if qk_norm:
        q_in, k_in = (RMSNorm(1e-6, dt).apply({"params": {"scale": w}}, x) for w, x in zip(norms, (q_in, k_in)))
    want = (_rotate(q_in, cos, sin), _rotate(k_in, cos, sin), qkv[:, (hq + hk) * d:].reshape(1, hk, d))
    for got, ref in zip((q, k, v), want):
        assert got.dtype == dt and got.shape == ref.shape
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=2 ** -7, atol=2 ** -7)
    with pytest.raises(ValueError, match="power-of-two"):
        rope_qkv(qkv_parts[:, :, :(hq + 2 * hk) * 96], cos[:, :48], sin[:, :48], q_heads=hq, kv_heads=hk, dtype=dt,
                 interpret=INTERPRET)


@pytest.mark.parametrize("dtype,cache,scales", [("float16", "float16", None), ("bfloat16", "bf16-bits", None),
                                                ("bfloat16", "e4m3", (0.5, 2.0))])
def test_rope_qkv_writes_k_and_v_as_write_kv_does(dtype, cache, scales):
    """rope_qkv's kv_write: k and v stored at the row's slot as write_kv stores them (the CPU's bf16 pool as its
    bits, an e4m3 pool divided by its scales), nothing else in the pool touched, and q as without it."""
    from jaxpaged.pallas_kernels import write_kv
    from jaxpaged.pallas_kernels._checks import CPU_BF16_CACHE_DTYPE, FP8_CACHE_DTYPE
    from jaxpaged.pallas_kernels.int4_operands import rope_qkv
    hq, hk, d = 4, 2, 64
    dt = jnp.dtype(dtype)
    cache_dtype = {"float16": jnp.float16, "bf16-bits": CPU_BF16_CACHE_DTYPE, "e4m3": FP8_CACHE_DTYPE}[cache]
    rng = np.random.default_rng(11)
    parts = jnp.asarray(rng.standard_normal((2, 1, (hq + 2 * hk) * d)), jnp.float32)
    angles = rng.uniform(0, 6, (1, d // 2))
    cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
    pool = jnp.asarray(rng.integers(0, 100, (3, 2, 5, hk, 8, d)), cache_dtype)           # [L, 2, B, K, S, D]
    slot = jnp.asarray([2 * 8 + 3], jnp.int32)
    kv_scales = None if scales is None else tuple(jnp.float32(x) for x in scales)
    q, k, v = rope_qkv(parts, cos, sin, q_heads=hq, kv_heads=hk, dtype=dt, interpret=INTERPRET)
    want = write_kv(pool, 1, k, v, slot, backend="pallas", interpret=INTERPRET, kv_scales=kv_scales)
    q_w, got = rope_qkv(parts, cos, sin, kv_write=(pool, 1, slot, kv_scales), q_heads=hq, kv_heads=hk, dtype=dt,
                        interpret=INTERPRET)
    assert (q_w == q).all() and got.dtype == pool.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int((np.asarray(got) != np.asarray(pool)).sum()) <= 2 * hk * d                # only the one slot


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_operand_kernels_equal_their_references(dtype):
    """pallas_kernels/int4_operands.py: each kernel against its plain-jnp reference on random inputs (outputs in
    dtype to one rounding step of it, float16 pairs to float16's, bounds to float32's)."""
    from jaxpaged.pallas_kernels import int4_operands as ops
    dt = jnp.dtype(dtype)
    rng = np.random.default_rng(21)
    tol = dict(rtol=2 ** -7, atol=1e-3)

    def close(got, want):
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            if g.dtype == jnp.int32:                     # float16 pairs
                for a, b in zip(_f16_pair_values(g), _f16_pair_values(w)):
                    np.testing.assert_allclose(a, b, **tol)
            else:
                np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), **tol)

    x = jnp.asarray(rng.standard_normal((1, 512)) * 3, dt)
    w = jnp.asarray(rng.uniform(-2, 2, 512), dt)
    for plus_one in (False, True):
        close(ops.rms_norm_gemv_x(x, w, eps=1e-6, plus_one=plus_one, interpret=INTERPRET),
              ops.rms_norm_gemv_x_reference(x, w, eps=1e-6, plus_one=plus_one))
    gate_up = jnp.asarray(rng.standard_normal((3, 1, 2 * 384)) * 2, jnp.float32)
    close(ops.silu_mul_gemv_x(gate_up, dtype=dt, interpret=INTERPRET), ops.silu_mul_gemv_x_reference(gate_up, dtype=dt))
    hq, hk, d = 4, 2, 64
    qkv = jnp.asarray(rng.standard_normal((2, 1, (hq + 2 * hk) * d)) * 3, jnp.float32)
    angles = rng.uniform(0, 50, (1, d // 2))
    cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((hq + 2 * hk) * d), dt)
    norms = tuple(jnp.asarray(rng.uniform(0.5, 2, d), dt) for _ in range(2))
    pool = jnp.zeros((2, 2, 4, hk, 8, d), dt)
    write = (pool, 1, jnp.asarray([13], jnp.int32), None)
    for args in ((), (bias,), (bias, norms), (None, norms, write)):
        kw = dict(q_heads=hq, kv_heads=hk, dtype=dt, eps=1e-6 if len(args) > 1 else None)
        close(ops.rope_qkv(qkv, cos, sin, *args, interpret=INTERPRET, **kw),
              ops.rope_qkv_reference(qkv, cos, sin, *args, **kw))


def test_int4_matmul_keeps_its_splits_partial_sums():
    """keep_splits: the splits' float32 partial sums, whose sum is the output (one split: the output itself)."""
    case = MatmulCase(1, 512, 128, 128, "bfloat16", num_splits=1)
    x, qweight, scales, b, _ = make_inputs(case)
    whole = int4_matmul(x, qweight, scales, zeros=b, num_splits=1, interpret=INTERPRET)
    one = int4_matmul(x, qweight, scales, zeros=b, num_splits=1, keep_splits=True, interpret=INTERPRET)
    assert one.shape == (1, 1, 128) and (one[0] == whole).all()
    parts = int4_matmul(x, qweight, scales, zeros=b, num_splits=4, keep_splits=True, interpret=INTERPRET)
    assert parts.shape == (4, 1, 128) and parts.dtype == jnp.float32
    assert rel_err(jnp.sum(parts, axis=0), whole) <= TOL["bfloat16"]


def test_int4_linear_takes_the_norm_kernels_operands_where_its_rows_are_in_order():
    """Int4Linear given rms_norm_gemv_x's operands (the tuple hint) runs the GEMV on them; with act order, whose
    packed rows follow a permutation of x's, it takes x itself: both equal the dequantized reference."""
    from jaxpaged.models.decoder import Int4Linear, RuntimeOptions
    from jaxpaged.pallas_kernels.int4_operands import rms_norm_gemv_x
    k, n, g = 256, 128, 128
    rng = np.random.default_rng(3)
    y, pairs, amax = rms_norm_gemv_x(jnp.asarray(rng.standard_normal((1, k)), jnp.bfloat16),
                                     jnp.asarray(rng.uniform(-2, 2, k), jnp.bfloat16), eps=1e-6, interpret=INTERPRET)
    q = rng.integers(0, 16, (k, n), dtype=np.uint8)
    params = {"qweight": jnp.asarray(pack_int4(q)),
              "scales": jnp.asarray(rng.uniform(0.005, 0.05, (k // g, n)), jnp.bfloat16),
              "zeros": jnp.asarray(rng.integers(0, 16, (k // g, n)), jnp.uint8)}
    opts = RuntimeOptions("pallas", interpret=INTERPRET)
    ref = int4_matmul_reference(y, params["qweight"], params["scales"], zeros=params["zeros"])
    out = Int4Linear(n, k, g, False, False, jnp.bfloat16, opts).apply({"params": params}, y, (pairs, amax))
    assert rel_err(out, ref) <= TOL["bfloat16"]
    perm = jnp.asarray(rng.permutation(k), jnp.int32)
    permuted = Int4Linear(n, k, g, True, False, jnp.bfloat16, opts).apply({"params": {**params, "perm": perm}}, y,
                                                                        (pairs, amax))
    ref_perm = int4_matmul_reference(y[:, perm], params["qweight"], params["scales"], zeros=params["zeros"])
    assert rel_err(permuted, ref_perm) <= TOL["bfloat16"]
