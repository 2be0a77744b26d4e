"""A/B of two jaxpaged revisions on one machine, for "nothing slower, nothing different": each figure of the new
revision (this working tree) against the base revision (bench/prepare_ab.sh exports it, the tag base-s14 by
default, to .cache/ab/base), both run by the same command in the same device call, with new/base and a verdict.

  bash bench/ab_compare.sh qwen          # device: carry=[".whl", ".cache/gpu", ".cache/ab"]; then serve, llama
  bash bench/ab_compare.sh --smoke qwen serve llama --rounds 1          # CPU: tiny-llama, 8 prompts
  python bench/ab_compare.py --report ab-qwen.json ab-serve.json ab-llama.json     # here: one table of all parts

Parts, each one 10-minute device command (the commands are bench/run_gpu_suite.py's steps of today):
  qwen   qwen2-0.5b offline ShareGPT 1000 (the suite's throughput-qwen): output tok/s
  serve  jaxpaged.server on qwen2-0.5b as the suite's speed part starts it, openqa at concurrency 1 and 10:
         output tok/s and median TPOT of each
  llama  llama3-8b offline ShareGPT 1000 (the suite's throughput-llama): output tok/s

A part runs rounds of base then new, up to --rounds (default 2: base, new, base, new), a round only while its
estimate fits the deadline. Each run is its own process, started from a folder outside the repository: the
offline runs use their revision's own bench/throughput.py and jaxpaged (ab_compare.sh installs each revision into
$AB_ROOT/<rev>/site), the server its revision's jaxpaged; this tree's bench/serve.py is the HTTP client of both.
The revisions share one JAXPAGED_CACHE_ROOT ($AB_ROOT/cache): XLA's persistent cache serves any HLO the other
revision compiled already, the executable cache (keyed by the sources) is each revision's own. Every run's engine
start-up is reported, not judged.

--step-log: each offline run also writes its step log (bench/throughput.py --step-log), and its figures gain the
seconds in mixed steps (any prompt token) and in decode steps and the median mixed step (bench/step_log_table.py's
groups), shown in the runs table, not judged: where a change to one kind of step shows beside the whole run.

A figure is the mean over a revision's runs; it passes when new/base is at most 3% worse (lower tok/s, higher
TPOT). "outputs" passes when every run of the part generated the same number of tokens, none of a wrong length,
and no request failed (a server run cut short by its time limit gives no figures for that concurrency).
Writes ab-<part>.json and .md (and ab-<parts>-logs.txt) to $OUT when set, and the json and md to
bench/results/ab/<base>_vs_<new>/ (under $AB_ROOT/ab with --smoke).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]   # see bench/common.py
sys.path.append(str(REPO))

from bench import run_gpu_suite as suite  # noqa: E402
from bench.common import RESULTS_DIR, git_revision, markdown_table, stamp  # noqa: E402

TOLERANCE = 0.03
REVS = ("base", "new")
AB_ROOT = Path(os.environ.get("AB_ROOT", "/tmp/jaxpaged-ab"))
BASE_TREE = REPO / ".cache" / "ab" / "base"
SERVE_FIGURES = [(f"c{c}_{k}", k == "output_tok_s") for c in (1, 10) for k in ("output_tok_s", "median_tpot_ms")]
# part -> (the suite's part and step whose command it runs, [(figure, higher is better)])
PARTS = {
    "qwen": ("qwen", "throughput-qwen", [("output_tok_s", True)]),
    "serve": ("speed", "serve-openqa", SERVE_FIGURES),
    "llama": ("llama", "throughput-llama", [("output_tok_s", True)]),
}
WARM_INIT_S = 40.0      # a start-up that loads its steps from the executable cache (H100: 22-38 s)


def _metrics(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())["metrics"]
    except (OSError, ValueError, KeyError):
        return {}


STEP_LOG = "steps.csv"   # an offline run's step log in its results folder (--step-log)


def step_log_figures(path: Path) -> dict[str, float]:
    """Seconds in mixed and in decode steps and the median mixed step (ms), from a step log."""
    import numpy as np
    from bench.step_log_table import load, mixed_steps
    steps = load(str(path))
    mixed = mixed_steps(steps)
    out = {"mixed_s": float(steps[mixed, 0].sum()), "decode_s": float(steps[~mixed, 0].sum())}
    if mixed.any():
        out["median_mixed_step_ms"] = 1e3 * float(np.median(steps[mixed, 0]))
    return out


def read_figures(results: Path, log: Path | None, serve: bool) -> dict[str, Any]:
    """One run's figures, from the result JSONs its scripts wrote (and, for the server, its log's start-up line;
    for an offline run with --step-log, its step log). A concurrency level with failed requests gives no speed
    figures, one cut short by the time limit (skipped requests) only its count of them."""
    out: dict[str, Any] = {}
    if not serve:
        m = next((m for p in sorted(results.glob("throughput-*.json")) if (m := _metrics(p))), {})
        if m:
            out.update(output_tok_s=m["output_tokens_per_second"], init_s=m["engine_startup_s"],
                       output_tokens=m["total_output_tokens"], bad_requests=m["num_wrong_output_len"])
        if (results / STEP_LOG).exists():
            out.update(step_log_figures(results / STEP_LOG))
        return out
    for c in (1, 10):
        m = _metrics(results / f"serve-openqa-c{c}.json")
        if m.get("skipped"):
            out[f"c{c}_skipped"] = m["skipped"]
        elif m:
            out.update({f"c{c}_output_tokens": m["total_output_tokens"], f"c{c}_bad_requests": m["failed"]})
            if not m["failed"]:
                out.update({f"c{c}_output_tok_s": m["output_throughput"], f"c{c}_median_tpot_ms": m["median_tpot_ms"]})
    ready = re.findall(r"engine ready in ([\d.]+) s", log.read_text(errors="replace")) if log and log.exists() else []
    if ready:
        out["init_s"] = float(ready[0])
    return out


def verdict(ratio: float | None, higher_is_better: bool) -> str:
    if ratio is None:
        return "missing"
    return "pass" if (ratio >= 1 - TOLERANCE if higher_is_better else ratio <= 1 + TOLERANCE) else "FAIL"


def compare(part: str, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per judged figure (means over each revision's runs, new/base, verdict), then "outputs"."""
    rows = []
    for fig, higher in PARTS[part][2]:
        vals = {r: [x["figures"][fig] for x in runs if x["rev"] == r and fig in x["figures"]] for r in REVS}
        mean = {r: statistics.fmean(v) if v else None for r, v in vals.items()}
        ratio = mean["new"] / mean["base"] if mean["base"] and mean["new"] is not None else None
        rows.append({"part": part, "figure": fig, "base": mean["base"], "new": mean["new"], "new/base": ratio,
                     "verdict": verdict(ratio, higher), "base runs": vals["base"], "new runs": vals["new"], "note": ""})
    counts = {}        # every "...output_tokens" count: one value across all runs of both revisions
    for x in runs:
        for k, v in x["figures"].items():
            if k.endswith("output_tokens"):
                counts.setdefault(k, set()).add(v)
    bad = sum(v for x in runs for k, v in x["figures"].items() if k.endswith("bad_requests"))
    both = all(any(x["rev"] == r and x["figures"] for x in runs) for r in REVS)
    same = all(len(v) == 1 for v in counts.values()) and not bad
    rows.append({"part": part, "figure": "outputs", "base": None, "new": None, "new/base": None,
                 "verdict": "missing" if not (both and counts) else ("pass" if same else "FAIL"),
                 "base runs": [], "new runs": [],
                 "note": "; ".join([f"{k} {sorted(v)}" for k, v in counts.items()]
                                   + ([f"{bad} requests of a wrong length or failed"] if bad else []))})
    return rows


