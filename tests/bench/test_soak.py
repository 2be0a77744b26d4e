"""bench/soak.py end to end: it starts the real server (`--serve`) on the tiny random-weight Llama, runs both
phases with half of phase 2 faults (every kind), stops the server, and its report holds no 5xx, every
fault's expected outcome, the memory series and the pool free at the end.

The server's shapes stay few (8 sequences, 64 tokens a step: six programs to compile on the CPU), its pool
small (1024 blocks: a step on the CPU costs time with the pool's size) and the outputs short.
"""
import json
import os
import signal
import subprocess
import sys
from collections import Counter

import pytest

from bench.soak_faults import BAD_REQUESTS, FAULT_KINDS

pytestmark = pytest.mark.slow

NUM_PROMPTS = 30               # each phase
SERVER_FLAGS = ["--load-format", "dummy", "--max-model-len", "1100", "--max-num-seqs", "8",
                "--max-num-batched-tokens", "64", "--num-gpu-blocks-override", "1024", "--disable-log-requests", "--uvicorn-log-level", "warning"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from bench.common import REPO_ROOT
    from bench.models import ensure_model_dir
    out = tmp_path_factory.mktemp("soak")
    cmd = [sys.executable, str(REPO_ROOT / "bench" / "soak.py"), "--model", "tiny-llama",
           "--num-prompts", str(NUM_PROMPTS), "--fault-num-prompts", str(NUM_PROMPTS), "--fault-fraction", "0.5",
           "--request-rate", "20", "--max-output-len", "16", "--sample-period-s", "0.5", "--disable-tqdm",
           "--result-name", "soak", "--serve", "--", "--model", ensure_model_dir("tiny-llama"), *SERVER_FLAGS]
    # its own process group: on a timeout the script and the server it started go together
    proc = subprocess.Popen(cmd, env={**os.environ, "JAXPAGED_BENCH_RESULTS": str(out)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode in (0, 1), log[-4000:]        # 1: a verdict failed (memory may grow on the CPU)
    data = json.loads((out / "soak.json").read_text())
    assert (out / "soak.md").exists() and (out / "soak.png").exists()
    return data["meta"], data["metrics"]


def test_no_5xx_every_outcome_expected_pool_free_clean_exit(report):
    _, m = report
    v = m["verdicts"]
    assert (v["zero_5xx"], v["every_outcome_expected"]) == ("pass", "pass"), (m["five_xx"], m["unexpected"])
    assert v["pool_free_at_end"] == "pass", m["idle"]
    assert (v["server_clean_exit"], v["server_log_without_errors"]) == ("pass", "pass"), m["server_log_errors"]
    idle = m["idle"]
    assert idle["num_requests_running"] == idle["num_requests_waiting"] == 0
    assert idle["num_free_blocks"] == idle["num_blocks"] > 0
    clean, faults = m["phases"]["clean"], m["phases"]["faults"]
    assert clean["outcomes"] == {"normal:ok": NUM_PROMPTS} and clean["completed"] == NUM_PROMPTS
    assert faults["outcomes"]["normal:ok"] == NUM_PROMPTS // 2 == faults["completed"]


def test_every_fault_kind_got_what_it_must(report):
    _, m = report
    faults = m["faults"]
    assert len(faults) == NUM_PROMPTS // 2
    by_kind = Counter(f["kind"] for f in faults)
    assert set(by_kind) == set(FAULT_KINDS) and max(by_kind.values()) - min(by_kind.values()) <= 1
    for f in faults:
        if f["kind"] in BAD_REQUESTS:      # the status its kind must get, with OpenAI's error body
            assert (f["outcome"], f["status"]) == ("rejected", BAD_REQUESTS[f["kind"]][0]), f
        elif f["kind"] == "disconnect_before_response":
            assert f["outcome"] == "disconnected", f
        else:
            assert f["outcome"] in ("disconnected", "finished_first"), f


def test_memory_series_and_provenance(report):
    meta, m = report
    assert meta["git_revision"] and meta["device"] and "bench/soak.py" in meta["command"]
    samples = m["samples"]
    assert len(samples) >= 4 and samples[-1]["done"] == 2 * NUM_PROMPTS
    assert all(s["api_rss_bytes"] > 0 and s["core_rss_bytes"] > 0 for s in samples)
    assert all(s["rss_bytes"] >= s["api_rss_bytes"] + s["core_rss_bytes"] for s in samples)
    assert all(s["device_memory_used_bytes"] == 0 for s in samples)      # the CPU keeps no count
    assert m["memory"]["api_rss_bytes"]["samples"] >= 2 * 3
    assert m["verdicts"]["device_memory_used_growth_under_2%"] == "n/a"
    assert 0 < m["warmup_end_s"] < m["load_end_s"]
