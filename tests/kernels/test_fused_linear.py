"""The fused small-batch linear kernels (pallas_kernels/fused_linear.py) against their plain-jnp reference, each
mode, float32 and bf16, one row to a full 16-row tile: interpret mode on the CPU, compiled on the GPU, where the
real layer shapes of qwen2-0.5b and llama3-8b run too (kernel_cases.py says how the switch works)."""
from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import gpu_only, lowered_calls
from jaxpaged.pallas_kernels.fused_linear import FUSED_MAX_ROWS, check, fused_linear, fused_linear_reference


@dataclasses.dataclass(frozen=True)
class Case:
    mode: str
    m: int
    k: int
    n: int                      # output features ("qkv": ignored, the heads set them)
    dtype: str = "float32"
    norm: bool = True
    bias: bool = False
    rope: bool = True           # "qkv"
    heads: tuple[int, int, int] = (4, 2, 64)      # "qkv": query heads, kv heads, head dim
    block_n: int | None = None  # None: the op's own tiling

    def __str__(self):
        extra = ("-norm" if self.norm else "") + ("-bias" if self.bias else "") + ("" if self.rope else "-norope")
        tiling = f"-bn{self.block_n}" if self.block_n else ""
        return f"{self.mode}-{self.m}x{self.k}x{self.n}-{self.dtype}{extra}{tiling}"


def make(case: Case):
    """(x, w, keyword arguments) with random values seeded from the case."""
    rng = np.random.default_rng(zlib.crc32(str(case).encode()))
    dt = jnp.dtype(case.dtype)
    x = jnp.asarray(rng.standard_normal((case.m, case.k)), dt)
    kw: dict = {}
    n_all = case.n
    if case.mode == "qkv":
        nh, nkv, d = case.heads
        n_all = (nh + 2 * nkv) * d
        kw.update(num_heads=nh, num_kv_heads=nkv, head_dim=d)
        if case.rope:
            angles = rng.uniform(0, 6.3, (case.m, d // 2))
            kw.update(cos=jnp.asarray(np.cos(angles), jnp.float32), sin=jnp.asarray(np.sin(angles), jnp.float32))
    elif case.mode == "swiglu":
        n_all = 2 * case.n
    elif case.mode == "residual":
        kw["residual"] = jnp.asarray(rng.standard_normal((case.m, case.n)), dt)
    if case.norm:
        kw["norm_weight"] = jnp.asarray(rng.uniform(0.5, 1.5, case.k), dt)
    if case.bias:
        kw["bias"] = jnp.asarray(rng.standard_normal(n_all) * 0.5, dt)
    w = jnp.asarray(rng.standard_normal((case.k, n_all)) / np.sqrt(case.k), dt)
    return x, w, kw


# Relative error (max |diff| / max |ref|): float32 dots at HIGHEST precision; bf16 rounds where the unfused layer
# rounds, except the norm (x * w_norm rounded, not x * r) and the dot's order: a few of bf16's 2**-8 steps.
TOL = {"float32": 2e-6, "bfloat16": 2e-2}

CASES = [
    Case("plain", 1, 128, 48),
    Case("plain", 16, 96, 64, "bfloat16", bias=True),
    Case("residual", 3, 256, 128, norm=False),
    Case("residual", 16, 128, 32, "bfloat16", norm=False),
    Case("swiglu", 1, 128, 96, "bfloat16"),
    Case("swiglu", 5, 64, 48),
    Case("qkv", 1, 128, 0, "bfloat16", bias=True),               # Qwen2's bias, one row
    Case("qkv", 7, 96, 0, heads=(4, 1, 32)),                      # head dim 32 (P = 16, the smallest tile)
    Case("qkv", 16, 128, 0, "bfloat16"),
    Case("qkv", 2, 64, 0, rope=False, bias=True),                 # ALiBi's layers: no rotation
    Case("qkv", 3, 64, 0, bias=True, block_n=16),                 # two programs a head half
    Case("swiglu", 2, 64, 64, block_n=16),
]
# llama3-8b's and qwen2-0.5b's layers at 1 and 16 rows (GPU only)
REAL = gpu_only([Case("qkv", m, 4096, 0, "bfloat16", heads=(32, 8, 128)) for m in (1, 16)]
                + [Case("residual", m, k, 4096, "bfloat16", norm=False) for m in (1, 16) for k in (4096, 14336)]
                + [Case("swiglu", m, 4096, 14336, "bfloat16") for m in (1, 16)]
                + [Case("qkv", 1, 896, 0, "bfloat16", bias=True, heads=(14, 2, 64)),
                   Case("residual", 1, 4864, 896, "bfloat16", norm=False), Case("swiglu", 1, 896, 4864, "bfloat16")])


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))


@pytest.mark.parametrize("case", CASES + REAL, ids=str)
def test_fused_linear_matches_reference(case):
    x, w, kw = make(case)
    got = fused_linear(x, w, mode=case.mode, block_n=case.block_n, **kw)
    want = fused_linear_reference(x, w, mode=case.mode, **kw)
    got, want = (got, want) if case.mode == "qkv" else ((got,), (want,))
    for g, r in zip(got, want, strict=True):
        assert g.shape == r.shape and g.dtype == x.dtype
        assert rel_err(g, r) <= TOL[case.dtype], (case, rel_err(g, r))


def test_bad_shapes_are_refused():
    x = jnp.zeros((FUSED_MAX_ROWS + 1, 64))
    with pytest.raises(ValueError, match="at most 16 rows"):
        fused_linear(x, jnp.zeros((64, 32)))
    with pytest.raises(ValueError, match="mode"):
        fused_linear(x[:1], jnp.zeros((64, 32)), mode="gelu")
    with pytest.raises(ValueError, match="heads"):
        fused_linear(x[:1], jnp.zeros((64, 100)), mode="qkv", num_heads=1, num_kv_heads=1, head_dim=32)
    assert check(4096, 6144, 128) is None and check(896, 1152, 64) is None
    assert "head dim" in check(64, 48, 16) and "multiple of 32" in check(48, 64)


def test_lowers_to_triton():
    """Lowered for the CUDA platform (Pallas -> Triton IR; no GPU needed): one Triton call a mode."""
    s = jax.ShapeDtypeStruct
    op = functools.partial(fused_linear, interpret=False)
    bf = jnp.bfloat16
    for m in (1, FUSED_MAX_ROWS):
        assert lowered_calls(lambda x, w, nw, b, c, sn: op(x, w, mode="qkv", norm_weight=nw, bias=b, cos=c, sin=sn,
                                                           num_heads=14, num_kv_heads=2, head_dim=64),
                             s((m, 896), bf), s((896, 1152), bf), s((896,), bf), s((1152,), bf),
                             s((m, 32), jnp.float32), s((m, 32), jnp.float32)) == (1,)
        assert lowered_calls(lambda x, w, r: op(x, w, mode="residual", residual=r), s((m, 14336), bf),
                             s((14336, 4096), bf), s((m, 4096), bf)) == (1,)
        assert lowered_calls(lambda x, w, nw: op(x, w, mode="swiglu", norm_weight=nw), s((m, 4096), bf),
                             s((4096, 28672), bf), s((4096,), bf)) == (1,)
        assert lowered_calls(lambda x, w, nw: op(x, w, norm_weight=nw), s((m, 896), jnp.float32),
                             s((896, 512), jnp.float32), s((896,), jnp.float32)) == (1,)
