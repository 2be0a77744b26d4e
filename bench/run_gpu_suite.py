"""The whole GPU benchmark suite of issue 6, in parts that each fit one 10-minute device command.

  bash bench/run_gpu_suite.sh                 # all parts, ~25 min on an H100 (where nothing caps a command)
  bash bench/run_gpu_suite.sh qwen            # one part (<= 9.5 min): see PARTS below
  python3 bench/run_gpu_suite.py --smoke all  # the same steps on the CPU: tiny-llama, 8 prompts

Parts and their steps (budget in seconds; a step that no longer fits the part's deadline is skipped):
  qwen   throughput qwen2-0.5b sharegpt 1000; the same, 64 prompts, --profile (kernel-level trace), then
         traced by whole graph launches (executable cache off: compiles); HF static (first 100 of the same
         sample, <= 45 s of batches) + HF continuous (first 48) when time is left
  llama  throughput llama3-8b sharegpt 1000 (390 s: a cold start compiles 46 shapes in ~190 s);
         latency llama3-8b batch 256 (+ decode step vs floor, warm start); HF static + continuous
         (first 32) when time is left
  serve  jaxpaged.server (qwen2-0.5b, dummy weights) + openqa at concurrency 1 and 10; kernel bench
         (bench_kernels.py: timings only)
  kernel-tests  the kernels' correctness: pytest tests/kernels on the GPU (the CPU's test classes, the
         kernels compiled, plus the real sizes)
  multistep  qwen2-0.5b ShareGPT 1000 with 1 and 8 decode steps per program, the server with 8 (openqa
         at concurrency 1 and 10), the profiled run with 8
  speed  qwen throughput + the server with the same step shapes (warm start-up) and openqa at
         concurrency 1 and 10 + the profiled run traced by whole graph launches (compiles), then by
         kernels (warm start-up) when time is left: issue 6's figures in one command
  multistep16  qwen2-0.5b ShareGPT 1000 with 16 decode steps per program, then the server with 16 (warm
         start-up; openqa at concurrency 1 and 10)

Every step is a subprocess with a timeout, run from a work folder outside the repository (so the
installed jaxpaged, not the repo's ./jaxpaged folder, is imported); its log goes to
bench/results/logs/. At the end of a part: bench/summarize.py, then at most 8 files are copied to $OUT
(when set): suite-<part>.json (every result of the part, with logs' tails), suite-<part>.md, the
summary's plots, and the kernel bench's json/md/png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# bench/ must not be on sys.path (bench/datasets.py would shadow HF `datasets`); the repo root goes last
# so that an installed jaxpaged (the GPU suite's /tmp/jp) wins over the repo's ./jaxpaged folder.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.append(str(REPO))

from bench.common import RESULTS_DIR, stamp  # noqa: E402

PY = sys.executable
BENCH = REPO / "bench"
TESTS = REPO / "tests"
PORT = 8011
# A step's log lines echoed to the console (a PROBE line, step_probe's JSON, whatever its length).
ECHOED_PREFIXES = ("Throughput:", "PROBE", "HF ", "Avg latency", "prefill", "bandwidth", "per-step", "  ", "trace:",
                   "Successful", "Output token", "Median TPOT", "Mean TTFT", "Traceback", "Error", "RuntimeError",
                   "ValueError", "FAILED", "SKIPPED")


@dataclass
class Step:
    name: str
    budget_s: float
    argv: list[str] = field(default_factory=list)    # a bench script and its arguments
    kind: str = "script"                               # script | serve
    server_args: list[str] = field(default_factory=list)   # serve: extra jaxpaged.server flags
    env: dict[str, str] = field(default_factory=dict)      # extra environment (XLA_FLAGS, JAXPAGED_*)
    concurrency: tuple[int, ...] = (1, 10)                 # serve: the openqa client's max concurrency


def _default_result_name(argv: list[str]) -> str:
    """throughput.py's result name when none is given: throughput-<model>-<dataset>."""
    return f"throughput-{argv[argv.index('--model') + 1]}-{argv[argv.index('--dataset') + 1]}"


def variant(step: Step, suffix: str, *extra: str, **changes) -> Step:
    """`step` run again as a variant: `suffix` added to its name and to its result's name, `extra` arguments
    added to its command line, `changes` to its other fields (budget_s, env). The variant's --result-name
    comes after the step's own, and the last one given wins."""
    argv = step.argv
    result = argv[argv.index("--result-name") + 1] if "--result-name" in argv else _default_result_name(argv)
    return dataclasses.replace(step, name=f"{step.name}-{suffix}",
                               argv=argv + list(extra) + ["--result-name", f"{result}-{suffix}"], **changes)


