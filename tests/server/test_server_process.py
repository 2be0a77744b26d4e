"""The server's two processes: the engine core dying mid-stream, SIGTERM with streams open, and multi-step
programs whose stop strings land between a program's steps. A tiny random-weight Llama with SmolLM2's
tokenizer, so each test can start its own server quickly.

Where a test needs a stream open before the core answers, it freezes the core with SIGSTOP first: the
stream is then open for sure on any machine, with no timing involved.
"""
from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from conftest import ServerProcess, child_pids, save_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.cost(80)]

MODEL = "tiny"
FLAGS = ["--max-model-len", "256", "--max-num-seqs", "8", "--served-model-name", MODEL, "--dtype", "float32"]
BODY = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True, "temperature": 0,
        "stream": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_server")
    save_tiny_llama(d, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, initializer_range=0.2)
    return str(d)


def _data(lines) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def _poll(fn, deadline_s: float, what: str):
    """fn() until it returns a truthy value, with a deadline."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.05)
    pytest.fail(f"{what}: not within {deadline_s} s")


def _health(base: str) -> int | None:
    try:
        return httpx.get(base + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return None


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:           # a zombie (exited, not reaped yet) is gone too
        return f.read().split(") ", 1)[1].startswith("Z")


def test_core_death_fails_streams_turns_health_503_and_exits_nonzero(model_dir):
    with ServerProcess(["--model", model_dir, *FLAGS]) as srv:
        core = srv.core_pid()
        os.kill(core, signal.SIGSTOP)                  # the request reaches a frozen core: the stream stays open
        with httpx.stream("POST", srv.base + "/v1/completions", json=BODY, timeout=120) as r:
            assert r.status_code == 200
            os.kill(core, signal.SIGKILL)
            events = _data(r.iter_lines())
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "engine core" in error["message"]
        assert _poll(lambda: _health(srv.base) == 503, 60, "/health answering 503")
        r = httpx.post(srv.base + "/v1/completions", json={**BODY, "stream": False}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
        code = srv.proc.wait(timeout=120)
        assert code != 0, srv.read_log()[-3000:]
        assert "exiting" in srv.read_log()


def test_sigterm_ends_open_streams_and_exits_0_within_10s_leaving_no_process(model_dir):
    with ServerProcess(["--model", model_dir, *FLAGS]) as srv:
        core = srv.core_pid()
        children = child_pids(srv.proc.pid)
        os.kill(core, signal.SIGSTOP)                  # streams open, nothing generated yet
        with httpx.Client(timeout=120) as http:
            streams = [http.stream("POST", srv.base + "/v1/completions", json={**BODY, "max_tokens": 200})
                       for _ in range(2)]
            responses = [s.__enter__() for s in streams]
            assert all(r.status_code == 200 for r in responses)
            signalled = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            os.kill(core, signal.SIGCONT)
            for s, r in zip(streams, responses):
                events = _data(r.iter_lines())
                s.__exit__(None, None, None)
                assert events[-1] == "[DONE]"
                assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        code = srv.proc.wait(timeout=120)
        took = time.monotonic() - signalled
        assert code == 0, srv.read_log()[-3000:]       # a clean exit, not death by the signal
        assert took < 10, f"exited {took:.1f} s after SIGTERM"
        assert "Traceback" not in srv.read_log()
        for pid in children:                            # the core and multiprocessing's resource tracker
            assert _poll(lambda: _gone(pid), 60, f"child process {pid} exiting")


def test_multi_step_stop_strings_equal_llm_generate(model_dir):
    """8 decode steps per program in the server; each stop string ends inside a program's steps. The
    streamed text, the non-streamed text and the token counts equal LLM.generate with one step per
    program, and no streamed text goes past the stop."""
    from jaxpaged import LLM, SamplingParams
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, max_num_seqs=8, num_scheduler_steps=1)
    prompts = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
    free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    tok = llm.get_tokenizer()
    cases = []
    for p, out in zip(prompts, free):
        ids = out.outputs[0].token_ids
        for at in (11, 21):                           # tokens 11-12 / 21-22: inside the 2nd / 3rd program
            stop = tok.decode(ids[at:at + 2]).strip()
            if stop:
                cases.append((p, stop))
    assert len(cases) >= 3
    refs = [o.outputs[0] for o in llm.generate(
        [p for p, _ in cases], [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[s])
                                for _, s in cases], use_tqdm=False)]
    with ServerProcess(["--model", model_dir, *FLAGS, "--num-scheduler-steps", "8"]) as srv:
        assert "steps_per_program=8" in srv.read_log()
        with httpx.Client(base_url=srv.base, timeout=120) as http:
            for (p, stop), ref in zip(cases, refs):
                body = {**BODY, "prompt": p, "max_tokens": 40, "stop": [stop],
                        "stream_options": {"include_usage": True}}
                with http.stream("POST", "/v1/completions", json=body) as r:
                    events = [json.loads(e) for e in _data(r.iter_lines())[:-1]]
                text = "".join(c["text"] for e in events for c in e["choices"])
                finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
                usage = [e["usage"] for e in events if e.get("usage")][-1]
                assert ref.finish_reason == "stop" and ref.stop_reason == stop
                assert text == ref.text and stop not in text and finish == ["stop"], (p, stop)
                assert usage["completion_tokens"] == len(ref.token_ids)
                full = http.post("/v1/completions", json={**body, "stream": False}).json()
                assert full["choices"][0]["text"] == ref.text and full["choices"][0]["finish_reason"] == "stop"
                assert full["usage"]["completion_tokens"] == len(ref.token_ids)


# ---- several API processes (--api-server-count) --------------------------------------------------
# Which process serves a connection is the kernel's choice; a test that needs one freezes the other with
# SIGSTOP, so that only it can accept the connection.
TWO_API = ["--api-server-count", "2"]


def _metric(text: str, name: str, labels: str = "") -> float | None:
    for line in text.splitlines():
        if line.startswith(f"jaxpaged:{name}{{") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def _stream_text(base: str, body: dict) -> tuple[str, str]:
    """One streamed completion on a new connection: its text and finish reason."""
    with httpx.Client(timeout=120) as http, http.stream("POST", base + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = _data(r.iter_lines())
    assert events[-1] == "[DONE]"
    choices = [c for e in events[:-1] for c in json.loads(e)["choices"]]
    return "".join(c["text"] for c in choices), choices[-1]["finish_reason"]


def test_two_api_processes_serve_alike_sum_metrics_and_drain_on_sigterm(model_dir):
    body = {**BODY, "max_tokens": 24}
    with ServerProcess(["--model", model_dir, *FLAGS, *TWO_API]) as srv:
        first = srv.proc.pid
        core, other = srv.spawned_pids()
        assert "API server process 1 of 2 ready" in srv.read_log()
        served = {}
        for frozen, name in ((first, "the other"), (other, "the first")):
            os.kill(frozen, signal.SIGSTOP)
            try:
                served[name] = [_stream_text(srv.base, body) for _ in range(3)]
            finally:
                os.kill(frozen, signal.SIGCONT)
        texts = {t for outs in served.values() for t, _ in outs}
        assert len(texts) == 1 and texts != {""}, served          # greedy: the same text whoever streams it
        assert {f for outs in served.values() for _, f in outs} == {"length"}

        def summed():          # every process's share, as each has moved it (at most a second late)
            text = httpx.get(srv.base + "/metrics", timeout=10).text
            got = (_metric(text, "generation_tokens_total"),
                   _metric(text, "request_success_total", 'finished_reason="length"'))
            return got if got == (6 * 24, 6) else None
        _poll(summed, 60, "/metrics summing both API processes' counters")

        os.kill(core, signal.SIGSTOP)                  # a stream open in each process, nothing generated yet
        with httpx.Client(timeout=120) as http_other, httpx.Client(timeout=120) as http_first:
            opened = []
            for frozen, http in ((first, http_other), (other, http_first)):
                os.kill(frozen, signal.SIGSTOP)
                try:
                    s = http.stream("POST", srv.base + "/v1/completions", json={**BODY, "max_tokens": 200})
                    r = s.__enter__()
                    assert r.status_code == 200
                    opened.append((s, r))
                finally:
                    os.kill(frozen, signal.SIGCONT)
            signalled = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            os.kill(core, signal.SIGCONT)
            for s, r in opened:
                events = _data(r.iter_lines())
                s.__exit__(None, None, None)
                assert events[-1] == "[DONE]"
                assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        code = srv.proc.wait(timeout=120)
        took = time.monotonic() - signalled
        assert code == 0, srv.read_log()[-3000:]
        assert took < 10, f"exited {took:.1f} s after SIGTERM"
        assert "Traceback" not in srv.read_log()
        for pid in (core, other):
            assert _poll(lambda: _gone(pid), 60, f"process {pid} exiting")


def test_core_death_reaches_the_other_api_process(model_dir):
    with ServerProcess(["--model", model_dir, *FLAGS, *TWO_API]) as srv:
        first = srv.proc.pid
        core, other = srv.spawned_pids()
        os.kill(core, signal.SIGSTOP)
        os.kill(first, signal.SIGSTOP)                 # the stream opens in the other API process
        try:
            s = httpx.stream("POST", srv.base + "/v1/completions", json=BODY, timeout=120)
            r = s.__enter__()
            assert r.status_code == 200
        finally:
            os.kill(first, signal.SIGCONT)
        os.kill(core, signal.SIGKILL)                  # killed outright: the first process tells the other
        events = _data(r.iter_lines())
        s.__exit__(None, None, None)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "engine core" in error["message"]
        assert srv.proc.wait(timeout=120) != 0, srv.read_log()[-3000:]
        assert _poll(lambda: _gone(other), 60, "the other API process exiting")


def test_an_api_process_dying_stops_the_server(model_dir):
    with ServerProcess(["--model", model_dir, *FLAGS, *TWO_API]) as srv:
        core, other = srv.spawned_pids()
        os.kill(other, signal.SIGKILL)
        assert srv.proc.wait(timeout=120) == 1, srv.read_log()[-3000:]
        assert "API server process jaxpaged-api-server-1 exited (exit code -9)" in srv.read_log()
        assert _poll(lambda: _gone(core), 60, "the engine core exiting")


def test_core_step_log_records_every_step_and_arrival(model_dir, tmp_path, monkeypatch):
    """JAXPAGED_STEP_LOG: the core writes each step (tokens, requests) and each arrival when it stops."""
    log = tmp_path / "steps.csv"
    monkeypatch.setenv("JAXPAGED_STEP_LOG", str(log))
    prompts = ["Once upon a time", "The capital of France is", "1 2 3 4 5 6 7 8 9"]
    with ServerProcess(["--model", model_dir, *FLAGS]) as srv:
        lens = []
        before = time.perf_counter()
        for p in prompts:          # one at a time: each request's steps are its own
            r = httpx.post(srv.base + "/v1/completions", timeout=120,
                           json={**BODY, "prompt": p, "max_tokens": 5, "stream": False})
            assert r.status_code == 200, r.text
            lens.append(r.json()["usage"]["prompt_tokens"])
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=60) == 0
    import numpy as np
    steps = np.loadtxt(log, delimiter=",", ndmin=2)
    arrivals = np.loadtxt(tmp_path / "steps-arrivals.csv", delimiter=",", ndmin=2)
    assert arrivals[:, 1].tolist() == [1, 1, 1] and arrivals[0, 0] == 0 and np.all(np.diff(arrivals[:, 0]) > 0)
    # each request: one step with its whole prompt, then 4 one-token steps (its first token came with the prompt)
    assert steps[:, 1].tolist() == [n for n in lens for n in (n, 1, 1, 1, 1)]
    assert steps[:, 2].tolist() == [1] * 15 and np.all(np.diff(steps[:, 0]) > 0)
    # the logs' zero is the first arrival on the host's monotonic clock, which this process reads too
    from bench.core_steps import log_zero
    zero = log_zero(log)
    assert zero == log_zero(tmp_path / "steps-arrivals.csv") and before < zero < time.perf_counter()
