"""Collects bench/results/*.json into one summary: the headline figures, jaxpaged / HF ratios, the issue-6
targets (met or not), a markdown page and comparison plots.

  python -m bench.summarize [--results-dir DIR] [--out-name suite_summary] [FILES...]

FILES may be result JSONs ({"meta", "metrics"}) or suite bundles (suite-<part>.json, {"results": {...}}),
e.g. the bundles that come back from the GPU machine, so the parts of a split run can be summed up here.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):   # run as a file: see bench/common.py add_repo_to_path
    _bench = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _bench]
    sys.path.append(str(_bench.parent))

from bench.common import RESULTS_DIR, bar_plot, markdown_table, stamp  # noqa: E402

# Issue 6's bars (BENCHMARKS.md has stricter ones: 10,500 / 40,000 tok/s, TPOT 2.0 ms).
TARGETS = {
    "llama3-8b sharegpt output tok/s": 8000.0,
    "qwen2-0.5b sharegpt output tok/s": 20000.0,
    "qwen2-0.5b / best HF (same run)": 25.0,
    "llama3-8b decode step / bandwidth floor (max)": 1.5,
    "openqa c1 median TPOT ms (max)": 2.5,
    "openqa c10 output tok/s": 3000.0,
    "host idle / device busy, qwen2-0.5b profile (max)": 0.15,
}
# The profiled run traced by whole graph launches (run_gpu_suite's profile-qwen-graphs step).
GRAPHS_PROFILE = "throughput-qwen2-0.5b-sharegpt-profile-graphs"
ANCHORS = {"llama3-8b": ("vLLM V1 (PR 14431)", 9534.0)}
SEED_OPENQA = {1: 322.0, 10: 1361.0}   # the seeds' article: vLLM 0.4 on an RTX 4090


def load_results(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """name -> {"meta", "metrics"} from result JSONs and suite bundles."""
    out: dict[str, dict[str, Any]] = {}
    for p in paths:
        try:
            data = json.loads(Path(p).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and "results" in data:          # a suite bundle
            out.update({k: v for k, v in data["results"].items() if isinstance(v, dict) and "metrics" in v})
        elif isinstance(data, dict) and "metrics" in data:
            out[Path(p).stem] = data
    return out


def _metric(results, name, *keys):
    cur: Any = results.get(name, {}).get("metrics")
    for k in keys:
        if not isinstance(cur, dict) or k not in cur:
            return None
        cur = cur[k]
    return cur


def headline(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The figures the issue's targets are about (None where the run is missing)."""
    h: dict[str, Any] = {}
    for model in ("qwen2-0.5b", "llama3-8b"):
        h[f"{model} sharegpt output tok/s"] = _metric(results, f"throughput-{model}-sharegpt",
                                                      "output_tokens_per_second")
        h[f"{model} sharegpt req/s"] = _metric(results, f"throughput-{model}-sharegpt", "requests_per_second")
        h[f"{model} HF static output tok/s"] = _metric(results, f"hf-{model}-sharegpt", "static",
                                                       "output_tokens_per_second")
        h[f"{model} HF continuous output tok/s"] = _metric(results, f"hf-{model}-sharegpt", "continuous",
                                                           "output_tokens_per_second")
        best = _metric(results, f"hf-{model}-sharegpt", "best_output_tokens_per_second")
        ours = h[f"{model} sharegpt output tok/s"]
        h[f"{model} / best HF (same run)"] = ours / best if ours and best else None
    lat = [k for k in results if k.startswith("latency-llama3-8b")]
    h["llama3-8b decode step / bandwidth floor (max)"] = (
        _metric(results, lat[0], "decode_step_over_floor") if lat else None)
    h["llama3-8b decode step ms"] = _metric(results, lat[0], "decode_step_ms") if lat else None
    h["openqa c1 median TPOT ms (max)"] = _metric(results, "serve-openqa-c1", "median_tpot_ms")
    h["openqa c1 output tok/s"] = _metric(results, "serve-openqa-c1", "output_throughput")
    h["openqa c10 output tok/s"] = _metric(results, "serve-openqa-c10", "output_throughput")
    h["openqa c10 median TPOT ms"] = _metric(results, "serve-openqa-c10", "median_tpot_ms")
    profile = "throughput-qwen2-0.5b-sharegpt-profile"
    kernel_level, graph_level = _idle_over_busy(results, profile), _idle_over_busy(results, GRAPHS_PROFILE)
    # The bar is read from the run traced by whole CUDA-graph launches where there is one: kernel-level CUPTI
    # tracing holds the host ~1 ms in every launch of an unrolled step's graph, so it measures the profiler
    # as much as the engine (its idle/busy moves by orders of magnitude from run to run).
    h["host idle / device busy, qwen2-0.5b profile (max)"] = graph_level if graph_level is not None else kernel_level
    h["host idle / device busy, qwen2-0.5b profile, traced by"] = (
        "whole graph launches" if graph_level is not None else "kernels" if kernel_level is not None else None)
    h["host idle / device busy, qwen2-0.5b profile, kernel-level trace"] = kernel_level
    # variants of the profiled run (e.g. -ms32: another step count), each beside the default's figure
    for name in sorted(k for k in results if k.startswith(profile + "-") and k != GRAPHS_PROFILE):
        h[f"host idle / device busy, qwen2-0.5b profile {name[len(profile) + 1:]}"] = _idle_over_busy(results, name)
    return h


def _idle_over_busy(results, name):
    busy = _metric(results, name, "trace", "device_busy_ms")
    idle = _metric(results, name, "trace", "device_idle_ms")
    return idle / busy if busy else None


