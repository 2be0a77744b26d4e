"""A function over the rows of large arrays, a bounded number of rows at a time: what keeps a [rows, vocabulary]
working set (a sampler's sort, the prompt-logprob head) within the memory the KV pool leaves free."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rows_within(budget_bytes: int, row_bytes: int, rows: int) -> int:
    """The most rows, a power of two and at most `rows`, whose bytes fit `budget_bytes` (at least one)."""
    fit = max(1, budget_bytes // row_bytes)
    return min(rows, 1 << (fit.bit_length() - 1))


def map_row_chunks(fn, args, chunk: int):
    """fn over `args` (a tree of arrays with a common leading dim R) `chunk` rows at a time, the last chunk padded
    with zeros -> fn's outputs concatenated back to leading dim R (the padded rows' dropped)."""
    rows = jax.tree.leaves(args)[0].shape[0]
    pad = -rows % chunk
    count = (rows + pad) // chunk

    def split(x):       # the counts spelled out: -1 cannot be inferred for an empty [R, 0] array
        x = jnp.asarray(x)
        return jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)).reshape(count, chunk, *x.shape[1:])

    out = jax.lax.map(fn, jax.tree.map(split, args))
    return jax.tree.map(lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])[:rows], out)
