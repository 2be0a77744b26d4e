"""What a mixed step's attention costs its decode rows (GPU): the kernel `attention()` routes a mixed step to
(the ragged one, every row of the flat batch) against the same prompts alone plus the decode rows through the
decode kernel, as if a mixed step ran them as two calls.

    python3 bench/mixed_attention_probe.py [--layouts llama3-8b,qwen2-0.5b] [--cases 512x256,900x256,256x1024]
        [--prompts 62x256] [--tokens 16384] [--out DIR]

Each case DxC: D decode rows (one query token, C tokens of context each) ahead of P prompts of L tokens
(--prompts PxL, whole prompts from position 0), in the engine's order (running requests first), padded to
--tokens rows as a mixed bucket pads them. Times, per layer (bench_kernels.time_op: one jit runs the op n
and 2n times, the median of (t(2n) - t(n)) / n):
  mixed     attention() on the whole batch (mixed_attention_mgpu: decode rows in the packed decode kernel)
  prompts   attention() on the prompts alone (the same padded T)
  decode    attention(decode_only=True) on the decode rows alone (the packed Mosaic decode kernel from
            MOSAIC_DECODE_MIN_PAIRS pairs)
  ragged    the ragged kernel alone on the whole batch (each decode row a tile of its own: what a mixed step
            ran before mixed_attention_mgpu), on the GPU only
mixed - prompts is what the decode rows cost; decode is what they cost apart.
The K/V bytes the decode rows read are printed beside, as TB/s. Checked first: the decode rows' outputs of
`mixed` against `decode`'s, the prompt rows' against `prompts`', and `ragged`'s against `mixed`'s (max abs
differences printed).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pallas_kernels as pk  # noqa: E402
from bench.bench_kernels import BLOCK, LAYOUTS, make_pool, time_op  # noqa: E402


def _pair(text: str) -> tuple[int, int]:
    a, b = text.lower().split("x")
    return int(a), int(b)


def build(n_dec: int, ctx: int, n_prompts: int, length: int, tokens: int):
    """(seq_lens, query_start_loc, block_tables, pool blocks) of D decode rows then P prompts; requests
    padded to a power of two rows with empty requests (seq_len 0), as buckets pad them."""
    dec_blocks, prompt_blocks = -(-ctx // BLOCK), -(-length // BLOCK)
    max_blocks = max(dec_blocks, prompt_blocks)
    num_reqs = n_dec + n_prompts
    padded_reqs = 1 << max(num_reqs - 1, 1).bit_length()
    q_lens = np.array([1] * n_dec + [length] * n_prompts + [0] * (padded_reqs - num_reqs), np.int32)
    seq_lens = np.array([ctx] * n_dec + [length] * n_prompts + [0] * (padded_reqs - num_reqs), np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    assert qsl[-1] <= tokens, f"{qsl[-1]} query tokens do not fit {tokens}"
    tables = np.zeros((padded_reqs, max_blocks), np.int32)
    nxt = 1                                        # block 0 is the null block
    for r in range(num_reqs):
        nb = dec_blocks if r < n_dec else prompt_blocks
        tables[r, :nb] = np.arange(nxt, nxt + nb)
        nxt += nb
    return seq_lens, qsl, tables, nxt


def run_case(layout: str, n_heads: int, n_kv: int, d: int, n_dec: int, ctx: int, n_prompts: int, length: int,
             tokens: int) -> dict:
    rng = np.random.default_rng(0)
    sl, qsl, bt, nblocks = build(n_dec, ctx, n_prompts, length, tokens)
    pool = make_pool(rng, nblocks, n_kv, d)
    scale = d ** -0.5
    reps = 4
    qs = [jax.random.normal(jax.random.PRNGKey(i), (tokens, n_heads, d)).astype(jnp.bfloat16) for i in range(2 * reps)]
    qs_prompts = [jnp.roll(q, -n_dec, axis=0) for q in qs]      # the prompt rows first, as a batch without decodes
    zero = jnp.int32(0)
    mixed_args = (jnp.asarray(bt), jnp.asarray(sl), jnp.asarray(qsl))
    # the prompts alone: the decode requests dropped, the prompt rows moved to the front, same T
    sl_p, qsl_p, bt_p = sl[n_dec:], qsl[n_dec:] - qsl[n_dec], bt[n_dec:]
    pad = len(sl) - len(sl_p)
    sl_p = np.concatenate([sl_p, np.zeros(pad, np.int32)])
    qsl_p = np.concatenate([qsl_p, np.full(pad, qsl_p[-1], np.int32)])
    bt_p = np.concatenate([bt_p, np.zeros((pad, bt.shape[1]), np.int32)])
    prompt_args = (jnp.asarray(bt_p), jnp.asarray(sl_p), jnp.asarray(qsl_p))
    dec_args = (jnp.asarray(bt[:n_dec]), jnp.asarray(sl[:n_dec]), jnp.arange(n_dec + 1, dtype=jnp.int32))

    def routed(i, qs, pool, bt, sl, qsl):        # as attention() routes a mixed batch (the prompts alone too)
        return pk.attention(qs[i], pool, zero, bt, sl, qsl, scale=scale, backend="mosaic")

    def decode(i, qs, pool, bt, sl, qsl):
        return pk.attention(qs[i][:n_dec], pool, zero, bt, sl, qsl, scale=scale, decode_only=True, backend="mosaic")

    def ragged(i, qs, pool, bt, sl, qsl):
        from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu
        return ragged_paged_attention_mgpu(qs[i], pool, zero, bt, sl, qsl, scale=scale, interpret=False)

    out_m = np.asarray(jax.jit(lambda *a: routed(0, *a))(qs, pool, *mixed_args), np.float32)
    out_p = np.asarray(jax.jit(lambda *a: routed(0, *a))(qs_prompts, pool, *prompt_args), np.float32)
    out_d = np.asarray(jax.jit(lambda *a: decode(0, *a))(qs, pool, *dec_args), np.float32)
    n_prompt_rows = n_prompts * length
    row = {"layout": layout, "decode_rows": n_dec, "ctx": ctx, "prompts": n_prompts, "prompt_len": length,
           "tokens": tokens,
           "check_decode_rows_max_abs": float(np.abs(out_m[:n_dec] - out_d).max()),
           "check_prompt_rows_max_abs": float(np.abs(out_m[n_dec:n_dec + n_prompt_rows] - out_p[:n_prompt_rows]).max())}
    timed = [("mixed", routed, qs, mixed_args), ("prompts", routed, qs_prompts, prompt_args),
             ("decode", decode, qs, dec_args)]
    if jax.default_backend() != "cpu":           # the compiled Mosaic GPU kernel (the CPU routes to Triton)
        out_r = np.asarray(jax.jit(lambda *a: ragged(0, *a))(qs, pool, *mixed_args), np.float32)
        row["check_ragged_max_abs"] = float(np.nanmax(np.abs(out_r[:qsl[-1]] - out_m[:qsl[-1]])))
        timed.append(("ragged", ragged, qs, mixed_args))
    for name, f, q, args in timed:
        t, _ = time_op(f, (q, pool, *args), reps)
        row[f"{name}_us"] = t * 1e6
    kv_bytes = n_dec * ctx * n_kv * d * 2 * 2
    row["decode_rows_in_mixed_us"] = row["mixed_us"] - row["prompts_us"]
    if "ragged_us" in row:
        row["decode_rows_in_ragged_us"] = row["ragged_us"] - row["prompts_us"]
    row["decode_kv_tbps_apart"] = kv_bytes / row["decode_us"] / 1e6
    row["decode_kv_tbps_in_mixed"] = kv_bytes / max(row["decode_rows_in_mixed_us"], 1e-3) / 1e6
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="llama3-8b,qwen2-0.5b")
    p.add_argument("--cases", default="128x256,512x256,900x256,256x1024")
    p.add_argument("--prompts", default="56x256", help="PxL: P whole prompts of L tokens after the decode rows")
    p.add_argument("--tokens", type=int, default=16384, help="the mixed bucket's T")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    n_prompts, length = _pair(args.prompts)
    rows = []
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    for layout in args.layouts.split(","):
        n, k, d = LAYOUTS[layout]
        for case in args.cases.split(","):
            n_dec, ctx = _pair(case)
            row = run_case(layout, n, k, d, n_dec, ctx, n_prompts, length, args.tokens)
            rows.append(row)
            print(json.dumps({key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()}), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "mixed_attention_probe.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
