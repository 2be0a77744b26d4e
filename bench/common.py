"""What every benchmark shares: environment, result stamps, JSON + markdown + PNG writers.

Environment variables of bench/ are read here and nowhere else:
  JAXPAGED_BENCH_MODELS   folder of generated model folders (default ~/.cache/jaxpaged/bench_models)
  JAXPAGED_BENCH_DATA     folder of cached, tokenized dataset samples (default ~/.cache/jaxpaged/bench_data)
  JAXPAGED_BENCH_RESULTS  folder results are written to (default bench/results)
  JAXPAGED_GIT_REV        git revision to stamp when `git` is unavailable (the suite sets it)
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
_CACHE = Path(os.path.expanduser("~/.cache/jaxpaged"))
MODELS_DIR = Path(os.environ.get("JAXPAGED_BENCH_MODELS") or _CACHE / "bench_models")
DATA_DIR = Path(os.environ.get("JAXPAGED_BENCH_DATA") or _CACHE / "bench_data")
RESULTS_DIR = Path(os.environ.get("JAXPAGED_BENCH_RESULTS") or REPO_ROOT / "bench" / "results")
_GIT_REV_ENV = os.environ.get("JAXPAGED_GIT_REV")
_GIT_REV_FILE = REPO_ROOT / ".cache" / "gpu" / "GIT_REV"   # written by prepare_gpu_suite.sh (carried to the GPU)


def git_revision() -> str:
    """$JAXPAGED_GIT_REV (the GPU suite sets it: the device copy's .git, if any, is not this revision), else
    `git rev-parse HEAD` (+ '-dirty'), else .cache/gpu/GIT_REV, else 'unknown'."""
    if _GIT_REV_ENV:
        return _GIT_REV_ENV
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    if _GIT_REV_FILE.exists():
        return _GIT_REV_FILE.read_text().strip() or "unknown"
    return "unknown"


def device_info() -> dict[str, Any]:
    """Device kind and JAX version; imports jax lazily so pure-client scripts need no JAX."""
    info: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    try:
        import jax
        devices = jax.devices()
        info.update(jax_version=jax.__version__, backend=jax.default_backend(),
                    device=devices[0].device_kind, num_devices=len(devices))
    except Exception as e:  # noqa: BLE001 - a stamp must never fail a benchmark
        info.update(jax_version="unavailable", device=f"unknown ({type(e).__name__})")
    return info


def gpu_name_from_nvidia_smi() -> str | None:
    """The GPU's name without initialising CUDA in this process (a client beside a running server)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout.strip().splitlines()
        return out[0].strip() if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def stamp(argv: list[str] | None = None, with_device: bool = True) -> dict[str, Any]:
    """The provenance every result carries: command, date, git revision, device, JAX version.

    with_device=False (HTTP client, HF baseline) names the GPU from nvidia-smi instead of importing JAX.
    """
    argv = sys.argv if argv is None else argv
    out = {"command": " ".join(shlex.quote(a) for a in [sys.executable] + list(argv)),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "git_revision": git_revision()}
    if with_device:
        out.update(device_info())
    else:
        out.update(python=platform.python_version(), host=platform.node(),
                   device=gpu_name_from_nvidia_smi() or f"cpu ({platform.machine()})")
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) >= 1 or v == 0 else f"{v:.4g}"
    if isinstance(v, (list, dict)):
        return json.dumps(v)[:80]
    return str(v)


def markdown_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """Rows of dicts -> a GitHub markdown table (columns: union of keys in first-seen order)."""
    if not rows:
        return "(no rows)\n"
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def markdown_report(title: str, meta: dict[str, Any], metrics: dict[str, Any]) -> str:
    """A title, the provenance, then one line per metric."""
    lines = [f"# {title}", ""]
    lines += [f"- {k}: `{v}`" for k, v in meta.items()]
    lines += ["", markdown_table([{"metric": k, "value": v} for k, v in flatten(metrics).items()])]
    return "\n".join(lines)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}, "c": [1, 2]} -> {"a.b": 1} (lists, such as per-request timings, are left out)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        elif not isinstance(v, list):
            out[f"{prefix}{k}"] = v
    return out


def write_result(name: str, metrics: dict[str, Any], *, meta: dict[str, Any] | None = None,
                 title: str | None = None, results_dir: Path | None = None) -> Path:
    """Writes `<results_dir>/<name>.json` ({"meta": stamp, "metrics": ...}) and `<name>.md`; returns the JSON path."""
    results_dir = Path(results_dir or RESULTS_DIR)
    results_dir.mkdir(parents=True, exist_ok=True)
    meta = stamp() if meta is None else meta
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps({"meta": meta, "metrics": metrics}, indent=2, default=str) + "\n")
    (results_dir / f"{name}.md").write_text(markdown_report(title or name, meta, metrics))
    return path


def bar_plot(path: Path, labels: list[str], values: list[float], ylabel: str, title: str,
             subtitle: str = "") -> Path | None:
    """One bar per label (e.g. jaxpaged vs HF static vs HF continuous); None if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(labels) + 2), 4))
    bars = ax.bar(labels, values, color=["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"][:len(labels)])
    ax.bar_label(bars, labels=[f"{v:,.0f}" if v >= 10 else f"{v:.2f}" for v in values])
    ax.set_ylabel(ylabel)
    ax.set_title(title + (f"\n{subtitle}" if subtitle else ""), fontsize=9)
    plt.setp(ax.get_xticklabels(), rotation=15, ha="right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_repo_to_path() -> None:
    """Lets `python bench/x.py` import `bench.*` the same way `python -m bench.x` does.

    Each script, run as a file, drops bench/ from sys.path (bench/datasets.py would otherwise shadow HF's
    `datasets` package, which transformers probes for) and APPENDS the repo root, so that an installed
    jaxpaged (the GPU suite's /tmp/jp, which maps models/ -> jaxpaged.models) wins over ./jaxpaged."""
    bench = REPO_ROOT / "bench"
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != bench]
    if str(REPO_ROOT) not in sys.path:
        sys.path.append(str(REPO_ROOT))