def check_targets(h: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for key, bar in TARGETS.items():
        val = h.get(key)
        if key == "qwen2-0.5b / best HF (same run)":
            val = h.get("qwen2-0.5b / best HF (same run)")
        is_max = "(max)" in key
        met = None if val is None else (val <= bar if is_max else val >= bar)
        rows.append({"target": key, "bar": ("<= " if is_max else ">= ") + f"{bar:g}",
                     "measured": "not run" if val is None else val,
                     "met": "n/a" if met is None else ("yes" if met else "NO")})
    return rows


def plots(results: dict[str, dict[str, Any]], h: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    made = []
    seen = {k[len("throughput-"):-len("-sharegpt")] for k in results
            if k.startswith("throughput-") and k.endswith("-sharegpt")}
    for model in sorted({"qwen2-0.5b", "llama3-8b"} | seen):
        if model not in ("qwen2-0.5b", "llama3-8b"):   # e.g. tiny-llama in a CPU smoke run
            h = dict(h, **{f"{model} sharegpt output tok/s": _metric(results, f"throughput-{model}-sharegpt",
                                                                     "output_tokens_per_second"),
                           f"{model} HF static output tok/s": _metric(results, f"hf-{model}-sharegpt", "static",
                                                                      "output_tokens_per_second"),
                           f"{model} HF continuous output tok/s": _metric(results, f"hf-{model}-sharegpt",
                                                                          "continuous", "output_tokens_per_second")})
        labels, values = [], []
        for label, key in (("jaxpaged", f"{model} sharegpt output tok/s"),
                           ("HF static", f"{model} HF static output tok/s"),
                           ("HF continuous", f"{model} HF continuous output tok/s")):
            if h.get(key):
                labels.append(label)
                values.append(float(h[key]))
        if model in ANCHORS:
            labels.append(ANCHORS[model][0])
            values.append(ANCHORS[model][1])
        meta = results.get(f"throughput-{model}-sharegpt", {}).get("meta", {})
        ratio = h.get(f"{model} / best HF (same run)")
        if len(labels) > (1 if model in ANCHORS else 0):
            p = bar_plot(out_dir / f"{stem}-{model}-throughput.png", labels, values, "output tokens/s",
                         f"{model}, sharegpt, offline" + (f": jaxpaged = {ratio:.1f}x best HF" if ratio else ""),
                         f"{meta.get('device', '')} · jax {meta.get('jax_version', '')}"
                         f" · {str(meta.get('git_revision', ''))[:12]}")
            if p:
                made.append(p)
    labels, values = [], []
    for conc in (1, 10):
        v = _metric(results, f"serve-openqa-c{conc}", "output_throughput")
        if v:
            labels += [f"jaxpaged c{conc}", f"seeds c{conc} (vLLM 0.4, 4090)"]
            values += [float(v), SEED_OPENQA[conc]]
    if labels:
        meta = results.get("serve-openqa-c1", results.get("serve-openqa-c10", {})).get("meta", {})
        p = bar_plot(out_dir / f"{stem}-openqa-serving.png", labels, values, "output tokens/s",
                     "openqa over HTTP (28 in / 300 out), qwen2-0.5b", f"{meta.get('device', '')} · "
                     f"{str(meta.get('git_revision', ''))[:12]}")
        if p:
            made.append(p)
    return made


def render(results: dict[str, dict[str, Any]], h: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = ["# jaxpaged benchmark summary", ""]
    lines += [f"- {k}: `{v}`" for k, v in meta.items()]
    lines += ["", "## Targets (issue 6)", "", markdown_table(check_targets(h)),
              "## Headline figures", "", markdown_table([{"figure": k, "value": v} for k, v in h.items()
                                                          if v is not None]),
              "## Runs", ""]
    rows = []
    for name, r in sorted(results.items()):
        m, meta_r = r.get("metrics", {}), r.get("meta", {})
        main = (m.get("output_tokens_per_second") or m.get("output_throughput")
                or m.get("best_output_tokens_per_second") or m.get("median_latency"))
        rows.append({"run": name, "output tok/s (latency: s)": main, "device": meta_r.get("device"),
                     "jax": meta_r.get("jax_version", ""), "git": str(meta_r.get("git_revision", ""))[:12],
                     "command": " ".join(str(meta_r.get("command", "")).split()[1:])[-160:]})
    lines.append(markdown_table(rows))
    return "\n".join(lines)


def summarize(paths: list[Path], out_dir: Path, stem: str = "suite_summary") -> dict[str, Any]:
    results = load_results(paths)
    h = headline(results)
    meta = stamp(with_device=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"meta": meta, "headline": h, "targets": check_targets(h), "runs": sorted(results)}
    (out_dir / f"{stem}.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (out_dir / f"{stem}.md").write_text(render(results, h, meta))
    summary["plots"] = [str(p) for p in plots(results, h, out_dir, stem)]
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", type=Path)
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--out-name", default="suite_summary")
    a = p.parse_args(argv)
    files = a.files or sorted(a.results_dir.glob("*.json"))
    s = summarize(files, a.results_dir, a.out_name)
    for row in s["targets"]:
        print(f"{row['met']:>4}  {row['target']:<52} {row['bar']:>10}  measured: {row['measured']}")
    for k in ("qwen2-0.5b", "llama3-8b"):
        ratio = s["headline"].get(f"{k} / best HF (same run)")
        if ratio:
            print(f"{k}: jaxpaged / best HF = {ratio:.1f}x")
    print(f"summary: {a.results_dir / (a.out_name + '.md')}")


if __name__ == "__main__":
    main()