def parts(smoke: bool) -> dict[str, list[Step]]:
    """The suite's steps; --smoke swaps in tiny-llama, 8 prompts and short outputs for the CPU."""
    q, l_ = ("tiny-llama", "tiny-llama") if smoke else ("qwen2-0.5b", "llama3-8b")
    n = ["--num-prompts", "8"] if smoke else []
    small = ["--max-model-len", "2048"] if smoke else []
    # On the CPU, steps other than the first use short random prompts (sharegpt outputs run to hundreds
    # of tokens, minutes each on 2 cores); the first still exercises the real ShareGPT path.
    quick = ["--dataset", "random", "--input-len", "32", "--output-len", "16"] if smoke else ["--dataset", "sharegpt"]
    tput = [str(BENCH / "throughput.py"), "--no-tqdm"]
    hf = [str(BENCH / "hf_baseline.py")]
    tput_qwen = Step("throughput-qwen", 420, tput + ["--dataset", "sharegpt", "--model", q] + n + small)
    profile_qwen = Step("profile-qwen", 120, tput + quick + ["--model", q, "--profile", "--num-prompts",
                                                             "8" if smoke else "64", "--result-name",
                                                             f"throughput-{q}-sharegpt-profile"] + small)
    # The same run traced by whole CUDA-graph launches (the bar's figure, bench/summarize.py): kernel-level
    # tracing holds the host ~1 ms in each launch of an unrolled step's graph. The compile caches are off:
    # the graph-level trace crashes (SIGSEGV) with steps loaded from the executable cache, so this step
    # compiles (~100 s on 8 threads).
    profile_graphs = variant(profile_qwen, "graphs", "--profile-graph-trace", budget_s=240,
                             env={"JAXPAGED_COMPILE_CACHE": "0"})
    serve_qwen = Step("serve-openqa", 330, ["--model", q] + (["--output-len", "16", "--num-prompts", "8"]
                                                            if smoke else []), kind="serve")
    # the server with throughput's step shapes, so its start-up reads the compile cache throughput filled
    speed_server = [] if smoke else ["--max-num-batched-tokens", "16384"]
    return {
        "qwen": [
            tput_qwen,
            profile_qwen,
            profile_graphs,
            Step("hf-qwen", 170, hf + quick + ["--model", q, "--num-prompts", "8" if smoke else "100",
                                               "--cb-num-prompts", "8" if smoke else "48",
                                               "--max-time-s", "10" if smoke else "45"]),
        ],
        "llama": [
            Step("throughput-llama", 390, tput + quick + ["--model", l_] + n + small),
            Step("latency-llama", 140, [str(BENCH / "latency.py"), "--model", l_, "--decode-step",
                                        "--batch-size", "4" if smoke else "256", "--input-len", "128",
                                        "--output-len", "8" if smoke else "128", "--num-iters-warmup", "1",
                                        "--num-iters", "2" if smoke else "3"] + small),
            Step("hf-llama", 140, hf + quick + ["--model", l_, "--num-prompts", "8" if smoke else "32",
                                                "--max-time-s", "10" if smoke else "40"]),
        ],
        # The figures issue 6 asks for, in one command: throughput (cold compile), the server with the same
        # step shapes (so its start-up reads the warm compile cache) and openqa at concurrency 1 and 10,
        # then the profiled run (warm start-up again) with whatever time is left.
        "speed": [
            tput_qwen,
            dataclasses.replace(serve_qwen, server_args=speed_server),
            profile_graphs,
            profile_qwen,
        ],
        # Multi-step scheduling (--num-scheduler-steps 8) against one step per program on qwen2-0.5b, on one
        # machine: ShareGPT 1000 with each, the server with 8 steps (openqa at concurrency 1 and 10), and the
        # profiled run with 8 steps. (Offline runs default to 16 steps on GPUs: the one-step run names 1.)
        "multistep": [
            variant(tput_qwen, "ms1", "--num-scheduler-steps", "1"),
            variant(tput_qwen, "ms8", "--num-scheduler-steps", "8", budget_s=150),
            dataclasses.replace(serve_qwen, name="serve-openqa-ms8", budget_s=240, server_args=(
                ["--num-scheduler-steps", "8"] + speed_server)),
            variant(profile_qwen, "ms8", "--num-scheduler-steps", "8"),
        ],
        # Multi-step scheduling with 16 decode steps per program (multistep measured 8): ShareGPT 1000 first
        # (cold compile), then the server with the same step shapes, so that, as in speed, its start-up
        # reads the compile cache the throughput run filled; openqa at concurrency 1 and 10.
        "multistep16": [
            variant(tput_qwen, "ms16", "--num-scheduler-steps", "16"),
            dataclasses.replace(serve_qwen, name="serve-openqa-ms16", budget_s=300, server_args=(
                ["--num-scheduler-steps", "16"] + speed_server)),
        ],
        "serve": [
            serve_qwen,
            Step("kernels", 200, [str(BENCH / "bench_kernels.py")] + (["--smoke"] if smoke else [])),
        ],
        # Run from the work folder like every step, so the installed jaxpaged is imported; tests/conftest.py
        # defaults JAX_PLATFORMS to cpu, so the GPU is asked for (with --smoke: the CPU, interpret mode).
        "kernel-tests": [
            # -o pythonpath= : pyproject puts the repository root first on sys.path for the CPU suite, which
            # would shadow the installed jaxpaged (its models/kernels subpackages live in other folders)
            Step("kernel-tests", 540, ["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-o", "pythonpath=",
                                       str(TESTS / "kernels")],
                 env={} if smoke else {"JAX_PLATFORMS": "cuda"}),
        ],
    }


