"""The model families table (issue "model families", its GPU point): each family's dummy-weight offline
throughput on llama3-8b's ShareGPT 1000 workload against llama3-8b's own, scaled two ways.

- `expected` (the issue's bar): a decode-bound step reads every layer's weights and the LM head once, so at
  equal efficiency a model's output tok/s is llama3-8b's times llama3-8b's bytes over the model's. `ratio` =
  measured / expected; the bar is within 15% (0.85 or better).
- `roofline_expected` (what the bar leaves out): the run's floor on the device, prefill FLOPs at the chip's
  dense bf16 peak plus the decode's bytes at its HBM peak, where the decode reads the weights once a step
  (llama3-8b's step count: the workload's, set by its longest request) and every running request's KV cache
  once a step (the workload's context lengths, summed over its decode steps). A model whose KV cache holds
  several times llama3-8b's bytes a token (multi-head attention, head size 256) reads that many times its
  KV each step, which weight bytes alone do not see. `roofline_ratio` = measured / roofline_expected.

Reads bench/results/families-<model>.json (bench/families.sh writes them with bench/throughput.py) and writes
bench/results/families.{json,md,png}.

  python -m bench.families [--models llama3-8b,mistral-7b,...] [--results DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

if __package__ in (None, ""):   # run as a file: see bench/common.py add_repo_to_path
    _bench = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _bench]
    sys.path.append(str(_bench.parent))

FAMILIES = ("llama3-8b", "mistral-7b", "gemma-2-9b", "glm-4-9b", "baichuan2-13b")
BASE = "llama3-8b"


# Dense bf16 tensor-core peak (FLOP/s) and HBM bandwidth (bytes/s) of the devices the table is run on.
DEVICE_PEAKS = {"NVIDIA H100 80GB HBM3": (989e12, 3.35e12), "NVIDIA H200": (989e12, 4.8e12)}


class ModelCosts(NamedTuple):
    step_weight_bytes: int          # the weights one decode step reads in bf16
    layer_flops_per_token: int      # 2 x the decoder layers' parameters: one prompt token's linear layers
    attn_flops_per_pair: int        # one (query, key) pair's QK and PV products over all layers: 4 x N x D x L
    kv_bytes: tuple[tuple[int, int | None], ...]   # (bf16 K and V bytes a token of context, window) per layer kind


def model_costs(model: str) -> ModelCosts:
    """Weight bytes a decode step reads (every layer's, the final norm and the LM head; the embedding table is
    only gathered, unless it is the tied head), prefill FLOPs and KV bytes, from the config's shapes."""
    import jax
    import jax.numpy as jnp

    from bench.models import ensure_model_dir
    from jaxpaged.models.loader import model_config, param_shapes
    cfg = model_config(ensure_model_dir(model))
    shapes = param_shapes(cfg, jnp.bfloat16)
    weight_bytes = layer_params = 0
    for path, sds in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        top = getattr(path[0], "key", "")
        n = math.prod(sds.shape)
        layer_params += n if top == "layers" else 0
        if top == "embed_tokens" and not cfg.tie_word_embeddings:
            continue
        weight_bytes += n * jnp.dtype(sds.dtype).itemsize
    per_layer = 2 * cfg.num_kv_heads * cfg.head_dim * 2
    windows = [cfg.attention_windows()[k] for k in cfg.layer_kinds() or (0,) * cfg.num_layers]
    kv = tuple((per_layer * windows.count(w), w) for w in dict.fromkeys(windows))
    return ModelCosts(weight_bytes, 2 * layer_params, 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers, kv)


