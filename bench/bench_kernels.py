"""Pallas kernel benchmark on the GPU (issue 3).

  python3 bench/bench_kernels.py --out DIR [--git-rev REV] [--budget-s 420] [--parts decode,prefill,kvwrite]

Correctness is tests/kernels' job: `JAX_PLATFORMS=cuda python -m pytest tests/kernels` on the GPU checks
every kernel against its reference, at real sizes too. Here only what is timed is checked first where it
is not the model's default (Mosaic GPU kernels and --decode-variants against the Triton kernel's output).
1. Decode: {16, 64, 256} seqs x {1k, 4k, 8k} ctx, layouts 14q/2kv D64 (qwen2-0.5b) and 32q/8kv D128
   (llama3-8b), bf16, block 16: our kernel (a few tile configs, best reported) and JAX's own
   jax.experimental.pallas.ops.gpu.paged_attention on the same data in its layout; time = median of
   >= 20 device-synchronised samples, each sample running the op on several block tables drawn at random
   from a pool >= 1 GiB (so L2 never holds the cache); TB/s of K+V bytes read vs 2.53 TB/s.
   --fp8-cache also times the default configuration over the same pool in e4m3 (fp8_speedup).
2. Prefill: {1..16} seqs x {512..8k} tokens, causal, whole prompts as single chunks through the ragged
   kernel, vs jax.nn.dot_product_attention(implementation="cudnn") on dense equal-length inputs;
   TFLOP/s counting the causal half (2 * 2 * seqs * len^2 * N * D / 2).
Writes kernels_<device>.json / .md / .png under --out; prints a short table last.
Runs uninstalled: the repo root goes on sys.path and `pallas_kernels` is imported as a top-level package.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from pallas_kernels.paged_decode_attention import choose_splits, device_num_sms  # noqa: E402

HBM_TBPS = 2.53
LAYOUTS = {"qwen2-0.5b": (14, 2, 64), "llama3-8b": (32, 8, 128), "gemma-2-9b": (16, 8, 256)}
DEFAULT_LAYOUTS = "qwen2-0.5b,llama3-8b"
# attention logit soft caps of a layout (Gemma 2's 50.0): decode applies it (JAX's op, which has none, is then
# not timed beside it); the Mosaic kernels decline soft caps and head size 256
SOFT_CAPS = {"gemma-2-9b": 50.0}
BLOCK = 16
POOL_MIN_BYTES = 1 << 30
T0 = time.time()
SMOKE = "--smoke" in sys.argv       # tiny sizes, CPU interpret mode: checks the script itself runs
DECODE_SEQS, DECODE_CTX = ((2,), (64,)) if SMOKE else ((16, 64, 256), (1024, 4096, 8192))


PART_SHARE = {"decode": 0.6, "prefill": 0.93, "kvwrite": 1.0}   # cumulative budget shares
_PART = ["decode"]


def _layouts(args):
    """(name, (heads, kv heads, head dim)) of the layouts --layouts names, in LAYOUTS' order."""
    return [(name, dims) for name, dims in LAYOUTS.items() if name in args.layouts.split(",")]


def over_budget(args) -> bool:
    return time.time() - T0 > args.budget_s * PART_SHARE[_PART[0]]


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _call_s(fn, args) -> float:
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t


def time_op(op, args, n, samples=3 if SMOKE else 21):
    """Seconds per op, as (device-throughput, wall).

    op(i, *args) runs the op on rotation i (2n distinct rotations, so that XLA cannot merge identical
    calls). One jit runs rotations 0..n-1, another 0..2n-1. throughput = median over `samples` of
    (t(2n) - t(n)) / n, the two calls of each sample made back to back: this removes the fixed
    dispatch cost (what the op costs inside a bigger jitted step, e.g. one layer of the model), and
    pairing the calls keeps one disturbed call from skewing the difference (median(t(2n)) - median(t(n))
    gives impossible figures, above the chip's peak, whenever one of the two medians moves).
    wall = median t(n) / n includes the dispatch.
    """
    f1 = jax.jit(lambda *a: [op(i, *a) for i in range(n)])
    f2 = jax.jit(lambda *a: [op(i, *a) for i in range(2 * n)])
    for f in (f1, f2, f1, f2):                        # compile, then warm
        jax.block_until_ready(f(*args))
    pairs = [(_call_s(f1, args), _call_s(f2, args)) for _ in range(samples)]
    diff = float(np.median([t2 - t1 for t1, t2 in pairs]))
    return max(diff, 1e-9) / n, float(np.median([t1 for t1, _ in pairs])) / n


# ----------------------------------------------------------------------------------------------- data
def make_pool(rng, num_blocks, num_kv, head_dim, dtype=jnp.bfloat16, layers=1):
    shape = (layers, 2, num_blocks, num_kv, BLOCK, head_dim)
    return jax.random.normal(jax.random.PRNGKey(int(rng.integers(1 << 30))), shape, jnp.float32
                             ).astype(dtype)


def random_tables(rng, num_sets, num_reqs, max_blocks, pool_blocks):
    """num_sets disjoint-within-a-set tables drawn from blocks 1..pool_blocks-1 (0 is the null block)."""
    out = []
    for _ in range(num_sets):
        ids = rng.permutation(np.arange(1, pool_blocks))[: num_reqs * max_blocks]
        out.append(ids.reshape(num_reqs, max_blocks).astype(np.int32))
    return jnp.asarray(np.stack(out))


# --------------------------------------------------------------------------------------------- decode
DECODE_CONFIGS = [  # (keys per iteration, num_warps, programs per SM, num_stages); the op's default runs too
    # 4 programs per SM with 4 warps: an earlier default of the op, kept as a reference point
    (64, 4, 4, 2), (64, 2, 4, 2), (64, 4, 16, 2), (64, 2, 16, 2), (64, 4, 32, 2), (64, 2, 32, 2),
]


def reps_for(seconds_per_op: float, lo: int, hi: int) -> int:
    """Ops per timed call: enough that one call runs ~3 ms, so host jitter divides away."""
    return int(min(hi, max(lo, math.ceil(3e-3 / max(seconds_per_op, 5e-6)))))


