"""The online-softmax step shared by the Triton-backend attention kernels (Pallas GPU, or interpret mode).

Scores arrive in the log2 domain (the softmax scale already multiplied by log2(e)), so exp2 replaces exp.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

NEG = -1e30              # finite "minus infinity": fully masked rows end with l == 0, never NaN


def init_carry(rows: int, head_dim: int):
    """(m, l, acc) before the first key tile: f32[rows], f32[rows], f32[rows, D]."""
    return (jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))


def online_softmax_step(carry, s, v, *, mask=None, precision=None):
    """Folds one key tile into (m, l, acc): s f32[rows, BK] (masked entries already NEG), v dtype[BK, D].

    mask bool[rows, BK], where given, also zeroes the masked probabilities (a row whose every key so far
    is masked would otherwise count exp2(0) = 1 for each).
    """
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp2(s - m_new[:, None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    alpha = jnp.exp2(m - m_new)
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
    return m_new, l, acc
