"""GGUF block formats dequantized in JAX equal the `gguf` package's numpy reference bit for bit, on random
blocks (every byte random, the float16 scale fields finite)."""
import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from conftest import random_gguf_blocks as random_blocks
from jaxpaged.quantization.gguf_blocks import BLOCK_SIZES, INT4_GROUP, INT4_TYPES, dequantize, int4_parts


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