def decode_bench(args, results):
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa
    rng = np.random.default_rng(0)
    rows = results["decode"] = []
    for name, (n, k, d) in _layouts(args):
        cap = SOFT_CAPS.get(name)
        for r in DECODE_SEQS:
            for ctx in DECODE_CTX:
                if args.decode_shapes and (r, ctx) not in args.decode_shapes:
                    continue
                if over_budget(args):
                    print("decode: out of time budget, stopping", flush=True)
                    results["decode"] = rows
                    return
                m = ctx // BLOCK
                block_bytes = 2 * k * BLOCK * d * 2
                kv_bytes = r * m * block_bytes
                pool_blocks = max(r * m, (1 << 20 if SMOKE else POOL_MIN_BYTES) // block_bytes) + 1
                nrot = reps_for(kv_bytes / 2.0e12, 4, 48)
                pool = make_pool(rng, pool_blocks, k, d)
                tables = random_tables(rng, 2 * nrot, r, m, pool_blocks)
                lens = jnp.full((r,), ctx, jnp.int32)
                q = jax.random.normal(jax.random.PRNGKey(r + ctx), (r, n, d)).astype(jnp.bfloat16)
                row = {"layout": name, "seqs": r, "ctx": ctx, "kv_bytes": kv_bytes, "rotations": nrot}
                best = None
                for keys, warps, per_sm, stages in DECODE_CONFIGS[:2] if SMOKE else args.decode_configs:
                    bpi = keys // BLOCK
                    ns = -per_sm if per_sm < 0 else choose_splits(r, k, m, bpi, per_sm, sms=device_num_sms())

                    def ours(i, q, pool, tables, lens, bpi=bpi, warps=warps, ns=ns, stages=stages):
                        return pk.paged_decode_attention(q, pool, jnp.int32(0), tables[i], lens,
                                                         scale=d ** -0.5, blocks_per_iter=bpi, soft_cap=cap,
                                                         num_warps=warps, num_splits=ns, num_stages=stages)
                    cfg = f"{keys},{warps},{ns},{stages}"
                    try:
                        t, tw = time_op(ours, (q, pool, tables, lens), nrot)
                    except Exception as e:  # noqa: BLE001 - report and go on
                        print(f"decode cfg {cfg} failed: {type(e).__name__}: {str(e)[:300]}")
                        continue
                    row[f"ours_us[{cfg}]"] = t * 1e6
                    if best is None or t < best[0]:
                        best = (t, cfg, tw)
                # the default configuration (what the model gets)
                try:
                    t, tw = time_op(lambda i, q, pool, tables, lens: pk.paged_decode_attention(
                        q, pool, jnp.int32(0), tables[i], lens, scale=d ** -0.5, soft_cap=cap),
                        (q, pool, tables, lens), nrot)
                    row["default_us"], row["default_wall_us"] = t * 1e6, tw * 1e6
                    row["default_tbps"] = kv_bytes / t / 1e12
                except Exception as e:  # noqa: BLE001
                    print(f"decode default failed: {type(e).__name__}: {str(e)[:300]}")
                if args.fp8_cache:
                    _time_decode_fp8(row, (q, pool, tables, lens), nrot, d ** -0.5)
                _time_decode_variants(args, row, (q, pool, tables, lens), nrot, d ** -0.5)
                if best:
                    row["ours_us"], row["ours_cfg"], row["ours_wall_us"] = best[0] * 1e6, best[1], best[2] * 1e6
                    row["ours_tbps"] = kv_bytes / best[0] / 1e12
                # JAX's op: [K, B, S, D] pools, same blocks
                kp = pool[0, 0].transpose(1, 0, 2, 3)
                vp = pool[0, 1].transpose(1, 0, 2, 3)

                def theirs(i, q, kp, vp, tables, lens):
                    return jax_pa.paged_attention(q, kp, vp, tables[i], lens)
                if cap is not None:
                    print(f"jax paged_attention not timed: it has no soft cap ({name}'s {cap})")
                else:
                    try:
                        t, tw = time_op(theirs, (q, kp, vp, tables, lens), nrot)
                        row["jax_us"], row["jax_wall_us"], row["jax_tbps"] = t * 1e6, tw * 1e6, kv_bytes / t / 1e12
                        if best:
                            row["speedup"] = t / best[0]
                    except Exception as e:  # noqa: BLE001
                        print(f"jax paged_attention failed: {type(e).__name__}: {str(e)[:300]}")
                _time_decode_mgpu(args, row, (q, pool, tables, lens), nrot, kv_bytes, d ** -0.5)
                _time_decode_mgpu_wide(args, row, (q, pool, tables, lens), nrot, kv_bytes, d ** -0.5, cap)
                _routed(row, r * k)
                if args.fp8_cache:
                    _time_routed_fp8(row)
                del kp, vp, pool
                print("decode", json.dumps({k_: (round(v, 3) if isinstance(v, float) else v)
                                            for k_, v in row.items()}), flush=True)
                rows.append(row)
    results["decode"] = rows


# (keys per iteration, warps, stages) tried on the e4m3 pool: its tiles hold half the bytes of bf16's
FP8_DECODE_CONFIGS = ((64, 4, 2), (128, 4, 2), (128, 8, 2), (256, 8, 2), (128, 4, 3), (64, 2, 3))


def _time_decode_fp8(row, data, nrot, scale):
    """The default configuration on the same pool in e4m3 (--kv-cache-dtype fp8): half the bytes read; then
    FP8_DECODE_CONFIGS (split count the op's own), the best as fp8_best_us / fp8_best_cfg."""
    from pallas_kernels._checks import FP8_CACHE_DTYPE, in_triton_32bit_window, to_cache
    q, pool, tables, lens = data
    pool8 = to_cache(pool, FP8_CACHE_DTYPE)
    if in_triton_32bit_window(pool8.size, 1):     # the Triton kernels refuse 2-4 GiB of bytes: grow it past 4 GiB
        per_block = pool8.size // pool8.shape[2]
        pool8 = jnp.pad(pool8, ((0, 0), (0, 0), (0, 2**32 // per_block + 1 - pool8.shape[2])) + ((0, 0),) * 3)
    try:
        t, _ = time_op(lambda i, q, pool, tables, lens: pk.paged_decode_attention(
            q, pool, jnp.int32(0), tables[i], lens, scale=scale), (q, pool8, tables, lens), nrot)
        row["fp8_default_us"] = t * 1e6
        if "default_us" in row:
            row["fp8_speedup"] = row["default_us"] / row["fp8_default_us"]
    except Exception as e:  # noqa: BLE001
        print(f"decode fp8 failed: {type(e).__name__}: {str(e)[:300]}")
    for keys, warps, stages in FP8_DECODE_CONFIGS:
        cfg = f"{keys}x{warps}x{stages}"
        try:
            t, _ = time_op(lambda i, q, pool, tables, lens, bpi=keys // BLOCK, w=warps, st=stages:
                           pk.paged_decode_attention(q, pool, jnp.int32(0), tables[i], lens, scale=scale,
                                                     blocks_per_iter=bpi, num_warps=w, num_stages=st),
                           (q, pool8, tables, lens), nrot)
        except Exception as e:  # noqa: BLE001
            print(f"decode fp8 cfg {cfg} failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        row[f"fp8_us[{cfg}]"] = t * 1e6
        if "fp8_best_us" not in row or t * 1e6 < row["fp8_best_us"]:
            row["fp8_best_us"], row["fp8_best_cfg"] = t * 1e6, cfg
    if "fp8_best_us" in row and "default_us" in row:
        row["fp8_best_speedup"] = row["default_us"] / row["fp8_best_us"]
    _time_decode_mgpu_fp8(row, (q, pool8, tables, lens), nrot, scale, row.get("fp8_default_us"), pool)


# (block_kv, slots, split_keys) of the Mosaic decode kernel tried on the e4m3 pool (128 keys leave SMEM for two
# slots; split_keys: both compute warpgroups share each pair's steps, 64 keys a step)
FP8_MGPU_CONFIGS = ((128, 2, False), (64, 2, False), (64, 3, False), (64, 4, False), (64, 2, True), (64, 3, True))


def _mgpu_label(block_kv: int, slots: int, split: bool) -> str:
    """A Mosaic decode configuration as its figures' keys name it: "block_kv,slots[,split]"."""
    return f"{block_kv},{slots}" + (",split" if split else "")


def _time_decode_mgpu_fp8(row, data, nrot, scale, triton_fp8_us, pool_bf16):
    """The Mosaic decode kernel on the e4m3 pool (each slot widened to float16 in SMEM), each config first
    checked against the Triton kernel on the same pool: fp8_mgpu_us[block_kv,slots(,split)]; split_keys on
    the bf16 pool too (bf16_split_mgpu_us[64,2,split]); then what attention() routes for this batch, bf16 pool
    against e4m3 pool (routed_fp8_speedup: issue 26's decode figure)."""
    from pallas_kernels.paged_decode_attention_mgpu import mgpu_decode_supported, paged_decode_attention_mgpu as mgpu
    q, pool8, tables, lens = data
    if mgpu_decode_supported(q, pool8) is not None:
        return
    for name, pool, configs in (("fp8_mgpu", pool8, FP8_MGPU_CONFIGS),
                                ("bf16_split_mgpu", pool_bf16, ((64, 2, True),))):
        runs = (q, pool, tables, lens)
        ref = pk.paged_decode_attention(q, pool, jnp.int32(0), tables[0], lens, scale=scale)
        for block_kv, slots, split in configs:
            label = _mgpu_label(block_kv, slots, split)

            def f(i, q, pool, tables, lens, kw=dict(block_kv=block_kv, max_concurrent_steps=slots, split_keys=split)):
                return mgpu(q, pool, jnp.int32(0), tables[i], lens, scale=scale, **kw)
            t = _checked_time(f"{name}:{label}", f, runs, nrot, row, ref)
            if t is not None:
                row[f"{name}_us[{label}]"] = us = t * 1e6
                if name == "fp8_mgpu" and us < row.get("fp8_mgpu_us", math.inf):
                    row["fp8_mgpu_us"], row["fp8_mgpu_cfg"] = us, label
    if "fp8_mgpu_us[128,2]" in row and triton_fp8_us:
        row["fp8_mgpu_vs_triton"] = triton_fp8_us / row["fp8_mgpu_us[128,2]"]


def _time_routed_fp8(row):
    """routed_fp8_us: attention()'s choice on the e4m3 pool (the Mosaic kernel with MOSAIC_FP8_DECODE_CONFIG where
    the bf16 pool's decode took it and the head size is at least MOSAIC_FP8_DECODE_MIN_HEAD_DIM, else the Triton
    kernel's default); routed_fp8_speedup: the bf16 pool's routed time over it."""
    head_dim = LAYOUTS[row["layout"]][2]
    cfg = pk.MOSAIC_FP8_DECODE_CONFIG
    label = f"fp8_mgpu_us[{_mgpu_label(cfg['block_kv'], cfg['max_concurrent_steps'], cfg['split_keys'])}]"
    mosaic = (row.get("routed_kernel") == "mosaic" and head_dim >= pk.MOSAIC_FP8_DECODE_MIN_HEAD_DIM
              and label in row)
    us = row[label] if mosaic else row.get("fp8_default_us")
    if us is not None and "routed_us" in row:
        row["routed_fp8_us"], row["routed_fp8_speedup"] = us, row["routed_us"] / us


def _variant_label(kw: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(kw.items()))


def _time_decode_variants(args, row, data, nrot, scale):
    """The default decode configuration with each keyword set of --decode-variants, checked against the
    default's output first: row['variant_us[<k=v,...>]']."""
    if SMOKE or not args.decode_variants:
        return
    q, pool, tables, lens = data
    ref = pk.paged_decode_attention(q, pool, jnp.int32(0), tables[0], lens, scale=scale)
    for kw in args.decode_variants:
        def f(i, q, pool, tables, lens, kw=kw):
            return pk.paged_decode_attention(q, pool, jnp.int32(0), tables[i], lens, scale=scale, **kw)
        t = _checked_time(f"variant:{_variant_label(kw)}", f, data, nrot, row, ref)
        if t is not None:
            row[f"variant_us[{_variant_label(kw)}]"] = t * 1e6


# JAX's paged_attention in BENCHMARKS.md's kernel anchor table (H100, jax 0.11.2, measured 2026-11-22), us
JAX_ANCHOR_US = {
    ("qwen2-0.5b", 16, 1024): 118, ("qwen2-0.5b", 64, 1024): 145, ("qwen2-0.5b", 64, 4096): 201,
    ("qwen2-0.5b", 256, 1024): 252, ("qwen2-0.5b", 256, 4096): 522, ("qwen2-0.5b", 16, 8192): 174,
    ("llama3-8b", 16, 1024): 354, ("llama3-8b", 64, 1024): 348, ("llama3-8b", 64, 4096): 715,
    ("llama3-8b", 256, 1024): 866, ("llama3-8b", 256, 4096): 2281, ("llama3-8b", 16, 8192): 397,
}


def _routed(row, pairs):
    """The kernel attention() runs for this decode outside while loops: the Mosaic decode kernel from
    MOSAIC_DECODE_MIN_PAIRS (request, kv head) pairs where it was timed (its default configuration,
    '128,2'), or where it declines the call the wide-head one ('64,2'), else the Triton kernel's default; with
    its ratio to JAX's op in this run and in the BENCHMARKS.md anchor table."""
    mosaic = pairs >= pk.MOSAIC_DECODE_MIN_PAIRS and "mgpu_us[128,2]" in row
    # where the packed kernel declines (head size 256, a soft cap): the wide-head one at its default, 64 keys x 2 slots
    wide = pairs >= pk.MOSAIC_DECODE_MIN_PAIRS and not mosaic and "wide_us[64,2]" in row
    us = row["mgpu_us[128,2]"] if mosaic else row["wide_us[64,2]"] if wide else row.get("default_us")
    if us is None:
        return
    row["routed_us"], row["routed_kernel"] = us, "mosaic" if mosaic else "mosaic-wide" if wide else "triton"
    row["routed_tbps"] = row["kv_bytes"] / us / 1e6
    if "jax_us" in row:
        row["routed_vs_jax"] = row["jax_us"] / us
    anchor = JAX_ANCHOR_US.get((row["layout"], row["seqs"], row["ctx"]))
    if anchor:
        row["routed_vs_anchor"] = anchor / us


def _mgpu_variant(cfg: tuple) -> tuple[str, dict]:
    """(label, keyword arguments of ragged_paged_attention_mgpu) of one --mgpu-configs entry."""
    block_kv, slots, ctas = cfg
    kw = dict(block_kv=block_kv, max_concurrent_steps=slots)
    if ctas is not None:       # 0: more CTAs than items, so each runs one (capped in the op)
        kw["num_ctas"] = ctas or 1 << 30
    return f"{block_kv},{slots}" + ("" if ctas is None else f",{ctas}"), kw


def _checked_time(what, f, data, n, row, ref=None):
    """f's seconds per op (time_op), or None with the reason printed: f raised, or, where ref is given,
    f(0, *data) is off it by a relative error over 1e-2 (recorded in row as rel_err[what])."""
    try:
        if ref is not None:
            row[f"rel_err[{what}]"] = err = rel_err(f(0, *data), ref)
            if not err <= 1e-2:
                print(f"{what}: rel err {err:.2e} against the Triton kernel; not timed")
                return None
        return time_op(f, data, n)[0]
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"{what} failed: {type(e).__name__}: {str(e)[:300]}")
        return None


def _time_decode_configs(name, op, configs, row, data, nrot, kv_bytes, ref, **op_kw):
    """op (a Mosaic decode kernel) at each of configs (--mgpu-configs entries), each first checked against ref:
    row[name_us[label]] and [name_tbps[label]], and the fastest as name_us, name_tbps, name_cfg."""
    for cfg in configs:
        label, kw = _mgpu_variant(cfg)

        def f(i, q, pool, tables, lens, kw=kw):
            return op(q, pool, jnp.int32(0), tables[i], lens, **op_kw, **kw)
        t = _checked_time(f"{name}:{label}", f, data, nrot, row, ref)
        if t is not None:
            us, tbps = t * 1e6, kv_bytes / t / 1e12
            row[f"{name}_us[{label}]"], row[f"{name}_tbps[{label}]"] = us, tbps
            if us < row.get(f"{name}_us", math.inf):
                row[f"{name}_us"], row[f"{name}_tbps"], row[f"{name}_cfg"] = us, tbps, label


def _time_decode_mgpu(args, row, data, nrot, kv_bytes, scale):
    """The Mosaic GPU decode kernel (paged_decode_attention_mgpu: the persistent ragged kernel with the G
    heads of a kv head packed into one tile) for each of --decode-mgpu-configs, each first checked
    against the Triton decode kernel's output; the fastest goes in the table as 'mgpu'."""
    if SMOKE or not args.decode_mgpu_configs:
        return
    from pallas_kernels.paged_decode_attention_mgpu import paged_decode_attention_mgpu as mgpu
    q, pool, tables, lens = data
    ref = pk.paged_decode_attention(q, pool, jnp.int32(0), tables[0], lens, scale=scale)
    _time_decode_configs("mgpu", mgpu, args.decode_mgpu_configs, row, data, nrot, kv_bytes, ref, scale=scale)


def _time_decode_mgpu_wide(args, row, data, nrot, kv_bytes, scale, cap):
    """The wide-head Mosaic decode kernel (paged_decode_attention_mgpu_wide: one compute warpgroup, a pair's
    rows on the 8-row grid; the layout's soft cap) for each of --decode-wide-configs that fits its shared
    memory, each first checked against the Triton decode kernel's output; the fastest is 'wide'."""
    if SMOKE or not args.decode_wide_configs:
        return
    from pallas_kernels.paged_decode_attention_mgpu_wide import (mgpu_wide_decode_supported,
                                                                 paged_decode_attention_mgpu_wide as wide, smem_bytes)
    from pallas_kernels.ragged_paged_attention_mgpu import _SMEM_BYTES
    q, pool, tables, lens = data
    if mgpu_wide_decode_supported(q, pool) is not None:
        return
    ref = pk.paged_decode_attention(q, pool, jnp.int32(0), tables[0], lens, scale=scale, soft_cap=cap)
    fits = [c for c in args.decode_wide_configs if smem_bytes(q.shape[-1], c[0], c[1]) <= _SMEM_BYTES]
    _time_decode_configs("wide", wide, fits, row, data, nrot, kv_bytes, ref, scale=scale, soft_cap=cap)


def _parts(text: str) -> list[str]:
    """--parts: 'decode,kvwrite' -> ['decode', 'kvwrite']; the kernel check moved to tests/kernels."""
    parts = [p for p in text.split(",") if p]
    if "check" in parts:
        raise argparse.ArgumentTypeError("the kernel check is `JAX_PLATFORMS=cuda python -m pytest tests/kernels` "
                                         "on the GPU now (the same test cases as the CPU's, plus the real sizes)")
    unknown = [p for p in parts if p not in PART_SHARE]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown parts {unknown}; choose from {list(PART_SHARE)}")
    return parts


def _shapes(text: str) -> set[tuple[int, int]]:
    """--decode-shapes: '16x1024,64x4096' -> {(16, 1024), (64, 4096)}."""
    try:
        return {tuple(int(x) for x in item.split("x")) for item in text.split(",") if item}
    except ValueError:
        raise argparse.ArgumentTypeError(f"shapes are SEQSxCTX separated by ',': {text!r}") from None


def _configs(text: str) -> list[tuple]:
    """--decode-configs / --prefill-configs: 'a,b,c,d;...' -> [(int, int, int, int)]."""
    configs = [c.split(",") for c in text.split(";") if c]
    if any(len(c) != 4 for c in configs):      # caught here, not after the device has started
        raise argparse.ArgumentTypeError(f"each config is four integers separated by ',': {text!r}")
    return [tuple(int(x) for x in c) for c in configs]


# -------------------------------------------------------------------------------------------- prefill
PREFILL_SHAPES = [(1, 512), (16, 512), (1, 2048), (4, 2048), (1, 8192), (4, 8192)]
PREFILL_CONFIGS = [  # (block_m, block_k, num_warps, num_stages), swept besides the op's own default
    (128, 64, 4, 2), (128, 64, 8, 3), (64, 64, 4, 2),
]


def _variants(text: str) -> list[dict]:
    """--decode-variants: 'a=1,b=True;c=None' -> [{'a': 1, 'b': True}, {'c': None}]."""
    import ast
    out = []
    for item in (t for t in text.split(";") if t):
        kw = {}
        for pair in item.split(","):
            key, sep, value = pair.partition("=")
            if not sep:
                raise argparse.ArgumentTypeError(f"each variant is k=v pairs separated by ',': {text!r}")
            try:
                kw[key.strip()] = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                raise argparse.ArgumentTypeError(f"{value!r} is not a Python literal") from None
        out.append(kw)
    return out


def _mgpu_configs(text: str) -> list[tuple]:
    """--mgpu-configs: 'block_kv,max_concurrent_steps[,num_ctas];...' -> [(int, int, int | None)].

    num_ctas: the kernel's persistent CTAs (absent: its default, one per SM; 0: one CTA per work item,
    i.e. not persistent, for A/B runs)."""
    configs = [c.split(",") for c in text.split(";") if c]
    if any(len(c) not in (2, 3) for c in configs):
        raise argparse.ArgumentTypeError(
            f"each Mosaic GPU config is block_kv,max_concurrent_steps[,num_ctas]: {text!r}")
    return [(int(c[0]), int(c[1]), int(c[2]) if len(c) == 3 else None) for c in configs]


def _prefill_variants(args):
    """(label, kwargs, op) for each prefill kernel run: the Triton op's default, the swept configs, and
    the Mosaic GPU kernel where it exists (Hopper only)."""
    triton = pk.ragged_paged_attention_pallas
    out = [("default", {}, triton)]
    for bm, bk, warps, stages in PREFILL_CONFIGS[:1] if SMOKE else args.prefill_configs:
        out.append((f"{bm},{bk},{warps},{stages}",
                    dict(block_m=bm, block_k=bk, num_warps=warps, num_stages=stages), triton))
    try:                       # the Mosaic GPU kernel, where this checkout has it
        from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu as mgpu
    except ImportError:
        mgpu = None
    if mgpu is not None and not SMOKE:
        for cfg in args.mgpu_configs:
            label, kw = _mgpu_variant(cfg)
            out.append((f"mgpu:{label}", kw, mgpu))
    return out


def _time_prefill_variants(args, row, flops, d, data, reps):
    """Times every variant; fills row with each one's TFLOP/s, the default's and the best Triton one's."""
    best = None
    triton_out = None          # the Triton kernel's output on rotation 0, what every Mosaic run must match
    for label, kwargs, op in _prefill_variants(args):
        def f(i, qs, pool, tables, lens, qsl, kwargs=kwargs, op=op):
            return op(qs[i], pool, jnp.int32(0), tables, lens, qsl, scale=d ** -0.5, **kwargs)
        if label.startswith("mgpu") and triton_out is None:   # Mosaic runs are timed only if they match
            qs, rest = data[0], data[1:]
            try:
                triton_out = pk.ragged_paged_attention_pallas(qs[0], rest[0], jnp.int32(0), *rest[1:],
                                                              scale=d ** -0.5)
            except Exception as e:  # noqa: BLE001
                print(f"prefill: no Triton output to check {label} against: {type(e).__name__}: {str(e)[:200]}")
                continue
        t = _checked_time(label, f, data, reps, row, triton_out if label.startswith("mgpu") else None)
        if t is None:
            continue
        row[f"tflops[{label}]"] = flops / t / 1e12
        if label == "default":
            row["default_us"], row["default_tflops"] = t * 1e6, flops / t / 1e12
        elif label.startswith("mgpu"):
            if "mgpu_us" not in row or t * 1e6 < row["mgpu_us"]:
                row["mgpu_us"], row["mgpu_tflops"], row["mgpu_cfg"] = t * 1e6, flops / t / 1e12, label[5:]
            continue
        if best is None or t < best[0]:
            best = (t, label)
    if best:
        row["ours_us"], row["ours_cfg"], row["ours_tflops"] = best[0] * 1e6, best[1], flops / best[0] / 1e12


def _time_prefill_fp8(row, flops, d, data, reps):
    """The same prefill over the pool in e4m3: the Triton kernel and the Mosaic kernel's default config
    (fp8_triton_tflops, fp8_mgpu_tflops), the Mosaic run checked against the Triton one first."""
    from pallas_kernels._checks import FP8_CACHE_DTYPE, to_cache
    from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu
    qs, pool, *rest = data
    data8 = (qs, to_cache(pool, FP8_CACHE_DTYPE), *rest)
    ref = None
    for label, op in (("triton", pk.ragged_paged_attention_pallas), ("mgpu", ragged_paged_attention_mgpu)):
        def f(i, qs, pool, tables, lens, qsl, op=op):
            return op(qs[i], pool, jnp.int32(0), tables, lens, qsl, scale=d ** -0.5)
        t = _checked_time(f"fp8_{label}", f, data8, reps, row, ref)
        if t is not None:
            row[f"fp8_{label}_us"], row[f"fp8_{label}_tflops"] = t * 1e6, flops / t / 1e12
        if label == "triton":
            ref = f(0, *data8)


def prefill_bench(args, results):
    rng = np.random.default_rng(1)
    rows = results["prefill"] = []
    for name, (n, k, d) in _layouts(args):
        for seqs, length in [(2, 64)] if SMOKE else PREFILL_SHAPES:
            if over_budget(args):
                print("prefill: out of time budget, stopping", flush=True)
                results["prefill"] = rows
                return
            t_tok = seqs * length
            m = length // BLOCK
            pool = make_pool(rng, seqs * m + 1, k, d)
            tables = random_tables(rng, 1, seqs, m, seqs * m + 1)[0]
            lens = jnp.full((seqs,), length, jnp.int32)
            qsl = jnp.arange(seqs + 1, dtype=jnp.int32) * length
            reps = reps_for(4 * seqs * length * length * n * d / 2 / 2.5e14, 2, 48)
            qs = [jax.random.normal(jax.random.PRNGKey(seqs + length + i), (t_tok, n, d)).astype(jnp.bfloat16)
                  for i in range(2 * reps)]
            flops = 4 * seqs * length * length * n * d / 2
            row = {"layout": name, "seqs": seqs, "len": length, "reps": reps}
            _time_prefill_variants(args, row, flops, d, (qs, pool, tables, lens, qsl), reps)
            if args.fp8_cache:
                _time_prefill_fp8(row, flops, d, (qs, pool, tables, lens, qsl), reps)
            qd = [q.reshape(seqs, length, n, d) for q in qs]
            kd = jax.random.normal(jax.random.PRNGKey(7), (seqs, length, k, d)).astype(jnp.bfloat16)
            vd = jax.random.normal(jax.random.PRNGKey(8), (seqs, length, k, d)).astype(jnp.bfloat16)
            def cud(i, qd, k_, v_):
                return jax.nn.dot_product_attention(qd[i], k_, v_, is_causal=True, scale=d ** -0.5,
                                                    implementation="cudnn")
            try:
                t, _ = time_op(cud, (qd, kd, vd), reps)
                row["cudnn_us"], row["cudnn_tflops"] = t * 1e6, flops / t / 1e12
                for key in ("default", "ours", "mgpu"):
                    if f"{key}_tflops" in row:
                        row[f"{key}_vs_cudnn"] = row[f"{key}_tflops"] / row["cudnn_tflops"]
            except Exception as e:  # noqa: BLE001
                print(f"cudnn failed: {type(e).__name__}: {str(e)[:300]}")
            del pool, qs, qd
            print("prefill", json.dumps({k_: (round(v, 3) if isinstance(v, float) else v)
                                         for k_, v in row.items()}), flush=True)
            rows.append(row)
    results["prefill"] = rows


# -------------------------------------------------------------------------------------------- kvwrite
def kvwrite_bench(args, results):
    rng = np.random.default_rng(2)
    rows = results["kvwrite"] = []
    for name, (n, k, d) in _layouts(args):
        nb = 65 if SMOKE else 4097
        for t_tok in (16,) if SMOKE else (256, 8192):
            pool = make_pool(rng, nb, k, d, layers=4)
            slots = jnp.asarray(rng.permutation(np.arange(BLOCK, nb * BLOCK))[:t_tok].astype(np.int32))
            kk = jax.random.normal(jax.random.PRNGKey(1), (t_tok, k, d)).astype(jnp.bfloat16)
            row = {"layout": name, "tokens": t_tok}
            for label, fn in (("pallas", pk.write_kv_pallas), ("xla", pk.write_kv_reference)):
                f = jax.jit(lambda pool, kk, slots, fn=fn: fn(pool, jnp.int32(2), kk, kk, slots),
                            donate_argnums=0)
                pool = f(pool, kk, slots)
                ts = []
                for _ in range(21):
                    t = time.perf_counter()
                    pool = f(pool, kk, slots)
                    jax.block_until_ready(pool)
                    ts.append(time.perf_counter() - t)
                row[f"{label}_us"] = float(np.median(ts)) * 1e6
            print("kvwrite", json.dumps(row), flush=True)
            rows.append(row)
            del pool
    results["kvwrite"] = rows


# -------------------------------------------------------------------------------------------- outputs
def write_outputs(args, results):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0].device_kind.replace(" ", "_")
    stem = out / f"kernels_{dev}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1))
    lines = [f"# Kernel benchmark — {results['device']}, jax {results['jax']}, rev {results['git_rev']}",
             f"command: `{results['command']}` at {results['date']}", ""]
    lines += [f"## Decode (bf16, block {BLOCK}; TB/s of K+V read, ceiling 2.53)", "",
              "Times are device-throughput per op ((t(2n) - t(n)) / n, see time_op); 'wall' adds the dispatch "
              "of one jitted call of n ops, divided by n. 'best' = best of the swept configs (cfg = keys per "
              "iteration, warps, splits, stages); 'default' = the configuration the model gets.", "",
              "| layout | seqs x ctx | best µs | best TB/s | cfg | default µs | default TB/s | JAX µs | JAX TB/s "
              "| best / JAX speedup | default / JAX speedup | default wall µs | JAX wall µs "
              "| mgpu µs | mgpu TB/s | mgpu cfg | mgpu / JAX speedup |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results.get("decode", []):
        lines.append(f"| {r['layout']} | {r['seqs']} x {r['ctx']} | {r.get('ours_us', float('nan')):.1f} | "
                     f"{r.get('ours_tbps', float('nan')):.2f} | {r.get('ours_cfg', '')} | "
                     f"{r.get('default_us', float('nan')):.1f} | {r.get('default_tbps', float('nan')):.2f} | "
                     f"{r.get('jax_us', float('nan')):.1f} | {r.get('jax_tbps', float('nan')):.2f} | "
                     f"{r.get('speedup', float('nan')):.2f} | "
                     f"{r.get('jax_us', float('nan')) / r.get('default_us', float('nan')):.2f} | "
                     f"{r.get('default_wall_us', float('nan')):.1f} | "
                     f"{r.get('jax_wall_us', float('nan')):.1f} | "
                     f"{r.get('mgpu_us', float('nan')):.1f} | {r.get('mgpu_tbps', float('nan')):.2f} | "
                     f"{r.get('mgpu_cfg', '')} | "
                     f"{r.get('jax_us', float('nan')) / r.get('mgpu_us', float('nan')):.2f} |")
    wide = [r for r in results.get("decode", []) if "wide_us" in r]
    if wide:
        lines += ["", "## Decode on the wide-head Mosaic kernel (paged_decode_attention_mgpu_wide, best of "
                  "--decode-wide-configs: block_kv, slots)", "",
                  "| layout | seqs x ctx | Triton default µs | Mosaic (packed) µs | wide µs | wide TB/s | wide cfg "
                  "| default / wide |", "|---|---|---|---|---|---|---|---|"]
        for r in wide:
            lines.append(f"| {r['layout']} | {r['seqs']} x {r['ctx']} | {r.get('default_us', float('nan')):.1f} | "
                         f"{r.get('mgpu_us', float('nan')):.1f} | {r['wide_us']:.1f} | {r['wide_tbps']:.2f} | "
                         f"{r['wide_cfg']} | {r.get('default_us', float('nan')) / r['wide_us']:.2f} |")
    varied = [r for r in results.get("decode", []) if any(k.startswith("variant_us[") for k in r)]
    if varied:
        names = sorted({k[11:-1] for r in varied for k in r if k.startswith("variant_us[")})
        lines += ["", "## Decode variants of the default configuration (µs)", "",
                  "| layout | seqs x ctx | default | " + " | ".join(names) + " | JAX |",
                  "|---|---|---|" + "---|" * (len(names) + 1)]
        for r in varied:
            lines.append(f"| {r['layout']} | {r['seqs']} x {r['ctx']} | {r.get('default_us', float('nan')):.1f} | "
                         + " | ".join(f"{r.get(f'variant_us[{n}]', float('nan')):.1f}" for n in names)
                         + f" | {r.get('jax_us', float('nan')):.1f} |")
    routed = [r for r in results.get("decode", []) if "routed_us" in r]
    if routed:
        nan = float("nan")
        lines += ["", "## Decode as the model routes it (attention() outside while loops)", "",
                  f"Mosaic decode kernel from {pk.MOSAIC_DECODE_MIN_PAIRS} (request, kv head) pairs, the Triton "
                  "kernel below; ratios to JAX's op in this run and to BENCHMARKS.md's anchor table.", "",
                  "| layout | seqs x ctx | kernel | µs | TB/s | JAX µs (this run) | x JAX | JAX anchor µs | x anchor |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in routed:
            anchor = JAX_ANCHOR_US.get((r["layout"], r["seqs"], r["ctx"]))
            lines.append(f"| {r['layout']} | {r['seqs']} x {r['ctx']} | {r['routed_kernel']} | {r['routed_us']:.1f} | "
                         f"{r['routed_tbps']:.2f} | {r.get('jax_us', nan):.1f} | {r.get('routed_vs_jax', nan):.2f} | "
                         f"{anchor or ''} | {r.get('routed_vs_anchor', nan):.2f} |")
    lines += ["", "## Prefill (causal, TFLOP/s counting the causal half)", "",
              "'default' = the Triton kernel as the model calls it; 'best' = best of it and the swept Triton "
              "configs (cfg = block_m, block_k, warps, stages); 'mgpu' = the best Mosaic GPU configuration "
              "(block_kv, slots).", "",
              "| layout | seqs x len | default µs | default TFLOP/s | best TFLOP/s | cfg | mgpu TFLOP/s "
              "| cuDNN TFLOP/s | default / cuDNN | best / cuDNN | mgpu / cuDNN |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for r in results.get("prefill", []):
        lines.append(f"| {r['layout']} | {r['seqs']} x {r['len']} | {r.get('default_us', nan):.1f} | "
                     f"{r.get('default_tflops', nan):.1f} | {r.get('ours_tflops', nan):.1f} | "
                     f"{r.get('ours_cfg', '')} | {r.get('mgpu_tflops', nan):.1f} ({r.get('mgpu_cfg', '')}) | "
                     f"{r.get('cudnn_tflops', nan):.1f} | {r.get('default_vs_cudnn', nan):.2f} | "
                     f"{r.get('ours_vs_cudnn', nan):.2f} | {r.get('mgpu_vs_cudnn', nan):.2f} |")
    if results.get("kvwrite"):
        lines += ["", "## KV write (one layer, donated pool)", "", "| layout | tokens | pallas µs | xla µs |",
                  "|---|---|---|---|"]
        for r in results["kvwrite"]:
            lines.append(f"| {r['layout']} | {r['tokens']} | {r['pallas_us']:.1f} | {r['xla_us']:.1f} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
        dec = results.get("decode", [])
        labels = [f"{r['layout'][:5]} {r['seqs']}x{r['ctx'] // 1024}k" for r in dec]
        x = np.arange(len(dec))
        axes[0].bar(x - 0.2, [r.get("ours_tbps", 0) for r in dec], 0.4, label="ours")
        axes[0].bar(x + 0.2, [r.get("jax_tbps", 0) for r in dec], 0.4, label="JAX paged_attention")
        axes[0].axhline(HBM_TBPS, color="k", ls="--", lw=0.8)
        axes[0].set_xticks(x, labels, rotation=70, fontsize=7)
        axes[0].set_ylabel("TB/s KV read")
        axes[0].legend()
        pre = results.get("prefill", [])
        labels = [f"{r['layout'][:5]} {r['seqs']}x{r['len']}" for r in pre]
        x = np.arange(len(pre))
        for j, (key, label) in enumerate((("default_tflops", "ours (Triton, default)"),
                                          ("mgpu_tflops", "ours (Mosaic GPU)"), ("cudnn_tflops", "cuDNN"))):
            axes[1].bar(x + (j - 1) * 0.27, [r.get(key, 0) for r in pre], 0.27, label=label)
        axes[1].set_xticks(x, labels, rotation=70, fontsize=7)
        axes[1].set_ylabel("TFLOP/s (causal)")
        axes[1].legend()
        fig.suptitle(f"{results['device']} jax {results['jax']} {results['git_rev'][:10]}")
        fig.tight_layout()
        fig.savefig(stem.with_suffix(".png"), dpi=110)
    except Exception as e:  # noqa: BLE001
        print("plot failed:", e)
    print("\n".join(lines), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO_ROOT / "bench" / "results"))
    ap.add_argument("--git-rev", default=os.environ.get("JAXPAGED_GIT_REV", "unknown"))
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--parts", type=_parts, default="decode,prefill,kvwrite",
                    help=f"parts to run, of {list(PART_SHARE)}")
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS, help=f"head layouts to run, of {list(LAYOUTS)}")
    ap.add_argument("--fp8-cache", action="store_true",
                    help="also time the pool in e4m3 (--kv-cache-dtype fp8): decode on the Triton kernel (default and "
                         "FP8_DECODE_CONFIGS) and the Mosaic one (FP8_MGPU_CONFIGS), prefill on both")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU interpret mode)")
    ap.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32),
                    help="KV cache block size (tokens) of every pool and table; the engine's default is 16")
    ap.add_argument("--decode-configs", type=_configs, default=DECODE_CONFIGS,
                    help="decode configurations to sweep besides the default: "
                         "'keys,warps,programs_per_sm,stages' separated by ';' "
                         "(choose_splits fits the programs in one wave of programs_per_sm per SM; "
                         "a negative value -N asks for N splits)")
    ap.add_argument("--prefill-configs", type=_configs, default=PREFILL_CONFIGS,
                    help="prefill configurations to sweep besides the op's default: "
                         "'block_m,block_k,warps,stages' separated by ';'")
    ap.add_argument("--decode-shapes", type=_shapes, default=None,
                    help="only these decode shapes, 'SEQSxCTX,...' (e.g. '16x1024,64x4096'); default all")
    ap.add_argument("--decode-variants", type=_variants, default=[],
                    help="also check and time the default decode configuration with each of these keyword "
                         "sets of paged_decode_attention, 'k=v,k=v;k=v' (values as Python literals, e.g. "
                         "'num_stages=3;num_warps=4'); default none")
    ap.add_argument("--decode-mgpu-configs", type=_mgpu_configs, default=[],
                    help="also time the Mosaic GPU decode kernel (paged_decode_attention_mgpu) on the decode "
                         "batches: configurations as --mgpu-configs (e.g. '128,2;64,4'); default none")
    ap.add_argument("--decode-wide-configs", type=_mgpu_configs, default=[],
                    help="also time the wide-head Mosaic decode kernel (paged_decode_attention_mgpu_wide) on the "
                         "decode batches of head size 128 and 256: configurations as --mgpu-configs, those over its "
                         "shared memory skipped (e.g. '64,2;128,2;64,4'); default none")
    ap.add_argument("--mgpu-configs", type=_mgpu_configs, default=[(128, 2, None)],
                    help="Mosaic GPU prefill kernel configurations 'block_kv,max_concurrent_steps[,num_ctas]' "
                         "separated by ';' ('' for none; num_ctas 0: one CTA per work item, not persistent); "
                         "the best is reported, each one's TFLOP/s is in the JSON")
    args = ap.parse_args()
    globals()["BLOCK"] = args.block_size        # module constant used by every helper
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "git_rev": args.git_rev,
               "block_size": BLOCK,
               "command": shlex.join(sys.argv), "date": datetime.datetime.now().isoformat(timespec="seconds")}
    print(results, flush=True)
    try:
        for part, fn in (("decode", decode_bench), ("prefill", prefill_bench), ("kvwrite", kvwrite_bench)):
            _PART[0] = part
            if part in args.parts and not over_budget(args):
                try:
                    fn(args, results)
                except Exception as e:  # noqa: BLE001 - keep the other parts' results
                    import traceback
                    traceback.print_exc()
                    results[f"{part}_error"] = f"{type(e).__name__}: {e}"[:2000]
    finally:
        write_outputs(args, results)


if __name__ == "__main__":
    main()