def overall(rows: list[dict[str, Any]]) -> str:
    verdicts = {r["verdict"] for r in rows}
    return "FAIL" if "FAIL" in verdicts else ("INCOMPLETE" if "missing" in verdicts else "PASS")


def _num(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) >= 10 else f"{v:.4g}"
    return str(v)


def render(reports: list[dict[str, Any]]) -> str:
    """Markdown of one or more parts' reports: provenance, the verdict table, every run, the commands."""
    meta, revs = reports[0]["meta"], reports[0]["revisions"]
    rows = [r for rep in reports for r in rep["comparison"]]
    lines = [f"# A/B: new {revs['new']} against base {revs['base']} ({', '.join(r['part'] for r in reports)})", "",
             f"- device: {meta.get('device')}; JAX {meta.get('jax_version')}; {meta.get('date')}; "
             f"host {meta.get('host')}",
             f"- base: `{revs['base']}`; new: `{revs['new']}`",
             "- command: " + "; ".join(dict.fromkeys(f"`{rep['command']}`" for rep in reports))
             + " (each run's own commands below)",
             f"- a figure is the mean of a revision's runs; pass: new at most {100 * TOLERANCE:g}% worse "
             "(tok/s lower, TPOT higher)",
             f"- **verdict: {overall(rows)}**", ""]
    lines.append(markdown_table([{**r, **{k: _num(r[k]) for k in ("base", "new")},
                                  "new/base": f"{r['new/base']:.4f}" if r["new/base"] else "",
                                  "base runs": " / ".join(_num(v) for v in r["base runs"]),
                                  "new runs": " / ".join(_num(v) for v in r["new runs"])} for r in rows]))
    lines += ["## Runs", "", markdown_table([
        {"part": rep["part"], "rev": x["rev"], "round": x["round"], "status": x["status"],
         "seconds": f"{x['seconds']:.0f}", "engine start-up s": _num(x["figures"].get("init_s")),
         "figures": ", ".join(f"{k} {_num(v)}" for k, v in x["figures"].items()
                              if not k.endswith(("init_s", "output_tokens", "bad_requests")))}
        for rep in reports for x in rep["runs"]]), "## Commands", ""]
    for rep in reports:
        for rev in REVS:
            first = next((x for x in rep["runs"] if x["rev"] == rev), None)
            lines += [f"- {rep['part']} {rev} (PYTHONPATH={first.get('pythonpath')}): "
                      + "; ".join(f"`{c}`" for c in first["commands"])] if first else []
    return "\n".join(lines) + "\n"


