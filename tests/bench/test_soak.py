"""bench/soak.py: the fault plan, the bad requests and the growth windows with exact values; then end to end:
it starts the real server (`--serve`) on the tiny random-weight Llama, runs both phases with half of phase 2
faults (every kind), stops the server, and its report holds no 5xx, every fault's expected outcome, the
memory series and the pool free at the end.

The server's shapes stay few (8 sequences, 64 tokens a step: six programs to compile on the CPU), its pool
small (1024 blocks: a step on the CPU costs time with the pool's size) and the outputs short.
"""
import json
import os
import signal
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from bench.soak import window_growth
from bench.soak_faults import BAD_REQUESTS, FAULT_KINDS, bad_request_body, error_body_problem, plan_kinds

NUM_PROMPTS = 30               # each phase
SERVER_FLAGS = ["--load-format", "dummy", "--max-model-len", "1100", "--max-num-seqs", "8",
                "--max-num-batched-tokens", "64", "--num-gpu-blocks-override", "1024",
                "--disable-log-requests", "--uvicorn-log-level", "warning"]


def test_fault_plan_draws_positions_and_shares_the_kinds():
    kinds = plan_kinds(200, 0.05, np.random.default_rng(0))
    assert len(kinds) == 200 and kinds == plan_kinds(200, 0.05, np.random.default_rng(0))
    faults = [k for k in kinds if k != "normal"]
    assert len(faults) == 10 and set(faults) == set(FAULT_KINDS)          # 8 kinds: two of them twice
    assert plan_kinds(20, 0.0, np.random.default_rng(0)) == ["normal"] * 20


def test_bad_request_bodies_and_the_error_schema():
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.0, "stream": True}
    assert json.loads(bad_request_body("oov_token_id", body, 10))["prompt"] == [1, 2, 3, 2**31 - 1]
    assert json.loads(bad_request_body("n_over_limit", body, 10))["n"] == 129
    assert json.loads(bad_request_body("prompt_over_max_model_len", body, 10))["prompt"] == [1, 2, 3] * 3 + [1, 2]
    assert b'"temperature": NaN' in bad_request_body("nan_temperature", body, 10)
    with pytest.raises(json.JSONDecodeError):
        json.loads(bad_request_body("malformed_json", body, 10))
    assert json.loads(bad_request_body("unknown_model", body, 10))["model"] == "no-such-model"
    ok = {"error": {"message": "m", "type": "BadRequestError", "param": None, "code": 400}}
    assert error_body_problem(json.dumps(ok), 400) is None
    assert "not 404" in error_body_problem(json.dumps(ok), 404)
    assert "not an OpenAI error body" in error_body_problem("Internal Server Error", 400)
    del ok["error"]["param"]
    assert error_body_problem(json.dumps(ok), 400) is not None


def test_growth_compares_the_median_of_the_last_window_with_the_first():
    samples = [{"t_s": float(t), "rss": v} for t, v in enumerate([50, 100, 100, 101, 99, 100, 102, 102, 103, 102])]
    g = window_growth(samples, "rss", 1.0, 9.0, 0.1)           # warm-up (t < 1) left out; windows of 3 samples
    assert (g["samples"], g["window"], g["first_median"], g["last_median"]) == (9, 3, 100, 102)
    assert g["growth"] == pytest.approx(0.02)
    assert window_growth(samples, "rss", 5.0, 9.0, 0.1)["growth"] is None       # 5 samples: not two windows
    assert window_growth([{**s, "rss": 0} for s in samples], "rss", 0.0, 9.0, 0.1)["growth"] is None


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from bench.common import REPO_ROOT
    from bench.models import ensure_model_dir
    out = tmp_path_factory.mktemp("soak")
    cmd = [sys.executable, str(REPO_ROOT / "bench" / "soak.py"), "--model", "tiny-llama",
           "--num-prompts", str(NUM_PROMPTS), "--fault-num-prompts", str(NUM_PROMPTS), "--fault-fraction", "0.5",
           "--request-rate", "20", "--max-output-len", "16", "--sample-period-s", "0.5", "--disable-tqdm",
           "--server-timeout-s", "300", "--request-timeout-s", "300",
           "--result-name", "soak", "--serve", "--", "--model", ensure_model_dir("tiny-llama"), *SERVER_FLAGS]
    # its own process group: on a timeout the script and the server it started go together
    proc = subprocess.Popen(cmd, env={**os.environ, "JAXPAGED_BENCH_RESULTS": str(out)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        server_log = out / "soak-server.log"
        server = server_log.read_text()[-3000:] if server_log.exists() else ""
        pytest.fail(f"the soak ran past 600 s:\n{log[-3000:]}\nserver log:\n{server}")
    assert proc.returncode in (0, 1), log[-4000:]        # 1: a verdict failed (memory may grow on the CPU)
    data = json.loads((out / "soak.json").read_text())
    assert (out / "soak.md").exists() and (out / "soak.png").exists()
    return data["meta"], data["metrics"]


@pytest.mark.slow
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


@pytest.mark.slow
def test_every_fault_kind_got_what_it_must(report):
    _, m = report
    faults = m["faults"]
    assert len(faults) == NUM_PROMPTS // 2
    by_kind = Counter(f["kind"] for f in faults)
    assert set(by_kind) == set(FAULT_KINDS) and max(by_kind.values()) - min(by_kind.values()) <= 1
    for f in faults:
        if f["kind"] in BAD_REQUESTS:      # the status its kind must get, with OpenAI's error body
            assert (f["outcome"], f["status"]) == ("rejected", BAD_REQUESTS[f["kind"]][0]), \
                f"{f['kind']} (fault {f['index']}): {f['outcome']}, status {f['status']}: {f['detail']}"
        elif f["kind"] == "disconnect_before_response":
            assert f["outcome"] == "disconnected", f
        else:
            assert f["outcome"] in ("disconnected", "finished_first"), f


@pytest.mark.slow
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
