"""GGUF's quantized block formats, dequantized in JAX: the weights of a GGUF file can live on the device in
their blocks (a quarter to a half of bf16's bytes) and be expanded inside the program that uses them.

Each format packs `block_size` weights into `type_size` bytes (ggml's layouts; the `gguf` package's numpy
dequantizers are the reference, and every function here computes what they compute, operation for
operation in float32, so the results are equal bit for bit):

  Q8_0   32 weights in 34 bytes:  d f16, q int8[32]                                 w = q * d
  Q4_0   32 in 18:                d f16, 16 bytes of nibbles (low: 0-15, high: 16-31) w = d * (q - 8)
  Q4_1   32 in 20:                d f16, m f16, nibbles                              w = d * q + m
  Q5_0   32 in 22:                d f16, qh u32 (bit i: weight i's fifth bit), nibbles w = d * (q - 16)
  Q5_1   32 in 24:                d f16, m f16, qh u32, nibbles                       w = d * q + m
  Q4_K   256 in 144:              d f16, dmin f16, 12 bytes of eight 6-bit scales and mins, 128 bytes of
                                  nibbles (64 weights per 32 bytes: low nibbles first)  w = d*sc * q - dmin*mn
  Q5_K   256 in 176:              as Q4_K with qh[32] (bit j of byte i: weight 32 j + i's fifth bit)
  Q6_K   256 in 210:              ql[128] nibbles, qh[64] 2-bit pairs, scales int8[16], d f16
                                                                                     w = d*scale * (q - 32)

dequantize(raw, qtype) takes uint8[..., n * type_size] (a tensor's rows as the file stores them) and gives
float32[..., n * block_size]. Equal bit for bit on the CPU (tests/quantization); a GPU compiler may fuse the
multiply-adds of Q4_1, Q5_1 and the K formats into FMAs, one rounding fewer than numpy's.

The 4-bit formats (INT4_TYPES) are also one affine form, w = q * scale + min per 32 weights with scale and min
in float32: int4_parts gives those three, which the loader repacks into the W4A16 kernel's layout
(pallas_kernels/int4_matmul.py's offset form), so that a decode step reads the 4-bit weights inside the
matmul instead of expanding them first. q * scale + min is dequantize's value exactly: Q4_0's d * (q - 8) is
q * d + (-8 d), both products exact in float32 (an f16 times a 4-bit number), and so is their sum (only a
zero's sign differs: d * 0 is -0 where d < 0, the sum +0); Q4_1 (d * q + m) and Q4_K ((d * sc) * q - dmin * mn)
are the reference's own operations, equal bit for bit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

QK_K = 256
# qtype -> (weights per block, bytes per block)
BLOCK_SIZES = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
               "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210)}


def _f16(b):
    """uint8[..., 2] -> float32[...]: a little-endian float16 field."""
    return jax.lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)


def _nibbles(qs, width: int):
    """uint8[..., k * width / 2] -> uint8[..., k * width]: in each run of width/2 bytes, the low nibbles then
    the high ones (ggml's order)."""
    q = qs.reshape(*qs.shape[:-1], -1, 1, width // 2) >> jnp.array([0, 4], jnp.uint8).reshape(2, 1)
    return (q & 0x0F).reshape(*qs.shape[:-1], -1)


def _bits(qh_u32):
    """uint32[...] -> uint8[..., 32]: bit i of each word (Q5_0 / Q5_1's fifth bits)."""
    return ((qh_u32[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1).astype(jnp.uint8)


def _scale_min(scales):
    """uint8[..., 12] -> (uint8[..., 8], uint8[..., 8]): the K formats' eight 6-bit scales and mins."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = jnp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q8_0(b):
    d = _f16(b[..., 0:2])[..., None]
    x = jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32)
    return x * d


def _q4_0(b):
    d = _f16(b[..., 0:2])[..., None]
    q = _nibbles(b[..., 2:], 32).astype(jnp.int8) - jnp.int8(8)
    return d * q.astype(jnp.float32)


def _q4_1(b):
    d, m = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    return d * _nibbles(b[..., 4:], 32).astype(jnp.float32) + m


def _q5(b, offset: int):
    qh = _bits(jax.lax.bitcast_convert_type(b[..., offset:offset + 4], jnp.uint32))
    return _nibbles(b[..., offset + 4:], 32) | (qh << 4)


def _q5_0(b):
    d = _f16(b[..., 0:2])[..., None]
    q = _q5(b, 2).astype(jnp.int8) - jnp.int8(16)
    return d * q.astype(jnp.float32)


def _q5_1(b):
    d, m = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    return d * _q5(b, 4).astype(jnp.float32) + m


def _k_scales(b):
    """The K formats' per-32-weight multipliers: (d * sc, dmin * mn), each float32[..., 8, 1]."""
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, mn = _scale_min(b[..., 4:16])
    return (d * sc.astype(jnp.float32))[..., None], (dmin * mn.astype(jnp.float32))[..., None]


def _q4_k(b):
    d, dm = _k_scales(b)
    q = _nibbles(b[..., 16:144], 64).reshape(*b.shape[:-1], 8, 32).astype(jnp.float32)
    return (d * q - dm).reshape(*b.shape[:-1], QK_K)


def _q5_k(b):
    d, dm = _k_scales(b)
    ql = _nibbles(b[..., 48:176], 64).reshape(*b.shape[:-1], 8, 32)
    qh = b[..., 16:48]
    qh = ((qh[..., None, :] >> jnp.arange(8, dtype=jnp.uint8)[:, None]) & 1)           # [..., 8, 32]
    q = (ql | (qh << 4)).astype(jnp.float32)
    return (d * q - dm).reshape(*b.shape[:-1], QK_K)


def _q6_k(b):
    lead = b.shape[:-1]
    ql, qh = b[..., 0:128], b[..., 128:192]
    scales = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
    d = (_f16(b[..., 208:210])[..., None] * scales).reshape(*lead, QK_K // 16, 1)
    lo = _nibbles(ql, 128).reshape(*lead, 8, 32)                                         # 2 halves x 4 x 32
    hi = qh.reshape(*lead, 2, 1, 32) >> jnp.array([0, 2, 4, 6], jnp.uint8).reshape(4, 1)
    hi = (hi & 0x03).reshape(*lead, 8, 32)
    q = (lo | (hi << 4)).astype(jnp.int8) - jnp.int8(32)
    return (d * q.reshape(*lead, QK_K // 16, 16).astype(jnp.float32)).reshape(*lead, QK_K)


INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT4_GROUP = 32          # weights per (scale, min) pair in int4_parts
# DecoderConfig.weight_quant's name for a linear layer served from 4-bit GGUF blocks repacked for the W4A16
# kernel (models/loader.py gguf_weight_quant): its tensors may mix the INT4_TYPES.
GGUF_INT4 = "gguf-int4"


def int4_parts(raw, qtype: str):
    """uint8[..., n * type_size] of a 4-bit type -> (q uint8[..., K], scale f32[..., K / 32], min f32[..., K / 32]),
    K = n * block_size: q * scale + min per 32 weights equals dequantize(raw, qtype) (the module docstring)."""
    if qtype not in INT4_TYPES:
        raise ValueError(f"GGUF type {qtype} is not a 4-bit type ({', '.join(INT4_TYPES)})")
    block_size, type_size = BLOCK_SIZES[qtype]
    lead = raw.shape[:-1]
    b = jnp.asarray(raw, jnp.uint8).reshape(*lead, -1, type_size)
    if qtype == "Q4_K":
        d, dm = _k_scales(b)                                                     # [..., n, 8, 1] each
        q, scale, offset = _nibbles(b[..., 16:144], 64), d, -dm
    else:
        d = _f16(b[..., 0:2])[..., None]                                         # [..., n, 1]
        q = _nibbles(b[..., 4 if qtype == "Q4_1" else 2:], 32)
        scale, offset = d, (_f16(b[..., 2:4])[..., None] if qtype == "Q4_1" else -8.0 * d)
    return (q.reshape(*lead, -1), scale.reshape(*lead, -1), offset.reshape(*lead, -1))


# DecoderConfig.weight_quant's names for a linear layer whose GGUF tensors are not all 4-bit, repacked as 8-bit
# values with a float32 scale and offset per 16 or 32 weights (the W4A16 kernel's bits=8 layout): gguf-int8-g16
# where a Q6_K tensor (scales per 16) is among them, else gguf-int8-g32.
GGUF_INT8 = "gguf-int8-g"


def repacked_form(scheme: str) -> tuple[int, int] | None:
    """(bits, group) of a GGUF_INT4 or GGUF_INT8 scheme name (the kernel layout its layer is repacked into), else
    None: what the loader repacks and the decoder reads back."""
    if scheme == GGUF_INT4:
        return 4, INT4_GROUP
    if scheme.startswith(GGUF_INT8):
        return 8, int(scheme.removeprefix(GGUF_INT8))
    return None


def int8_group(types) -> int:
    """The group int8_parts gives a linear layer of these GGUF types: 16 with a Q6_K among them, else 32."""
    return 16 if "Q6_K" in types else 32


def int8_parts(raw, qtype: str, group: int = 32):
    """uint8[..., n * type_size] of any supported type -> (q uint8[..., K], scale f32[..., K / group], min
    f32[..., K / group]) with q * scale + min equal to dequantize(raw, qtype): the values as unsigned integers
    (Q8_0's int8 + 128, Q6_K's 6 bits, Q5's 5, the 4-bit types' 4) with the signed types' zero folded into the
    offset (-128 d, -32 d sc, -16 d, -8 d: exact, as every such product is). Each product q * scale and the
    sum are exact in float32 (at most 24 significant bits: Q6_K's d * sc has 18, its q 6), so the sum is the
    reference's d * (q - zero) bit for bit. group 16 or 32; Q6_K (scales per 16) needs 16, the others' scales
    repeat for it."""
    if qtype not in _DEQUANTIZE:
        raise ValueError(f"GGUF type {qtype} is not supported; supported: {', '.join(_DEQUANTIZE)}")
    if group not in (16, 32) or (qtype == "Q6_K" and group != 16):
        raise ValueError(f"group {group} for {qtype}: 16 (any type) or 32 (not Q6_K)")
    if qtype in INT4_TYPES:
        q, scale, offset = int4_parts(raw, qtype)
    else:
        _, type_size = BLOCK_SIZES[qtype]
        lead = raw.shape[:-1]
        b = jnp.asarray(raw, jnp.uint8).reshape(*lead, -1, type_size)
        d = _f16(b[..., 0:2])[..., None]                                        # [..., n, 1] (not Q6_K's)
        if qtype == "Q8_0":
            q = b[..., 2:] ^ jnp.uint8(0x80)                                     # int8 + 128
            scale, offset = d, -128.0 * d
        elif qtype == "Q5_0":
            q, scale, offset = _q5(b, 2), d, -16.0 * d
        elif qtype == "Q5_1":
            q, scale, offset = _q5(b, 4), d, _f16(b[..., 2:4])[..., None]
        elif qtype == "Q5_K":
            scale, dm = _k_scales(b)                                             # [..., n, 8, 1] each
            ql = _nibbles(b[..., 48:176], 64).reshape(*lead, -1, 8, 32)
            qh = (b[..., None, 16:48] >> jnp.arange(8, dtype=jnp.uint8)[:, None]) & 1
            q, offset = ql | (qh << 4), -dm
        else:                                                                    # Q6_K
            lo = _nibbles(b[..., 0:128], 128).reshape(*lead, -1, 8, 32)
            hi = b[..., 128:192].reshape(*lead, -1, 2, 1, 32) >> jnp.array([0, 2, 4, 6], jnp.uint8).reshape(4, 1)
            q = (lo | ((hi & 0x03).reshape(*lead, -1, 8, 32) << 4)).reshape(*lead, -1, QK_K // 16, 16)
            scales = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
            scale = (_f16(b[..., 208:210])[..., None] * scales)[..., None]       # [..., n, 16, 1]
            offset = -32.0 * scale
        q, scale, offset = (a.reshape(*lead, -1) for a in (q, scale, offset))
    native = 16 if qtype == "Q6_K" else 32
    if group < native:
        scale, offset = (jnp.repeat(a, native // group, axis=-1) for a in (scale, offset))
    return q, scale, offset


_DEQUANTIZE = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
               "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize(raw, qtype: str):
    """uint8[..., n * type_size] -> float32[..., n * block_size], as the `gguf` package dequantizes."""
    if qtype not in _DEQUANTIZE:
        raise ValueError(f"GGUF type {qtype} is not supported; supported: {', '.join(_DEQUANTIZE)}")
    block_size, type_size = BLOCK_SIZES[qtype]
    if raw.shape[-1] % type_size:
        raise ValueError(f"{qtype} rows must be a multiple of {type_size} bytes, got {raw.shape[-1]}")
    blocks = jnp.asarray(raw, jnp.uint8).reshape(*raw.shape[:-1], -1, type_size)
    out = _DEQUANTIZE[qtype](blocks)
    return out.reshape(*raw.shape[:-1], raw.shape[-1] // type_size * block_size)