def short(rev: str) -> str:
    return rev[:7] + ("-dirty" if rev.endswith("-dirty") else "")


def write(reports: list[dict[str, Any]], name: str, folder: Path | None = None) -> Path:
    """<folder>/<name>.json (one part's report, or the list of several) and .md; folder defaults to
    bench/results/ab/<base>_vs_<new>/."""
    revs = reports[0]["revisions"]
    folder = folder or RESULTS_DIR / "ab" / f"{short(revs['base'])}_vs_{short(revs['new'])}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(reports[0] if len(reports) == 1 else reports, indent=1, default=str) + "\n")
    (folder / f"{name}.md").write_text(render(reports))
    return path


def run_one(part: str, step: suite.Step, rev: str, rnd: int, budget_s: float, smoke: bool,
            step_log: bool = False) -> dict[str, Any]:
    """One run of `step` with revision `rev`: its own results folder, log, PYTHONPATH and stamp."""
    tree, label = revisions()[rev]
    tag = f"{part}-{rev}-r{rnd}"
    results, log, work = AB_ROOT / "results" / tag, AB_ROOT / "logs" / f"{tag}.log", AB_ROOT / "work"
    shutil.rmtree(results, ignore_errors=True)
    for d in (results, log.parent, work):
        d.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    path = [str(AB_ROOT / rev / "site")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1", TQDM_MININTERVAL="10", PYTHONPATH=os.pathsep.join(path),
               JAXPAGED_GIT_REV=label, JAXPAGED_BENCH_RESULTS=str(results), JAXPAGED_CACHE_ROOT=str(AB_ROOT / "cache"))
    print(f"[{part}] round {rnd}: {rev} {label} (budget {budget_s:.0f} s) ...", flush=True)
    t0 = time.perf_counter()
    if step.kind == "serve":
        rc = suite.run_serve(step, log, budget_s, work, env, smoke)
    else:     # the revision's own bench scripts
        bench = str(REPO / "bench")
        argv = [suite.PY] + [str(tree / "bench") + a[len(bench):] if a.startswith(bench) else a for a in step.argv]
        if step_log:
            argv += ["--step-log", str(results / STEP_LOG)]
        rc, _ = suite.run_logged(argv, log, budget_s, work, {**env, **step.env})
    secs = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    run = {"rev": rev, "revision": label, "pythonpath": env["PYTHONPATH"], "round": rnd, "seconds": secs,
           "status": "ok" if rc == 0 else ("timeout" if rc == 124 else f"failed rc={rc}"),
           "figures": read_figures(results, log, step.kind == "serve"),
           "commands": [line[2:] for line in text.splitlines() if line.startswith("$ ")],
           "log_tail": "\n".join(text.splitlines()[-200:])}
    print(f"[{part}] round {rnd}: {rev} {run['status']} in {secs:.0f} s: {run['figures']}", flush=True)
    return run


