"""bench/serve.py: the metric math on synthetic timings, and the streaming client against a stub.

The stub below is a tiny aiohttp SSE server that exists only to test the CLIENT's parsing and timing
math. It is NOT a substitute for the real jaxpaged server in product tests: those start
`python -m jaxpaged.server` (see bench/run_gpu_suite.sh and the server's own tests).
"""
import asyncio
import contextlib
import json
import threading

import numpy as np
import pytest

from bench.datasets import SampleRequest
from bench.serve import (RequestFuncOutput, benchmark, calculate_metrics, format_metrics, get_request, main,
                         parse_args)


def _req(n_in, n_out):
    return SampleRequest(None, list(range(n_in)), n_out)


def test_metrics_math_exact():
    reqs = [_req(10, 5), _req(20, 3), _req(30, 4)]
    outs = [
        RequestFuncOutput(success=True, latency=1.0, ttft=0.2, output_tokens=5, itl=[0.2, 0.2, 0.2, 0.2]),
        RequestFuncOutput(success=True, latency=2.0, ttft=1.5, output_tokens=3, itl=[0.25, 0.25]),
        RequestFuncOutput(success=False, error="boom"),
    ]
    m = calculate_metrics(reqs, outs, dur_s=4.0, percentiles=[50, 99])
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 8
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(2.0)
    assert m["total_token_throughput"] == pytest.approx(38 / 4)
    # TPOT excludes the first token: (1.0 - 0.2) / 4 = 0.2 s, (2.0 - 1.5) / 2 = 0.25 s
    assert m["mean_tpot_ms"] == pytest.approx(225.0)
    assert m["median_ttft_ms"] == pytest.approx(850.0)
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile([200.0, 1500.0], 99))
    assert m["mean_itl_ms"] == pytest.approx((4 * 200 + 2 * 250) / 6)
    assert m["mean_e2el_ms"] == pytest.approx(1500.0)
    # goodput (TTFT <= 1 s and TPOT <= 50 ms): neither request qualifies
    assert m["request_goodput"] == 0.0
    m2 = calculate_metrics(reqs, outs, dur_s=4.0, slo_ttft_ms=1000, slo_tpot_ms=200)
    assert m2["request_goodput"] == pytest.approx(0.25)
    text = format_metrics(m, 10, float("inf"))
    for label in ("Successful requests:", "Failed requests:", "Mean TTFT (ms):", "P99 TPOT (ms):",
                  "Median ITL (ms):", "Output token throughput (tok/s):", "Request goodput (req/s):"):
        assert label in text


def test_single_token_output_has_no_tpot():
    m = calculate_metrics([_req(4, 1)], [RequestFuncOutput(success=True, latency=0.1, ttft=0.1, output_tokens=1)],
                          1.0)
    assert m["mean_tpot_ms"] == 0.0 and m["request_goodput"] == 1.0


def test_poisson_arrivals_rate_and_inf(monkeypatch):
    """The arrival schedule on a virtual clock that get_request's sleeps advance: the gaps it asks for are
    under test, not the event loop's timer on a busy machine."""
    clock = [0.0]

    async def sleep(seconds):
        clock[0] += seconds

    monkeypatch.setattr(asyncio, "sleep", sleep)

    async def arrivals(rate, n):
        clock[0], times = 0.0, []
        async for _ in get_request([_req(1, 1)] * n, rate, seed=1):
            times.append(clock[0])
        return times
    assert asyncio.run(arrivals(float("inf"), 50)) == [0.0] * 50
    times = asyncio.run(arrivals(200.0, 40))
    assert 0.05 < times[-1] < 0.6   # 39 gaps of mean 5 ms
    gaps = np.random.default_rng(1).gamma(shape=1.0, scale=1 / 200, size=39)   # Poisson: exponential gaps
    assert times == pytest.approx(np.concatenate([[0.0], np.cumsum(gaps)]).tolist())


def test_goodput_default_slos_are_the_issues():
    """TTFT <= 1000 ms and TPOT <= 50 ms: only the request inside both counts."""
    reqs = [_req(4, 5)] * 4
    outs = [RequestFuncOutput(success=True, ttft=ttft, latency=ttft + 4 * tpot, output_tokens=5)
            for ttft, tpot in ((0.5, 0.04), (0.5, 0.06), (1.5, 0.04), (1.5, 0.06))]
    m = calculate_metrics(reqs, outs, dur_s=2.0)
    assert m["goodput_slo"] == {"ttft_ms": 1000.0, "tpot_ms": 50.0}
    assert m["request_goodput"] == pytest.approx(0.5) and m["request_throughput"] == pytest.approx(2.0)


