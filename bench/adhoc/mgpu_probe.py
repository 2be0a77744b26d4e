"""Session 8: first GPU run of the Mosaic GPU prefill kernel (pallas_kernels/ragged_paged_attention_mgpu.py).

    timeout 200 python3 bench/adhoc/mgpu_probe.py [--semantics lane|warpgroup]

Checks it against the plain-jnp reference on a ragged batch (a short chunk, a prefill, a chunk starting
mid-sequence, a decode, a long chunk, bucket padding) in both head layouts, bf16, block 16; prints the
relative error, NaN count and which rows are off. Runs uninstalled from the repository root.
"""
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference  # noqa: E402
from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu  # noqa: E402

# --semantics lane|warpgroup: the Mosaic GPU lowering semantics (jax 0.11 defaults to warpgroup)
OPTS = {"lowering_semantics": sys.argv[sys.argv.index("--semantics") + 1]} if "--semantics" in sys.argv else {}
print(jax.__version__, jax.devices()[0].device_kind, OPTS, flush=True)
for name, (n, k, d) in {"qwen2-0.5b": (14, 2, 64), "llama3-8b": (32, 8, 128)}.items():
    for q_lens, ctx in (([3, 130, 64, 1, 200], [5, 0, 17, 40, 33]), ([256, 512], [0, 100])):
        rng = np.random.default_rng(0)
        S, M, L = 16, 48, 2
        R = len(q_lens)
        seq = np.array(ctx) + np.array(q_lens)
        B = int(sum(-(-seq // S))) + 1
        T = sum(q_lens) + 5
        q = jnp.asarray(rng.standard_normal((T, n, d)), jnp.bfloat16)
        kv = jnp.asarray(rng.standard_normal((L, 2, B, k, S, d)), jnp.bfloat16)
        tables = np.zeros((R, M), np.int32)
        perm, o = rng.permutation(np.arange(1, B)), 0
        for r in range(R):
            nb = -(-seq[r] // S)
            tables[r, :nb] = perm[o:o + nb]
            o += nb
        qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
        args = (q, kv, jnp.int32(1), jnp.asarray(tables), jnp.asarray(seq.astype(np.int32)), qsl)
        t = time.time()
        try:
            out = np.asarray(ragged_paged_attention_mgpu(*args, scale=d ** -0.5, **OPTS), np.float32)
        except Exception as e:  # noqa: BLE001
            print(name, q_lens, "FAILED", type(e).__name__, str(e)[:1500], flush=True)
            print("".join(traceback.format_exc().splitlines(True)[-24:]), flush=True)
            continue
        ref = np.asarray(ragged_paged_attention_reference(*args, scale=d ** -0.5), np.float32)
        err = np.linalg.norm(np.nan_to_num(out - ref, nan=1e3)) / np.linalg.norm(ref)
        bad = np.unique(np.argwhere(np.abs(np.nan_to_num(out - ref, nan=1e3)) > 0.05)[:, 0])
        print(f"{name} q_lens {q_lens}: rel err {err:.2e}, NaN {int(np.isnan(out).sum())}, "
              f"{time.time() - t:.1f} s, bad rows {bad[:20].tolist()} ({len(bad)})", flush=True)