def revisions() -> dict[str, tuple[Path, str]]:
    """rev -> (its source tree, its git revision)."""
    return {"base": (BASE_TREE, (BASE_TREE / "AB_REV").read_text().strip()), "new": (REPO, git_revision())}


def warm_estimate(run: dict[str, Any]) -> float:
    """A run's seconds again with a warm executable cache."""
    init = run["figures"].get("init_s", 0.0)
    return run["seconds"] - init + min(init, WARM_INIT_S)


def make_report(part: str, command: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    meta = stamp(with_device=False)
    try:
        meta["jax_version"] = metadata.version("jax")
    except metadata.PackageNotFoundError:
        meta["jax_version"] = "unavailable"
    labels = {r: v[1] for r, v in revisions().items()}
    return {"meta": meta, "part": part, "command": command, "revisions": labels, "tolerance": TOLERANCE,
            "runs": runs, "comparison": compare(part, runs)}


def run_part(part: str, rounds: int, deadline_s: float, smoke: bool, command: str,
             save: Callable[[dict[str, Any]], Any] = lambda report: None, step_log: bool = False) -> dict[str, Any]:
    """Rounds of base, new; `save` gets the report so far after each run (a command killed at the device's
    limit still leaves the runs before)."""
    suite_part, step_name, _ = PARTS[part]
    step = next(s for s in suite.parts(smoke)[suite_part] if s.name == step_name)
    t0 = time.perf_counter()
    runs: list[dict[str, Any]] = []
    for rnd in range(1, rounds + 1):
        need = sum(warm_estimate(next(x for x in reversed(runs) if x["rev"] == r)) for r in REVS) if runs else 0
        if rnd > 1 and deadline_s - (time.perf_counter() - t0) - 20 < need:
            print(f"[{part}] round {rnd} skipped: ~{need:.0f} s needed")
            break
        for rev in REVS:
            left = deadline_s - (time.perf_counter() - t0) - 20      # 20 s for the report
            if left < 60:
                print(f"[{part}] round {rnd}: {rev} skipped ({left:.0f} s left)")
                continue
            runs.append(run_one(part, step, rev, rnd, left, smoke, step_log and step.kind != "serve"))
            save(make_report(part, command, runs))
    return make_report(part, command, runs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parts", nargs="*", help=" | ".join(PARTS))
    p.add_argument("--rounds", type=int, default=2, help="base, new rounds (the second and later if time allows)")
    p.add_argument("--deadline-s", type=float, default=570.0, help="per part (the device caps a command at 600 s)")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny-llama, 8 prompts")
    p.add_argument("--step-log", action="store_true", help="offline runs: their step logs' mixed and decode seconds")
    p.add_argument("--report", nargs="+", metavar="JSON", help="ab-<part>.json files to merge into one table")
    a = p.parse_args(argv)
    if a.report:
        reports = [json.loads(Path(f).read_text()) for f in a.report]
        for f, report in zip(a.report, reports):           # each part's own files beside the merged table
            write([report], Path(f).stem)
        path = write(reports, "ab-" + "-".join(r["part"] for r in reports))
        print(render(reports) + f"\n-> {path.parent}")
        return
    if not a.parts or any(n not in PARTS for n in a.parts):
        p.error(f"name parts from {list(PARTS)}")
    command = "bash bench/ab_compare.sh " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    done: list[dict[str, Any]] = []             # runs of the parts before, for the logs file

    def save(report: dict[str, Any]) -> Path:
        path = write([report], f"ab-{report['part']}", AB_ROOT / "ab" if a.smoke else None)
        if out:
            for f in (path, path.with_suffix(".md")):
                shutil.copy2(f, out / f.name)
            (out / f"ab-{'-'.join(a.parts)}-logs.txt").write_text("\n\n".join(
                f"===== {x['part']} {x['rev']} round {x['round']} ({x['status']})\n{x['log_tail']}"
                for x in done + [dict(x, part=report["part"]) for x in report["runs"]]) + "\n")
        return path

    for name in a.parts:
        report = run_part(name, a.rounds, a.deadline_s, a.smoke, command, save, a.step_log)
        print(render([report]) + f"\n-> {save(report)}")
        done += [dict(x, part=name) for x in report["runs"]]


if __name__ == "__main__":
    main()
