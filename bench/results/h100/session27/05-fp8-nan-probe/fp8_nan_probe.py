"""Where do NaNs in the e4m3 decode at llama3-8b 256 x 4k come from? Mosaic vs Triton on the same e4m3 pool,
by pool size and by the block ids the tables use. Prints NaN counts and, for NaN rows, their tables' max block."""
import sys
import jax
import jax.numpy as jnp
import numpy as np
from jaxpaged import pallas_kernels as pk
from jaxpaged.pallas_kernels._checks import FP8_CACHE_DTYPE, to_cache
from jaxpaged.pallas_kernels.paged_decode_attention_mgpu import paged_decode_attention_mgpu

print(jax.__version__, jax.devices()[0].device_kind, flush=True)
K, D, N, S = 8, 128, 32, 16
rng = np.random.default_rng(0)
for name, r, ctx, pool_blocks, hi in [("256x4k pool 65537 all blocks", 256, 4096, 65537, 65537),
                                      ("256x4k pool 65537 blocks < 32768", 256, 4096, 65537, 32768),
                                      ("256x4k pool 40000 (reused blocks)", 256, 4096, 40000, 40000),
                                      ("64x4k pool 65537 all blocks", 64, 4096, 65537, 65537)]:
    m = ctx // S
    key = jax.random.PRNGKey(pool_blocks)
    pool8 = to_cache(jax.random.normal(key, (1, 2, pool_blocks, K, S, D), jnp.bfloat16), FP8_CACHE_DTYPE)
    tables = jnp.asarray(rng.integers(1, hi, (r, m)).astype(np.int32))
    if hi == pool_blocks and r * m <= pool_blocks - 1:
        tables = jnp.asarray(rng.permutation(np.arange(1, pool_blocks))[: r * m].reshape(r, m).astype(np.int32))
    lens = jnp.full((r,), ctx, jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(1), (r, N, D)).astype(jnp.bfloat16)
    mos = np.asarray(paged_decode_attention_mgpu(q, pool8, jnp.int32(0), tables, lens, scale=D ** -0.5), np.float32)
    tri = np.asarray(pk.paged_decode_attention(q, pool8, jnp.int32(0), tables, lens, scale=D ** -0.5), np.float32)
    nan_m, nan_t = np.isnan(mos).any(axis=(1, 2)), np.isnan(tri).any(axis=(1, 2))
    ok = ~(nan_m | nan_t)
    err = np.linalg.norm(mos[ok] - tri[ok]) / np.linalg.norm(tri[ok]) if ok.any() else float("nan")
    tmax = np.asarray(tables).max(axis=1)
    print(f"{name}: NaN requests mosaic {nan_m.sum()} triton {nan_t.sum()}; rel err on the rest {err:.2e}; "
          f"max block of NaN requests (mosaic) {sorted(tmax[nan_m])[:8]}; pool bytes {pool8.size}", flush=True)
    if nan_m.any():
        rows = np.argwhere(np.isnan(mos))
        print("   mosaic NaN (req, head) pairs, first:", sorted({(int(a), int(b) // 4) for a, b, _ in rows})[:12], flush=True)
    del pool8