def run_logged(argv: list[str], log: Path, timeout_s: float, cwd: Path, env: dict[str, str]) -> tuple[int, float]:
    """(return code, seconds); 124 on timeout. Output goes to `log`."""
    t0 = time.perf_counter()
    with open(log, "ab") as f:
        f.write(f"$ {' '.join(argv)}\n".encode())
        f.flush()
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            _stop(proc)
            rc = 124
    return rc, time.perf_counter() - t0


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the step's own process group (it was started in a new session), then SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def wait_health(url: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(1.0)
    return False


def run_serve(step: Step, log: Path, budget_s: float, cwd: Path, env: dict[str, str], smoke: bool) -> int:
    """Start jaxpaged.server on the model, wait for /health, run openqa at each of step.concurrency."""
    from bench.models import resolve_model
    args = step.argv
    model = args[args.index("--model") + 1]
    extra = [a for i, a in enumerate(args) if a != "--model" and (i == 0 or args[i - 1] != "--model")]
    path, _ = resolve_model(model)
    server = [PY, "-m", "jaxpaged.server", "--port", str(PORT)] + (["--model", path, "--load-format", "dummy"]
                                                                  if path else [])
    if smoke:
        server += ["--max-model-len", "2048"]
    server += step.server_args
    t0 = time.perf_counter()
    with open(log, "ab") as f:
        f.write(f"$ {' '.join(server)}\n".encode())
        f.flush()
        srv = subprocess.Popen(server, cwd=cwd, env={**env, **step.env}, stdout=f, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        if not wait_health(f"http://127.0.0.1:{PORT}/health", srv, budget_s - 60):
            print(f"  server did not become healthy (see {log})")
            return 1
        print(f"  server healthy after {time.perf_counter() - t0:.0f} s")
        rc = 0
        for conc in step.concurrency:
            left = budget_s - (time.perf_counter() - t0)
            client = [PY, str(BENCH / "serve.py"), "--base-url", f"http://127.0.0.1:{PORT}", "--model", model,
                      "--dataset", "openqa", "--max-concurrency", str(conc), "--disable-tqdm",
                      "--result-name", f"serve-openqa-c{conc}{step.name.removeprefix('serve-openqa')}",
                      "--time-limit-s", f"{max(5.0, 0.6 * left):.0f}"] + extra
            r, _ = run_logged(client, log, left - 5, cwd, env)
            rc = rc or r
        return rc
    finally:
        _stop(srv)


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def bundle(part: str, steps_done: list[dict[str, Any]], started: float) -> dict[str, Any]:
    """Every result JSON written since the part started, plus the steps' status and log tails."""
    results = {}
    for p in sorted(RESULTS_DIR.glob("*.json")):
        if p.stat().st_mtime >= started - 1 and not p.name.startswith(("suite", "kernels")):
            try:
                results[p.stem] = json.loads(p.read_text())
            except json.JSONDecodeError:
                pass
    return {"meta": stamp(with_device=False), "part": part, "steps": steps_done, "results": results}


def copy_out(part: str, files: list[Path]) -> None:
    out = os.environ.get("OUT")
    if not out:
        return
    for f in [f for f in files if f.exists()][:8]:          # the device tool returns at most 8 files
        shutil.copy2(f, Path(out) / f.name)
        print(f"  -> $OUT/{f.name}")


def run_part(part: str, steps: list[Step], deadline_s: float, smoke: bool) -> dict[str, Any]:
    from bench import summarize
    started = time.time()
    t0 = time.perf_counter()
    logs = RESULTS_DIR / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "jaxpaged-suite-work"
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TQDM_MININTERVAL="10")
    done = []
    for step in steps:
        left = deadline_s - (time.perf_counter() - t0) - 20     # keep 20 s for the summary and copies
        if step.name == "kernels" and not (BENCH / "bench_kernels.py").exists():
            done.append({"step": step.name, "status": "absent"})
            continue
        if left < min(step.budget_s, 60):
            print(f"[{part}] skip {step.name}: {left:.0f} s left")
            done.append({"step": step.name, "status": "skipped (deadline)"})
            continue
        budget = min(step.budget_s, left)
        log = logs / f"{step.name}.log"
        log.write_text("")
        print(f"[{part}] {step.name} (budget {budget:.0f} s) ...", flush=True)
        if step.kind == "serve":
            t1 = time.perf_counter()
            rc, secs = run_serve(step, log, budget, work, env, smoke), None
            secs = time.perf_counter() - t1
        else:
            argv = [PY] + step.argv
            if step.name == "kernels":
                argv += ["--out", str(RESULTS_DIR), "--budget-s", str(max(30, int(budget - 30)))]
            rc, secs = run_logged(argv, log, budget, work, {**env, **step.env})
        status = "ok" if rc == 0 else ("timeout" if rc == 124 else f"failed rc={rc}")
        print(f"[{part}] {step.name}: {status} in {secs:.0f} s")
        for line in tail(log, 200).splitlines():
            if line.startswith(ECHOED_PREFIXES) and (len(line) < 300 or line.startswith("PROBE")):
                print(f"    {line}")
        done.append({"step": step.name, "status": status, "seconds": secs, "log_tail": tail(log, 30)})
    bundle_path = RESULTS_DIR / f"suite-{part}.json"
    bundle_path.write_text(json.dumps(bundle(part, done, started), indent=1, default=str) + "\n")
    summ = summarize.summarize([bundle_path] + [p for p in RESULTS_DIR.glob("*.json")
                                                if not p.name.startswith(("suite", "kernels"))],
                               RESULTS_DIR, f"suite-{part}-summary")
    logs_all = RESULTS_DIR / f"suite-{part}-logs.txt"
    logs_all.write_text("\n\n".join(f"===== {s['step']} ({s['status']})\n{tail(logs / (s['step'] + '.log'), 400)}"
                                    for s in done if s.get("status") not in ("absent",)))
    kernel_files = sorted(RESULTS_DIR.glob("kernels*"), key=os.path.getmtime)[-3:] if part == "serve" else []
    copy_out(part, [bundle_path, RESULTS_DIR / f"suite-{part}-summary.md", logs_all]
             + [Path(p) for p in summ.get("plots", [])] + kernel_files)
    print(f"[{part}] done in {time.perf_counter() - t0:.0f} s; summary {RESULTS_DIR / f'suite-{part}-summary.md'}")
    return summ


# Parts "all" leaves out: speed repeats qwen and serve steps; kernel-tests is the kernels' correctness check,
# run on its own; the others compare step counts per program.
NOT_IN_ALL = ("speed", "multistep", "multistep16", "kernel-tests")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parts", nargs="*", default=["all"], help=" | ".join([*parts(False), "all"]))
    p.add_argument("--deadline-s", type=float, default=570.0, help="per part (the device tool caps a command at 600 s)")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny-llama, 8 prompts")
    a = p.parse_args(argv)
    table = parts(a.smoke)
    names = [n for n in table if n not in NOT_IN_ALL] if "all" in a.parts else a.parts
    for name in names:
        if name not in table:
            p.error(f"unknown part {name!r}; choose from {list(table)} or all")
        run_part(name, table[name], a.deadline_s, a.smoke)


if __name__ == "__main__":
    main()
