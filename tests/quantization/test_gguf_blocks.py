"""GGUF block formats dequantized in JAX equal the `gguf` package's numpy reference bit for bit, on random
blocks (every byte random, the float16 scale fields finite)."""
import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from conftest import random_gguf_blocks as random_blocks
from jaxpaged.quantization.gguf_blocks import (BLOCK_SIZES, INT4_GROUP, INT4_TYPES, dequantize, int4_parts,
                                               int8_group, int8_parts)


@pytest.mark.parametrize("qtype", sorted(BLOCK_SIZES))
def test_dequantize_equals_the_gguf_reference_bit_for_bit(qtype):
    raw = random_blocks(qtype, rows=3, blocks_per_row=4, seed=len(qtype) * 7 + ord(qtype[1]))
    expected = quants.dequantize(raw, GGMLQuantizationType[qtype])
    got = np.asarray(jax.jit(dequantize, static_argnums=1)(raw, qtype))
    assert got.dtype == np.float32 and got.shape == expected.shape == (3, 4 * BLOCK_SIZES[qtype][0])
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("qtype", INT4_TYPES)
def test_4bit_types_are_q_times_scale_plus_min(qtype):
    """int4_parts (the W4A16 kernel's offset form): q * scale + min per 32 weights is the reference's weight,
    bit for bit but for Q4_0's zeros (d * (q - 8) is -0 where d < 0: equal as numbers)."""
    raw = random_blocks(qtype, rows=3, blocks_per_row=2, seed=ord(qtype[-1]))
    q, scale, offset = (np.asarray(a) for a in jax.jit(int4_parts, static_argnums=1)(raw, qtype))
    k = 2 * BLOCK_SIZES[qtype][0]
    assert q.shape == (3, k) and q.dtype == np.uint8 and q.max() <= 15
    assert scale.shape == offset.shape == (3, k // INT4_GROUP) and scale.dtype == offset.dtype == np.float32
    got = (q.reshape(3, -1, INT4_GROUP) * scale[..., None] + offset[..., None]).reshape(3, k)
    expected = quants.dequantize(raw, GGMLQuantizationType[qtype])
    np.testing.assert_array_equal(got, expected)
    if qtype != "Q4_0":
        np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    with pytest.raises(ValueError, match="not a 4-bit type"):
        int4_parts(random_blocks("Q8_0", 1, 1, 0), "Q8_0")


@pytest.mark.parametrize("qtype,group", [(t, g) for t in sorted(BLOCK_SIZES) for g in (16, 32)
                                         if not (t == "Q6_K" and g == 32)])
def test_every_type_is_8bit_q_times_scale_plus_min(qtype, group):
    """int8_parts (the kernel's 8-bit offset form): q * scale + min per group is the reference's weight, equal as
    numbers (signed types' zeros may be -0 there) and bit for bit where no zero's sign differs."""
    raw = random_blocks(qtype, rows=3, blocks_per_row=2 if BLOCK_SIZES[qtype][0] == 256 else 8,
                        seed=ord(qtype[1]) * 3 + group)
    q, scale, offset = (np.asarray(a) for a in jax.jit(int8_parts, static_argnums=(1, 2))(raw, qtype, group))
    expected = quants.dequantize(raw, GGMLQuantizationType[qtype])
    k = expected.shape[1]
    assert q.shape == (3, k) and q.dtype == np.uint8
    assert scale.shape == offset.shape == (3, k // group) and scale.dtype == offset.dtype == np.float32
    got = (q.reshape(3, -1, group) * scale[..., None] + offset[..., None]).reshape(3, k)
    np.testing.assert_array_equal(got, expected)
    nonzero = expected != 0
    np.testing.assert_array_equal(got[nonzero].view(np.uint32), expected[nonzero].view(np.uint32))


def test_8bit_groups():
    assert int8_group({"Q4_K", "Q6_K"}) == 16 and int8_group({"Q8_0"}) == 32 and int8_group({"Q5_K", "Q4_K"}) == 32
    with pytest.raises(ValueError, match="group 32 for Q6_K"):
        int8_parts(random_blocks("Q6_K", 1, 1, 0), "Q6_K", 32)


def test_quantized_weights_round_trip_through_the_reference_quantizer():
    """Real weights quantized by the gguf package (the formats it can write) come back as it reads them."""
    w = np.random.default_rng(0).normal(0, 0.02, size=(8, 256)).astype(np.float32)
    for qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        raw = quants.quantize(w, GGMLQuantizationType[qtype])
        np.testing.assert_array_equal(np.asarray(dequantize(raw, qtype)),
                                      quants.dequantize(raw, GGMLQuantizationType[qtype]))


def test_unsupported_types_and_ragged_rows_are_refused():
    with pytest.raises(ValueError, match="not supported; supported: Q8_0"):
        dequantize(np.zeros((1, 34), np.uint8), "IQ2_XS")
    with pytest.raises(ValueError, match="multiple of 34 bytes"):
        dequantize(np.zeros((1, 35), np.uint8), "Q8_0")


@pytest.mark.parametrize("bits,types,in_features", [(4, ("Q4_0", "Q4_1"), 288), (8, ("Q8_0", "Q5_0"), 288),
                                                    (8, ("Q4_K", "Q6_K"), 512), (8, ("Q5_1", "Q5_K"), 256)])
def test_a_linear_layer_repacks_into_the_kernel_layout(bits, types, in_features):
    """models/loader.py's repack of one linear layer's parts (each of its own type, concatenated on the output
    axis): the kernel's layout dequantizes to the reference's weights, the input rows padded to the slab (128
    for 4-bit values, 64 for 8-bit) with zero weights."""
    from jaxpaged.models.loader import _gguf_repacked
    from jaxpaged.pallas_kernels.int4_matmul import dequantize_int4, slab_rows
    group = INT4_GROUP if bits == 4 else int8_group(types)
    parts = [(random_blocks(qtype, rows=4 + i, blocks_per_row=in_features // BLOCK_SIZES[qtype][0], seed=i), qtype)
             for i, qtype in enumerate(types)]
    expected = np.concatenate([quants.dequantize(raw, GGMLQuantizationType[qtype]) for raw, qtype in parts]).T
    out = _gguf_repacked(parts, in_features, bits, group)
    kp = in_features + (-in_features % slab_rows(bits))
    n = expected.shape[1]
    assert out["qweight"].shape == (kp * bits // 32, n) and out["scales"].shape == out["mins"].shape == (kp // group, n)
    w = np.asarray(dequantize_int4(out["qweight"], out["scales"], mins=out["mins"], bits=bits))
    np.testing.assert_array_equal(w[:in_features], expected)
    assert not w[in_features:].any()
