"""Rotary position embeddings and the scalings HF transformers (and vLLM) apply: linear, dynamic NTK, YaRN,
llama3 and LongRoPE, each computed as transformers' modeling_rope_utils computes it (float32).

Static scalings (linear, YaRN, llama3) fix the inverse frequencies once. The dynamic ones depend on the
length of the sequence, as in HF, where each forward takes seq_len = its largest position + 1: dynamic NTK
raises the base once seq_len passes max_position_embeddings, and LongRoPE switches from its short to its long
factors once seq_len passes original_max_position_embeddings. jaxpaged sets seq_len per request: the
request's length after this step, so a token's rotation is what HF's generate (one forward for the prompt,
one per new token, KV cache kept) gives it. Keys already in the cache keep the rotation they were written
with, as in HF.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
DYNAMIC_TYPES = ("dynamic", "longrope")


class UnsupportedRopeError(ValueError):
    pass


def rope_scaling_of(cfg: dict) -> tuple | None:
    """config.json's rope scaling (transformers 5's rope_parameters or 4.x's rope_scaling) as sorted (key,
    value) pairs, lists as tuples (hashable: it is part of the static DecoderConfig); None without scaling.
    LongRoPE's original_max_position_embeddings may sit at the top level (Phi-3)."""
    rs = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    rope_type = rs.get("rope_type", rs.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedRopeError(f"rope_scaling type {rope_type!r} is not supported "
                                   f"(supported: {', '.join(ROPE_TYPES[1:])})")
    if rope_type == "default":
        return None
    if "original_max_position_embeddings" not in rs and cfg.get("original_max_position_embeddings"):
        rs["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    rs["rope_type"] = rope_type
    rs.pop("type", None)
    rs.pop("partial_rotary_factor", None)        # the decoder's rotary_dim (models/config.py)
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in rs.items()
                        if not isinstance(v, dict)))


def _dim_range(dim: int) -> np.ndarray:
    return np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)


def base_inv_freq(theta: float, dim: int) -> np.ndarray:
    return (1.0 / (np.float32(theta) ** _dim_range(dim))).astype(np.float32)


def rope_type_of(scaling: tuple | None) -> str:
    return "default" if scaling is None else dict(scaling)["rope_type"]


def inv_freq(scaling: tuple | None, theta: float, dim: int, max_position_embeddings: int,
             long: bool = False) -> np.ndarray:
    """f32[dim/2]: the inverse frequencies of a static scaling; for LongRoPE, the short (long=False) or long
    factors'; for dynamic NTK, those up to max_position_embeddings (the unscaled ones)."""
    kind = rope_type_of(scaling)
    base = base_inv_freq(theta, dim)
    if kind in ("default", "dynamic"):
        return base
    rs = dict(scaling or ())
    if kind == "linear":
        return (base / np.float32(rs["factor"])).astype(np.float32)
    if kind == "llama3":
        return _llama3(base, rs)
    if kind == "yarn":
        return _yarn(theta, dim, max_position_embeddings, rs)
    ext = np.asarray(rs["long_factor" if long else "short_factor"], np.float32)
    return (1.0 / (ext * np.float32(theta) ** _dim_range(dim))).astype(np.float32)


def attention_factor(scaling: tuple | None, max_position_embeddings: int) -> float:
    """The factor HF multiplies cos and sin by (YaRN's and LongRoPE's; 1 otherwise)."""
    kind = rope_type_of(scaling)
    rs = dict(scaling or ())
    if kind not in ("yarn", "longrope"):
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    original = rs["original_max_position_embeddings"]
    factor = rs.get("factor") or max_position_embeddings / original
    if kind == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3(base: np.ndarray, rs: dict) -> np.ndarray:
    factor = rs["factor"]
    low, high = rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / base
    scaled = np.where(wavelen > low_wavelen, base / factor, base)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def _yarn(theta: float, dim: int, max_position_embeddings: int, rs: dict) -> np.ndarray:
    original = rs["original_max_position_embeddings"]
    factor = rs.get("factor") or max_position_embeddings / original
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (np.float32(factor) * pos_freqs)
    keep = (1 - ramp).astype(np.float32)
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def cos_sin(scaling: tuple | None, theta: float, dim: int, max_position_embeddings: int, positions, seq_lens):
    """(cos, sin) f32[T, dim/2] of each token's rotation, times the attention factor. positions i32[T];
    seq_lens i32[T]: the length of each token's sequence after this step (read by the dynamic scalings
    only)."""
    kind = rope_type_of(scaling)
    pos = positions.astype(jnp.float32)[:, None]
    if kind == "longrope":
        original = dict(scaling or ())["original_max_position_embeddings"]
        short, long_ = (jnp.asarray(inv_freq(scaling, theta, dim, max_position_embeddings, long=b))
                        for b in (False, True))
        freqs = pos * jnp.where((seq_lens > original)[:, None], long_[None, :], short[None, :])
    elif kind == "dynamic":
        factor = float(dict(scaling or ())["factor"])
        seq = jnp.maximum(seq_lens, max_position_embeddings).astype(jnp.float32)
        base = theta * ((factor * seq / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        freqs = pos / (base[:, None] ** jnp.asarray(_dim_range(dim))[None, :])
    else:
        freqs = pos * jnp.asarray(inv_freq(scaling, theta, dim, max_position_embeddings))[None, :]
    scale = attention_factor(scaling, max_position_embeddings)
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    return (cos, sin) if scale == 1.0 else (cos * scale, sin * scale)