def workload_lengths() -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, output lengths) of the families' workload: llama3-8b's ShareGPT 1000 sample."""
    from bench.datasets import get_dataset
    reqs = get_dataset("sharegpt", "llama3-8b", 1000, 0)
    return (np.array([len(r.prompt_token_ids) for r in reqs], np.int64),
            np.array([r.output_len for r in reqs], np.int64))


def roofline_seconds(costs: ModelCosts, prompt_lens: np.ndarray, output_lens: np.ndarray, num_steps: int,
                     peaks: tuple[float, float]) -> float:
    """The run's floor: prefill FLOPs at the FLOP peak plus the decode's bytes at the HBM peak. A request's
    decode steps read contexts p + 1 ... p + o - 1 (its first token comes from the prefill), each layer's KV
    up to its window: p 3, o 4 -> contexts [4, 5, 6]."""
    flop_peak, byte_peak = peaks
    pairs = int((prompt_lens * (prompt_lens + 1) // 2).sum())         # causal (query, key) pairs of the prompts
    flops = costs.layer_flops_per_token * int(prompt_lens.sum()) + costs.attn_flops_per_pair * pairs
    ctx = np.concatenate([np.arange(p + 1, p + o) for p, o in zip(prompt_lens, output_lens)])
    kv_read = sum(b * int((ctx if w is None else np.minimum(ctx, w)).sum()) for b, w in costs.kv_bytes)
    return flops / flop_peak + (num_steps * costs.step_weight_bytes + kv_read) / byte_peak


def table(models: list[str], results: Path) -> list[dict]:
    rows, docs, costs = [], {}, {}
    for m in models:
        path = results / f"families-{m}.json"
        if not path.exists():
            print(f"{m}: no {path.name}")
            continue
        docs[m] = doc = json.loads(path.read_text())
        costs[m] = model_costs(m)
        rows.append({"model": m, "output_tok_s": doc["metrics"]["output_tokens_per_second"],
                     "weight_gib": costs[m].step_weight_bytes / 2**30,
                     "kv_kib_per_token": sum(b for b, _ in costs[m].kv_bytes) / 2**10,
                     "device": doc["meta"].get("device"), "revision": doc["meta"].get("git_revision")})
    base = next((r for r in rows if r["model"] == BASE), None)
    if base is None:
        raise SystemExit(f"{BASE}'s result is needed to scale the others")
    for row in rows:
        row["expected_tok_s"] = base["output_tok_s"] * base["weight_gib"] / row["weight_gib"]
        row["ratio"] = row["output_tok_s"] / row["expected_tok_s"]
        row["within_15pct"] = row["ratio"] >= 0.85
    peaks = DEVICE_PEAKS.get(str(base["device"]))
    num_steps = docs[BASE]["metrics"].get("step_split", {}).get("num_steps")
    if peaks is None or not num_steps:
        print(f"no roofline column: peaks of {base['device']!r} unknown, or {BASE}'s step count missing")
        return rows
    prompt_lens, output_lens = workload_lengths()
    floor = {r["model"]: roofline_seconds(costs[r["model"]], prompt_lens, output_lens, num_steps, peaks)
             for r in rows}
    for row in rows:
        row["roofline_s"] = floor[row["model"]]
        row["roofline_expected_tok_s"] = base["output_tok_s"] * floor[BASE] / floor[row["model"]]
        row["roofline_ratio"] = row["output_tok_s"] / row["roofline_expected_tok_s"]
    return rows


def markdown(rows: list[dict]) -> str:
    roof = all("roofline_ratio" in r for r in rows)
    head = ("| model | weights a step reads (GiB, bf16) | KV a token (KiB) | output tok/s | expected from llama3-8b "
            "| ratio | within 15% |" + (" roofline-scaled expected | roofline ratio |" if roof else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        line = (f"| {r['model']} | {r['weight_gib']:.2f} | {r['kv_kib_per_token']:.0f} | {r['output_tok_s']:,.0f} | "
                f"{r['expected_tok_s']:,.0f} | {r['ratio']:.2f} | {'yes' if r['within_15pct'] else 'no'} |")
        if roof:
            line += f" {r['roofline_expected_tok_s']:,.0f} | {r['roofline_ratio']:.2f} |"
        lines.append(line)
    devices = sorted({str(r["device"]) for r in rows})
    return "\n".join(["# Model families, dummy weights, ShareGPT 1000 (llama3-8b's workload)", "",
                      f"device: {', '.join(devices)}; revisions: {sorted({str(r['revision']) for r in rows})}", "",
                      "expected: llama3-8b's figure scaled by the weight bytes a decode step reads (the issue's bar, "
                      "0.85); roofline-scaled: by the run's floor on the device (prefill FLOPs at the bf16 peak, "
                      "weights once a step and every running request's KV at the HBM peak).", ""] + lines) + "\n"


def main() -> None:
    from bench.common import RESULTS_DIR, bar_plot, stamp
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(FAMILIES))
    p.add_argument("--results", default=str(RESULTS_DIR))
    args = p.parse_args()
    results = Path(args.results)
    rows = table(args.models.split(","), results)
    md = markdown(rows)
    devices = sorted({str(r["device"]) for r in rows})
    print(md)
    (results / "families.md").write_text(md)
    (results / "families.json").write_text(json.dumps({"meta": stamp(sys.argv), "rows": rows}, indent=2) + "\n")
    bar_plot(results / "families.png", [r["model"] for r in rows], [r["ratio"] for r in rows],
             "measured / expected output tok/s", "Families against llama3-8b, scaled by weight bytes",
             ", ".join(devices))
    if all("roofline_ratio" in r for r in rows):
        bar_plot(results / "families-roofline.png", [r["model"] for r in rows], [r["roofline_ratio"] for r in rows],
                 "measured / expected output tok/s", "Families against llama3-8b, scaled by each run's roofline",
                 ", ".join(devices))


if __name__ == "__main__":
    main()