def test_defaults():
    a = parse_args([])
    assert a.request_rate == float("inf") and a.goodput_ttft_ms == 1000 and a.goodput_tpot_ms == 50
    assert a.request_rates is None
    assert parse_args(["--request-rates", "inf,4,16,64"]).request_rates == [float("inf"), 4.0, 16.0, 64.0]
    for bad in (["--request-rates", "4,0"], ["--request-rates", "4,inf,4"],
                ["--request-rates", "4", "--request-rate", "2"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


# ---- client against a stub streaming server (client math only; see the module docstring) ----

def _stub_app(chunk_delay_s, seen):
    from aiohttp import web

    async def completions(request):
        body = await request.json()
        seen.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            await asyncio.sleep(chunk_delay_s)
            chunk = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": f"t{i}"}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                          "completion_tokens": body["max_tokens"]}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def models(request):
        return web.json_response({"data": [{"id": "stub"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    return app


async def _bench_against(app, requests, **kw):
    """Serve `app` on a free local port, run the benchmark client against it, shut the app down."""
    from aiohttp import web
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await benchmark(f"http://127.0.0.1:{port}/v1/completions", "stub", requests,
                               disable_tqdm=True, **kw)
    finally:
        await runner.cleanup()


def test_client_against_stub():
    seen = []
    reqs = [_req(7, 5), _req(9, 6), _req(3, 4), _req(5, 5)]
    res = asyncio.run(_bench_against(_stub_app(0.01, seen), reqs, max_concurrency=2))
    m = res["metrics"]
    assert m["completed"] == 4 and m["failed"] == 0
    assert m["total_output_tokens"] == 20 and m["total_input_tokens"] == 24
    body = seen[-1]
    assert body["ignore_eos"] is True and body["stream"] is True and isinstance(body["prompt"], list)
    assert len(seen) == 5   # one warm-up request, then the four
    # each chunk comes at least 10 ms after the one before (the stub sleeps); no upper bound, which would
    # measure how busy the machine is: instead each request's TTFT plus its ITLs add up to its latency
    assert m["mean_itl_ms"] >= 9.0 and m["mean_tpot_ms"] >= 9.0 and m["mean_ttft_ms"] >= 9.0
    assert len(res["itls"]) == 4 + 5 + 3 + 4
    per, itls = res["per_request"], iter(res["itls"])
    for ttft, latency, n_out in zip(per["ttfts"], per["latencies"], per["output_tokens"]):
        assert ttft + sum(next(itls) for _ in range(n_out - 1)) == pytest.approx(latency)
    assert per["output_tokens"] == [5, 6, 4, 5]


def test_client_processes_send_every_request_once_and_keep_its_order():
    """Three client processes: each request is sent once, its output lands at its own index, and the
    duration covers every request (sent after the release, ended before the duration's end)."""
    seen = []
    reqs = [_req(3 + i, 2 + i % 3) for i in range(7)]
    res = asyncio.run(_bench_against(_stub_app(0.005, seen), reqs, warmup=False, client_processes=3))
    m, per = res["metrics"], res["per_request"]
    assert m["completed"] == 7 and m["failed"] == 0
    assert sorted(len(b["prompt"]) for b in seen) == [3 + i for i in range(7)]
    assert per["output_tokens"] == [2 + i % 3 for i in range(7)]
    assert per["prompt_lens"] == [3 + i for i in range(7)]
    assert min(per["sent_s"]) >= 0
    assert max(sent + latency for sent, latency in zip(per["sent_s"], per["latencies"])) <= m["duration"]


def test_client_processes_need_rate_inf():
    with pytest.raises(ValueError, match="rate inf"):
        asyncio.run(benchmark("http://127.0.0.1:9/v1/completions", "stub", [_req(3, 2)], request_rate=4.0,
                              client_processes=2, warmup=False, disable_tqdm=True))


def test_client_records_http_errors():
    from aiohttp import web

    async def bad(request):
        return web.Response(status=500, text="nope")
    app = web.Application()
    app.router.add_post("/v1/completions", bad)
    res = asyncio.run(_bench_against(app, [_req(3, 4)] * 2, warmup=False))
    assert res["metrics"]["failed"] == 2 and res["metrics"]["completed"] == 0
    assert "HTTP 500" in res["errors"][0]


def test_time_limit_skips_unstarted_requests():
    seen = []
    # one at a time, 5 chunks of 20 ms each: ~0.1 s a request, limit 0.15 s -> 2 run, 4 skipped
    m = asyncio.run(_bench_against(_stub_app(0.02, seen), [_req(3, 5)] * 6, max_concurrency=1, warmup=False,
                                   time_limit_s=0.15))["metrics"]
    assert m["completed"] + m["skipped"] == 6 and m["failed"] == 0
    assert 1 <= m["completed"] <= 3 and m["skipped"] >= 3
    assert m["total_output_tokens"] == 5 * m["completed"]


# ---- the CLI (main) against the stub served from a thread: main runs its own event loops ----

@contextlib.contextmanager
def _serving_in_thread(app):
    """`app` listening on a free local port (bound before this yields) in a thread's event loop."""
    from aiohttp import web
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    import bench.common
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    return tmp_path


WORKLOAD = ["--model", "tiny-llama", "--dataset", "random", "--num-prompts", "4", "--input-len", "8",
            "--output-len", "4", "--served-model-name", "stub"]


def _good_requests(per_request, slo_ttft_ms, slo_tpot_ms):
    """Goodput's count recomputed from the saved per-request timings."""
    good = 0
    for ttft, latency, n_out in zip(per_request["ttfts"], per_request["latencies"], per_request["output_tokens"]):
        tpot = (latency - ttft) / (n_out - 1) if n_out > 1 else 0.0
        good += ttft * 1000 <= slo_ttft_ms and tpot * 1000 <= slo_tpot_ms
    return good


def test_rate_sweep_writes_rows_table_plot(results_dir, capsys):
    seen = []
    with _serving_in_thread(_stub_app(0.001, seen)) as url:
        sweep = main(["--base-url", url, *WORKLOAD, "--request-rates", "inf,50", "--result-name", "t",
                      "--save-per-request"])
    assert len(seen) == 1 + 2 * 4   # one warm-up for the whole sweep, then the workload at each rate
    rows = sweep["rows"]
    assert [r["request_rate"] for r in rows] == ["inf", "50.0"]
    assert sweep["rate_results"] == ["t-rinf", "t-r50"]
    assert sweep["goodput_slo"] == {"ttft_ms": 1000.0, "tpot_ms": 50.0}
    for row, name in zip(rows, sweep["rate_results"]):
        m = json.loads((results_dir / f"{name}.json").read_text())["metrics"]   # a single run's fields
        assert m["request_rate"] == row["request_rate"] and (results_dir / f"{name}.md").exists()
        assert row["completed"] == m["completed"] == 4 and row["failed"] == 0
        assert row["output_throughput"] == m["output_throughput"] == pytest.approx(16 / m["duration"])
        for key in ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_e2el_ms"):
            assert row[key] == m[key]
        assert m["p50_ttft_ms"] == m["median_ttft_ms"]   # --percentiles 99 (default), the sweep adds 50
        good = _good_requests(m["per_request"], 1000.0, 50.0)
        assert row["request_goodput"] == m["request_goodput"] == pytest.approx(good / m["duration"])
        assert row["request_goodput"] <= row["request_throughput"]
    data = json.loads((results_dir / "t-sweep.json").read_text())
    assert data["metrics"]["rows"] == rows and "git_revision" in data["meta"]
    table = (results_dir / "t-sweep.md").read_text()
    assert "| request_rate | completed |" in table and "| inf | 4 |" in table and "| 50.0 | 4 |" in table
    assert (results_dir / "t-sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    captured = capsys.readouterr()
    assert "request rates: 100%" in captured.err and "2/2" in captured.err   # the bar over rates
    assert captured.out.count("Serving Benchmark Result") == 2


def test_single_rate_run_writes_no_sweep(results_dir, capsys):
    seen = []
    with _serving_in_thread(_stub_app(0.001, seen)) as url:
        m = main(["--base-url", url, *WORKLOAD, "--request-rate", "50", "--result-name", "one", "--disable-tqdm"])
    assert m["completed"] == 4 and m["request_rate"] == "50.0" and "p50_ttft_ms" not in m
    assert sorted(p.name for p in results_dir.iterdir()) == ["one.json", "one.md"]
    assert "request rates" not in capsys.readouterr().err


def test_first_token_waves_find_the_median_requests_step():
    """Rate inf: first tokens grouped into the waves engine steps deliver them in; the median request's wave."""
    from bench.serve import first_token_waves
    start = 100.0
    firsts = [0.36, 0.36, 0.74, 0.74, 0.75, 1.10, 1.11]     # s from the start: waves end at 0.36, 0.75, 1.11
    outs = [RequestFuncOutput(success=True, sent_at=start + 0.01 * i, ttft=f - 0.01 * i) for i, f in enumerate(firsts)]
    outs.append(RequestFuncOutput(success=False, error="boom"))          # no first token: not counted
    m = first_token_waves(outs, start)
    assert m["first_token_waves"] == [[0.36, 2], [0.75, 3], [1.11, 2]]
    assert m["num_first_token_waves"] == 3 and m["median_first_token_wave"] == 2     # the 4th of 7
    assert first_token_waves(outs, start, max_waves=2)["first_token_waves"] == [[0.36, 2], [0.75, 3]]
    assert first_token_waves(outs[:1], start) == {}
    text = format_metrics({**calculate_metrics([_req(4, 1)] * 7, outs[:7], 2.0), **m}, None, float("inf"))
    assert "0.36:2 0.75:3 1.11:2" in text and "wave 2 of 3, at 0.750 s" in text
