"""The model families table (issue "model families", its GPU point): each family's dummy-weight offline
throughput on llama3-8b's ShareGPT 1000 workload against llama3-8b's own, scaled by the weight bytes a decode
step reads.

A decode-bound step reads every layer's weights and the LM head once, so at equal efficiency a model's output
tok/s is llama3-8b's times llama3-8b's bytes over the model's: `expected`. `ratio` = measured / expected; the
issue's bar is within 15% (0.85 or better). Reads bench/results/families-<model>.json (bench/families.sh writes
them with bench/throughput.py) and writes bench/results/families.{json,md,png}.

  python -m bench.families [--models llama3-8b,mistral-7b,...] [--results DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

if __package__ in (None, ""):   # run as a file: see bench/common.py add_repo_to_path
    _bench = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _bench]
    sys.path.append(str(_bench.parent))

FAMILIES = ("llama3-8b", "mistral-7b", "gemma-2-9b", "glm-4-9b", "baichuan2-13b")
BASE = "llama3-8b"


def step_weight_bytes(model: str) -> int:
    """Bytes of the weights one decode step reads in bf16: every layer's, the final norm and the LM head (the
    embedding table itself is only gathered, unless it is the tied head)."""
    import jax
    import jax.numpy as jnp

    from bench.models import ensure_model_dir
    from jaxpaged.models.loader import model_config, param_shapes
    cfg = model_config(ensure_model_dir(model))
    shapes = param_shapes(cfg, jnp.bfloat16)
    total = 0
    for path, sds in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        top = getattr(path[0], "key", "")
        if top == "embed_tokens" and not cfg.tie_word_embeddings:
            continue
        total += math.prod(sds.shape) * jnp.dtype(sds.dtype).itemsize
    return total


def table(models: list[str], results: Path) -> list[dict]:
    rows = []
    base = None
    for m in models:
        path = results / f"families-{m}.json"
        if not path.exists():
            print(f"{m}: no {path.name}")
            continue
        doc = json.loads(path.read_text())
        tps = doc["metrics"]["output_tokens_per_second"]
        row = {"model": m, "output_tok_s": tps, "weight_gib": step_weight_bytes(m) / 2**30,
               "device": doc["meta"].get("device"), "revision": doc["meta"].get("git_revision")}
        if m == BASE:
            base = row
        rows.append(row)
    if base is None:
        raise SystemExit(f"{BASE}'s result is needed to scale the others")
    for row in rows:
        row["expected_tok_s"] = base["output_tok_s"] * base["weight_gib"] / row["weight_gib"]
        row["ratio"] = row["output_tok_s"] / row["expected_tok_s"]
        row["within_15pct"] = row["ratio"] >= 0.85
    return rows


def main() -> None:
    from bench.common import RESULTS_DIR, bar_plot, stamp
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(FAMILIES))
    p.add_argument("--results", default=str(RESULTS_DIR))
    args = p.parse_args()
    results = Path(args.results)
    rows = table(args.models.split(","), results)
    lines = ["| model | weights a step reads (GiB, bf16) | output tok/s | expected from llama3-8b | ratio "
             "| within 15% |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['weight_gib']:.2f} | {r['output_tok_s']:,.0f} | {r['expected_tok_s']:,.0f} | "
              f"{r['ratio']:.2f} | {'yes' if r['within_15pct'] else 'no'} |" for r in rows]
    devices = sorted({str(r["device"]) for r in rows})
    md = "\n".join(["# Model families, dummy weights, ShareGPT 1000 (llama3-8b's workload)", "",
                    f"device: {', '.join(devices)}; revisions: {sorted({str(r['revision']) for r in rows})}", ""]
                   + lines) + "\n"
    print(md)
    (results / "families.md").write_text(md)
    (results / "families.json").write_text(json.dumps({"meta": stamp(sys.argv), "rows": rows}, indent=2) + "\n")
    bar_plot(results / "families.png", [r["model"] for r in rows], [r["ratio"] for r in rows],
             "measured / expected output tok/s", "Families against llama3-8b, scaled by weight bytes",
             ", ".join(devices))


if __name__ == "__main__":
    main()
