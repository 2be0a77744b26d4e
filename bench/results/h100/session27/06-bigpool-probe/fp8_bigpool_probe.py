"""Do the attention and KV-write kernels read and write a pool of the engine's shape (32 layers, 20,000 blocks:
past 2**31 elements) correctly at its last layer? e4m3 (bytes) and bf16 pools; Triton and Mosaic decode, the
Triton ragged kernel, the Pallas KV write, each against the XLA path."""
import jax
import jax.numpy as jnp
import numpy as np
from jaxpaged import pallas_kernels as pk
from jaxpaged.pallas_kernels._checks import FP8_CACHE_DTYPE, from_cache, to_cache
from jaxpaged.pallas_kernels.paged_decode_attention_mgpu import paged_decode_attention_mgpu
from jaxpaged.pallas_kernels.ragged_paged_attention_pallas import ragged_paged_attention_pallas

print(jax.__version__, jax.devices()[0].device_kind, flush=True)
import os
L, B, K, S, D, N, R, M = (int(x) for x in os.environ.get("PROBE_DIMS", "32,20000,8,16,128,32,64,64").split(","))
LAYER = L - 1
rng = np.random.default_rng(0)


def err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    bad = int(np.isnan(a).any(axis=(1, 2)).sum())
    return f"NaN rows {bad}, rel err {np.linalg.norm(np.nan_to_num(a) - b) / np.linalg.norm(b):.2e}"


for label, dtype in (("e4m3", FP8_CACHE_DTYPE), ("bf16", jnp.bfloat16)):
    pool = jnp.zeros((L, 2, B, K, S, D), dtype)
    blocks = rng.choice(np.arange(1, B), R * M, replace=False).astype(np.int32)
    blocks[:8] = np.arange(B - 8, B)                       # the pool's last blocks among them
    tables = jnp.asarray(blocks.reshape(R, M))
    vals = jax.random.normal(jax.random.PRNGKey(0), (R * M, 2, K, S, D), jnp.bfloat16)   # p[l, :, b]: [n, 2, ...]
    vals = to_cache(vals, dtype) if dtype == FP8_CACHE_DTYPE else vals
    fill = jax.jit(lambda p, b, v: p.at[LAYER, :, b].set(v), donate_argnums=0)
    pool = fill(pool, jnp.asarray(blocks), vals)
    lens = jnp.full((R,), M * S, jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(1), (R, N, D)).astype(jnp.bfloat16)
    args = (q, pool, jnp.int32(LAYER), tables, lens)
    ref = pk.paged_decode_attention_reference(*args, scale=D ** -0.5)
    print(f"{label}: pool {pool.nbytes / 2**30:.1f} GiB", flush=True)
    print(f"  decode Triton: {err(pk.paged_decode_attention(*args, scale=D ** -0.5), ref)}", flush=True)
    print(f"  decode Mosaic: {err(paged_decode_attention_mgpu(*args, scale=D ** -0.5), ref)}", flush=True)
    qsl = jnp.arange(R + 1, dtype=jnp.int32)
    print(f"  ragged Triton (decode rows): "
          f"{err(ragged_paged_attention_pallas(*args, qsl, scale=D ** -0.5), ref)}", flush=True)
    # the KV write into the last blocks of the last layer, read back by indexing
    slots = jnp.asarray((np.arange(B - 4, B)[:, None] * S + np.arange(S)[None, :]).reshape(-1).astype(np.int32))
    kv = jax.random.normal(jax.random.PRNGKey(2), (slots.shape[0], K, D), jnp.bfloat16)
    write = jax.jit(lambda p, k, v, s: pk.write_kv(p, jnp.int32(LAYER), k, v, s, backend="pallas"), donate_argnums=0)
    pool = write(pool, kv, kv * 2, slots)
    back_k = from_cache(pool[LAYER, 0, B - 4:].transpose(0, 2, 1, 3).reshape(-1, K, D), jnp.float32)
    back_v = from_cache(pool[LAYER, 1, B - 4:].transpose(0, 2, 1, 3).reshape(-1, K, D), jnp.float32)
    want = from_cache(to_cache(kv, dtype), jnp.float32) if dtype == FP8_CACHE_DTYPE else kv.astype(jnp.float32)
    want_v = from_cache(to_cache(kv * 2, dtype), jnp.float32) if dtype == FP8_CACHE_DTYPE else (kv * 2).astype(jnp.float32)
    print(f"  write_kv (Pallas) at the last blocks: K equal {bool(jnp.array_equal(back_k, want))}, "
          f"V equal {bool(jnp.array_equal(back_v, want_v))}", flush=True)
    del pool, vals
