"""bench/: per-step split, trace analysis, bandwidth floor, HF static packing, results files, summary.

Engine-facing scripts are exercised end to end by the CPU smoke suite
(`python bench/run_gpu_suite.py --smoke all`) and by test_bench_throughput_real below when jaxpaged.LLM
imports; these tests cover the arithmetic with exact values.
"""
import json

import numpy as np
import pytest

from bench import summarize, trace_analysis
from bench.common import flatten, markdown_table, write_result
from bench.datasets import SampleRequest
from bench.hf_baseline import static_batches
from bench.latency import bandwidth_floor_s
from bench.llm_args import engine_stats, stats_delta, step_split
from bench.models import LLAMA3_8B_CONFIG, QWEN2_0_5B_CONFIG


def test_step_split_from_cumulative_and_lists():
    before = {"num_steps": 10, "schedule_s": 1.0, "execute_s": 5.0, "device_s": [0.1] * 10, "kv_cache_usage": 0.5}
    after = {"num_steps": 30, "schedule_s": 1.2, "execute_s": 7.0, "device_s": [0.1] * 10 + [0.05] * 20,
             "kv_cache_usage": 0.7}
    split = step_split(stats_delta(before, after), elapsed_s=4.0)
    assert split["num_steps"] == 20
    assert split["schedule_per_step_ms"] == pytest.approx(10.0)
    assert split["execute_per_step_ms"] == pytest.approx(100.0)
    assert split["device_total_s"] == pytest.approx(1.0)
    assert split["execute_share"] == pytest.approx(0.5)
    assert "wait_s" in split["missing"] and "schedule_s" not in split["missing"]
    assert split["other_fields"]["kv_cache_usage"] == 0.7
    assert step_split(None)["available"] is False


def test_engine_stats_reads_the_engines_dataclass():
    stats_mod = pytest.importorskip("jaxpaged.engine.stats")
    engine = type("E", (), {"stats": stats_mod.EngineStats(num_steps=3, schedule_s=0.5)})()
    llm = type("L", (), {"llm_engine": engine})()
    s = engine_stats(llm)
    assert s["num_steps"] == 3 and s["schedule_s"] == 0.5


def test_trace_device_busy_and_gaps():
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 1, "ts": 0, "dur": 100, "name": "a"},      # [0, 100)
              {"ph": "X", "pid": 1, "ts": 50, "dur": 100, "name": "b"},     # overlaps -> [0, 150)
              {"ph": "X", "pid": 1, "ts": 160, "dur": 40, "name": "c"},     # 10 us gap (below threshold)
              {"ph": "X", "pid": 1, "ts": 300, "dur": 100, "name": "d"},    # 100 us gap
              {"ph": "X", "pid": 2, "ts": 0, "dur": 1000}]     # host: ignored
    r = trace_analysis.analyze_events(events)
    assert r["span_ms"] == pytest.approx(0.4) and r["device_busy_ms"] == pytest.approx(0.29)
    assert r["device_idle_ms"] == pytest.approx(0.11)
    assert r["num_gaps_over_20us"] == 1 and r["gaps_over_threshold_ms"] == pytest.approx(0.1)
    assert trace_analysis.analyze_events(events[1:2] + events[-1:]) is None
    assert trace_analysis.gaps_by_neighbours(events) == [
        {"before": "c", "after": "d", "count": 1, "total_ms": pytest.approx(0.1), "mean_us": pytest.approx(100)}]


def test_one_launch_in_detail_nests_the_calls_thread_events():
    ex = "PjRtCApiLoadedExecutable::Execute"
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 5, "name": "kernel"},
              {"ph": "X", "pid": 2, "tid": 1, "ts": 0, "dur": 100, "name": ex},
              {"ph": "X", "pid": 2, "tid": 1, "ts": 10, "dur": 50, "name": "update"},
              {"ph": "X", "pid": 2, "tid": 1, "ts": 20, "dur": 10, "name": "cuGraphExecKernelNodeSetParams"},
              {"ph": "X", "pid": 2, "tid": 1, "ts": 70, "dur": 5, "name": "cuGraphLaunch"},
              {"ph": "X", "pid": 2, "tid": 2, "ts": 70, "dur": 5, "name": "another thread"},
              {"ph": "X", "pid": 2, "tid": 1, "ts": 200, "dur": 300, "name": ex}]     # the longer call
    rows = trace_analysis.one_call_in_detail(events)
    assert [(r["at_us"], r["dur_us"], r["depth"], r["name"]) for r in rows] == [
        (0.0, 100.0, 0, ex), (10.0, 50.0, 1, "update"), (20.0, 10.0, 2, "cuGraphExecKernelNodeSetParams"),
        (70.0, 5.0, 1, "cuGraphLaunch")]
    assert trace_analysis.one_call_in_detail(events, name="absent") == []


def test_step_log_rows_and_gc_attribution(tmp_path):
    from bench.throughput import write_step_log
    rows = [(10.5, 64, 4, 300), (10.75, 4, 4, 304)]      # perf_counter at each step's end, tokens, reqs, ctx
    write_step_log(str(tmp_path / "s.csv"), rows, 10.0, [(10.6, 10.7, 2), (10.8, 10.9, 0)])
    a = np.loadtxt(tmp_path / "s.csv", delimiter=",", ndmin=2)
    np.testing.assert_allclose(a[:, 0], [0.5, 0.25])
    np.testing.assert_allclose(a[:, 4:], [[0.0, 0.0], [0.2, 0.1]])    # the second step holds both pauses
    write_step_log(str(tmp_path / "e.csv"), [], 10.0, [(10.6, 10.7, 2)])   # no steps: an empty log
    assert np.loadtxt(tmp_path / "e.csv", delimiter=",", ndmin=2).size == 0


def test_step_log_row_closes_when_the_steps_results_are_in(monkeypatch):
    """The engine keeps one step in flight: the on_step call that dispatches step N processes N-1's results,
    so N-1's row takes that call's time (a prefill's device time belongs to the prefill row, not to the
    decode row after it), and the call that dispatches nothing closes the last step."""
    from types import SimpleNamespace as NS
    stats_mod = pytest.importorskip("jaxpaged.engine.stats")
    stats = stats_mod.EngineStats(step_log=[])
    now = [0.0]
    monkeypatch.setattr(stats_mod.time, "perf_counter", lambda: now[0])
    req = NS(request_id="a", num_computed_tokens=0, num_prompt_tokens=40)
    scheduler = NS(num_running=1, num_waiting=0, running=[req], num_preemptions=0)
    kv = NS(pool=NS(usage=0.1), prefix_cache_queries=0, prefix_cache_hits=0, slot_usage=lambda reqs: (48, 41))
    # each call at its time: dispatch the prefill (1.0 s), a decode (3.0: the prefill's results are in),
    # another (3.5), then nothing (4.0: the last decode's results)
    for t, tokens in ((1.0, 40), (3.0, 1), (3.5, 1), (4.0, 0)):
        now[0] = t
        req.num_computed_tokens += tokens
        sched = NS(req_ids=["a"] if tokens else [], num_scheduled_tokens={"a": tokens})
        stats.on_schedule(sched, {"a": req})       # as LLMEngine.step: the scheduled step counted, then run
        stats.on_step(scheduler, kv, schedule_s=0.0, execute_s=0.0, process_s=0.0)
    assert stats.step_log == [(3.0, 40, 1, 40), (3.5, 1, 1, 41), (4.0, 1, 1, 42)]


def test_bandwidth_floor_llama3_8b():
    f = bandwidth_floor_s(LLAMA3_8B_CONFIG, batch_size=1, context_len=0)
    assert f["params"] == 8_030_261_248                      # Llama-3-8B's published 8.03B
    assert f["floor_s"] * 1000 == pytest.approx(6.348, abs=1e-3)   # BENCHMARKS.md: >= 6.3 ms/step
    kv = bandwidth_floor_s(LLAMA3_8B_CONFIG, batch_size=256, context_len=192)["kv_bytes"]
    assert kv == 256 * 192 * 131072                          # 128 KiB of K+V per token
    assert bandwidth_floor_s(QWEN2_0_5B_CONFIG, 1, 0)["params"] == pytest.approx(0.494e9, rel=0.01)


def test_families_roofline_counts_prefill_flops_weights_a_step_and_kv_up_to_each_window():
    from bench.families import ModelCosts, roofline_seconds
    # two layer kinds: 10 bytes a token of context on global layers, 4 on ones with a window of 5 tokens
    costs = ModelCosts(step_weight_bytes=100, layer_flops_per_token=7, attn_flops_per_pair=3,
                       kv_bytes=((10, None), (4, 5)))
    prompts, outputs = np.array([3, 1]), np.array([4, 1])
    # FLOPs: 7 x 4 prompt tokens + 3 x (6 + 1) causal pairs = 49, at 1 FLOP/s. Bytes: 2 steps of 100; the
    # decode contexts [4, 5, 6] (the second request's one token is its prefill's), 10 x 15 + 4 x (4 + 5 + 5)
    # = 206; at 2 bytes/s.
    assert roofline_seconds(costs, prompts, outputs, num_steps=2, peaks=(1.0, 2.0)) == 49 + (200 + 206) / 2


def test_families_model_costs_from_the_configs_shapes():
    from bench.families import model_costs
    llama = model_costs("llama3-8b")
    assert llama.kv_bytes == ((32 * 2 * 8 * 128 * 2, None),)             # 128 KiB a token, no window
    assert llama.layer_flops_per_token == 2 * (8_030_261_248 - 2 * 128256 * 4096 - 4096)   # no embedding, head, norm
    assert llama.attn_flops_per_pair == 4 * 32 * 128 * 32
    gemma = model_costs("gemma-2-9b")                                     # 21 sliding layers (window 4096), 21 global
    assert gemma.kv_bytes == ((21 * 2 * 8 * 256 * 2, 4096), (21 * 2 * 8 * 256 * 2, None))


def test_static_batches_packing():
    r = lambda i, o: SampleRequest(None, [0] * i, o)  # noqa: E731
    reqs = [r(900, 900), r(200, 1200), r(10, 10), r(10, 10), r(10, 10)]
    sizes = [[(len(x.prompt_token_ids), x.output_len) for x in b] for b in static_batches(reqs, max_batch=2)]
    assert sizes == [[(900, 900)], [(200, 1200), (10, 10)], [(10, 10), (10, 10)]]


def test_results_files_and_summary(tmp_path):
    meta = {"command": "python bench/throughput.py --model qwen2-0.5b", "date": "d", "git_revision": "abc",
            "device": "NVIDIA H100 80GB HBM3", "jax_version": "0.11.2"}
    write_result("throughput-qwen2-0.5b-sharegpt", {"output_tokens_per_second": 30000.0, "nested": {"a": 1},
                                                     "latencies": [1, 2]}, meta=meta, results_dir=tmp_path)
    write_result("hf-qwen2-0.5b-sharegpt", {"static": {"output_tokens_per_second": 1000.0},
                                            "continuous": {"output_tokens_per_second": 200.0},
                                            "best_output_tokens_per_second": 1000.0}, meta=meta, results_dir=tmp_path)
    write_result("serve-openqa-c1", {"median_tpot_ms": 2.0, "output_throughput": 450.0}, meta=meta,
                 results_dir=tmp_path)
    data = json.loads((tmp_path / "throughput-qwen2-0.5b-sharegpt.json").read_text())
    assert data["meta"]["device"] == "NVIDIA H100 80GB HBM3" and data["metrics"]["nested"] == {"a": 1}
    md = (tmp_path / "throughput-qwen2-0.5b-sharegpt.md").read_text()
    assert "| nested.a | 1 |" in md and "git_revision: `abc`" in md and "latencies" not in md
    for name, idle in (("throughput-qwen2-0.5b-sharegpt-profile", 140.0),        # the default and a variant
                       ("throughput-qwen2-0.5b-sharegpt-profile-ms32", 70.0)):
        write_result(name, {"trace": {"device_busy_ms": 1000.0, "device_idle_ms": idle}}, meta=meta,
                     results_dir=tmp_path)
    s = summarize.summarize(sorted(tmp_path.glob("*.json")), tmp_path, "sum")
    assert s["headline"]["qwen2-0.5b / best HF (same run)"] == pytest.approx(30.0)
    assert s["headline"]["host idle / device busy, qwen2-0.5b profile (max)"] == pytest.approx(0.14)
    assert s["headline"]["host idle / device busy, qwen2-0.5b profile ms32"] == pytest.approx(0.07)
    assert s["headline"]["host idle / device busy, qwen2-0.5b profile, traced by"] == "kernels"
    # with a run traced by whole graph launches, the bar reads that one; the kernel-level figure stays beside it
    write_result(summarize.GRAPHS_PROFILE, {"trace": {"device_busy_ms": 1000.0, "device_idle_ms": 10.0}}, meta=meta,
                 results_dir=tmp_path)
    h = summarize.summarize(sorted(tmp_path.glob("*.json")), tmp_path, "sum")["headline"]
    assert h["host idle / device busy, qwen2-0.5b profile (max)"] == pytest.approx(0.01)
    assert h["host idle / device busy, qwen2-0.5b profile, traced by"] == "whole graph launches"
    assert h["host idle / device busy, qwen2-0.5b profile, kernel-level trace"] == pytest.approx(0.14)
    assert "host idle / device busy, qwen2-0.5b profile graphs" not in h
    met = {row["target"]: row["met"] for row in s["targets"]}
    assert met["qwen2-0.5b sharegpt output tok/s"] == "yes" and met["qwen2-0.5b / best HF (same run)"] == "yes"
    assert met["openqa c1 median TPOT ms (max)"] == "yes" and met["llama3-8b sharegpt output tok/s"] == "n/a"
    assert (tmp_path / "sum.md").exists() and any(p.endswith(".png") for p in s["plots"])
    # a suite bundle (what comes back from the GPU machine) is read the same way
    bundle = tmp_path / "suite-x.json"
    bundle.write_text(json.dumps({"results": {"serve-openqa-c10": {"meta": meta,
                                                                   "metrics": {"output_throughput": 3500.0}}}}))
    assert summarize.load_results([bundle])["serve-openqa-c10"]["metrics"]["output_throughput"] == 3500.0


def test_markdown_helpers():
    assert flatten({"a": {"b": 1, "c": [1]}, "d": 2}) == {"a.b": 1, "d": 2}
    assert markdown_table([{"x": 1.23456, "y": "z"}]).splitlines()[2] == "| 1.23 | z |"


def test_scripts_have_help():
    import subprocess
    import sys
    from bench.common import REPO_ROOT
    for script in ("throughput", "latency", "serve", "soak", "hf_baseline", "summarize", "run_gpu_suite"):
        r = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / f"{script}.py"), "-h"], capture_output=True,
                           text=True, timeout=120, cwd="/")
        assert r.returncode == 0 and "usage" in r.stdout, (script, r.stderr[-500:])


def test_stamp_with_and_without_jax(monkeypatch):
    """Every result carries its provenance; a suite-provided revision wins over the local git."""
    from bench import common
    monkeypatch.setattr(common, "_GIT_REV_ENV", "abc1234")
    for with_device in (True, False):
        s = common.stamp(["bench/x.py", "--flag"], with_device=with_device)
        assert s["git_revision"] == "abc1234" and "bench/x.py --flag" in s["command"]
        assert s["device"] and s["date"]


def test_kernel_bench_variants_and_routing(monkeypatch):
    """bench_kernels: --decode-variants parses keyword sets; the routed decode figure takes the Mosaic
    kernel's time from MOSAIC_DECODE_MIN_PAIRS (request, kv head) pairs and the Triton default below, with
    its ratios to JAX's op in the run and to the BENCHMARKS.md anchor."""
    import argparse

    from bench import bench_kernels as bk
    assert bk._variants("num_stages=3,table=True;merge='jnp'") == [{"num_stages": 3, "table": True},
                                                                  {"merge": "jnp"}]
    for bad in ("num_stages", "x=not a literal"):
        with pytest.raises(argparse.ArgumentTypeError):
            bk._variants(bad)
    monkeypatch.setattr(bk.pk, "MOSAIC_DECODE_MIN_PAIRS", 128)
    small = {"layout": "qwen2-0.5b", "seqs": 16, "ctx": 1024, "kv_bytes": 8 << 20, "default_us": 10.0,
             "jax_us": 15.0, "mgpu_us[128,2]": 20.0}
    bk._routed(small, 16 * 2)
    assert small["routed_kernel"] == "triton" and small["routed_us"] == 10.0
    assert small["routed_vs_jax"] == pytest.approx(1.5) and small["routed_vs_anchor"] == pytest.approx(11.8)
    big = {"layout": "llama3-8b", "seqs": 16, "ctx": 4096, "kv_bytes": 1 << 28, "default_us": 130.0,
           "mgpu_us[128,2]": 100.0}
    bk._routed(big, 16 * 8)
    assert big["routed_kernel"] == "mosaic" and big["routed_us"] == 100.0
    assert "routed_vs_jax" not in big and "routed_vs_anchor" not in big     # no JAX run, no anchor shape


def test_api_capacity_streams_every_token_through_the_real_server(tmp_path):
    """bench/api_capacity.py: the real server process over the stand-in core (no model) serves every
    request its whole output length."""
    import json
    import os
    import subprocess
    import sys

    from conftest import free_port
    env = {**os.environ, "JAXPAGED_BENCH_RESULTS": str(tmp_path)}
    subprocess.run([sys.executable, "bench/api_capacity.py", "--num-prompts", "16", "--output-len", "40",
                    "--tokens-per-step", "16", "--port", str(free_port())], check=True, env=env, timeout=600,
                   capture_output=True)
    (result,) = tmp_path.glob("api-capacity-16x40-k16.json")
    m = json.loads(result.read_text())["metrics"]
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (16, 0, 16 * 40)


def test_step_kernels_names_each_kernel_by_what_is_fused_into_it(tmp_path):
    """bench/step_kernels.py's table: a kernel of the trace is found in the optimized HLO by its name ('.' ->
    '_'), and listed with the JAX operations of its fused computation, per decode step."""
    import gzip

    import jax
    import jax.numpy as jnp

    from bench.step_kernels import parse_hlo, table

    def layer(x, w):
        with jax.named_scope("mlp"):
            return jax.nn.silu(x @ w) * 2.0
    text = jax.jit(layer).lower(jnp.ones((4, 8)), jnp.ones((8, 8))).compile().as_text()
    hlo = parse_hlo(text)
    fusions = [name for name, info in hlo.items() if info["op"] == "fusion"]
    assert fusions and all("." not in name for name in hlo)
    name = max(fusions, key=lambda n: sum(hlo[n]["what"].values()))
    assert any("mlp" in what for what in hlo[name]["what"])
    with gzip.open(tmp_path / "hlo-00.txt.gz", "wt") as f:
        f.write(text)
    (tmp_path / "kernels.json").write_text(json.dumps({
        "model": "m", "rows": 1, "ctx": 8, "max_model_len": 64, "steps_per_call": 4, "calls": 2,
        "layer_dispatch": "unrolled", "device": "d", "us_per_step": 10.0,
        "kernels": [{"name": name, "total_us": 80.0, "count": 16, "args": {}}]}))
    out = table(tmp_path)
    assert "kernels a step: 2.0; device time a step: 10.0 us" in out
    row = next(line for line in out.splitlines() if line.startswith(name))
    assert row.split()[1:4] == ["2.00", "5.00", "10.0"] and "mlp" in row


def test_step_kernels_sets_module_constants_for_an_ab(monkeypatch):
    """step_kernels.py --set MODULE.NAME=VALUE: a code switch set before the engine is built (a literal value);
    a name the module lacks, or a malformed item, stops the run."""
    import jaxpaged.models.decoder as decoder
    from bench.step_kernels import apply_sets
    monkeypatch.setattr(decoder, "INT4_PREPARE_DOWN", decoder.INT4_PREPARE_DOWN)   # restored after the test
    assert apply_sets(["jaxpaged.models.decoder.INT4_PREPARE_DOWN=False"]) == [
        ("jaxpaged.models.decoder.INT4_PREPARE_DOWN", False)]
    assert decoder.INT4_PREPARE_DOWN is False
    for bad in ("jaxpaged.models.decoder.NO_SUCH_SWITCH=1", "INT4_PREPARE_DOWN"):
        with pytest.raises(SystemExit):
            apply_sets([bad])


def test_step_log_table_groups_steps_and_sets_each_against_its_floor(tmp_path):
    """bench/step_log_table.py: mixed steps (any prompt token) apart, decode steps by request count; a step's
    floor is the larger of its bytes (weights once, every request's KV) at the HBM's peak and its FLOPs (2 x the
    layer parameters a token, the LM head a request) at the FLOP peak."""
    from bench import step_log_table as slt
    # seconds, tokens, requests, context tokens, gc, gc gen 2 (bench/throughput.py's columns)
    rows = [(0.40, 1000, 10, 5000, 0, 0),   # mixed
            (0.01, 4, 4, 400, 0, 0), (0.03, 8, 8, 800, 0, 0),   # decode 1-16
            (0.05, 100, 100, 10_000, 0, 0)]                     # decode 65-128
    path = tmp_path / "steps.csv"
    np.savetxt(path, np.array(rows), delimiter=",", header="seconds,tokens,requests,context_tokens,gc_seconds,"
               "gc_gen2_seconds")
    steps = slt.load(str(path))
    assert steps.shape == (4, 4)
    # weights 1000 B, 10 B of KV a token of context, 100 FLOPs a token, 1000 a request; peaks 1e6 FLOP/s, 1e3 B/s
    floor = slt.floors(steps, 1000, 100, 1000, 10, (1e6, 1e3))
    # mixed: bytes 1000 + 50,000 -> 51 s; FLOPs 100,000 + 10,000 -> 0.11 s. decode: 5 s, 9 s; 101 s
    np.testing.assert_allclose(floor, [51.0, 5.0, 9.0, 101.0])
    table = {r["group"]: r for r in slt.groups(steps, floor)}
    assert list(table) == ["mixed", "decode 1-16", "decode 65-128", "all"]
    assert (table["decode 1-16"]["steps"], table["decode 1-16"]["seconds"]) == (2, pytest.approx(0.04))
    assert table["decode 1-16"]["median_ms"] == pytest.approx(20.0)
    assert table["decode 1-16"]["ratio"] == pytest.approx(0.04 / 14.0)
    assert table["all"]["floor_s"] == pytest.approx(166.0)
    assert "| decode 65-128 | 1 | 0.05 | 50.00 ms | 101.00 s | 0.00 |" in slt.markdown(list(table.values()), "t")


def test_core_steps_reads_the_burst_after_a_warm_up_request():
    from bench.core_steps import burst_start, table
    # a warm-up request at 0 s (its prompt step and 2 decode steps), then 20 requests at 1.000-1.019 s
    arrivals = np.array([[0.0, 1]] + [[1.0 + i / 1000, 1] for i in range(20)])
    assert burst_start(arrivals) == 1
    steps = np.array([[0.1, 30, 1, 0], [0.2, 1, 1, 30], [0.3, 1, 1, 31],
                      [1.05, 600, 3, 0], [1.10, 4000, 17, 0], [1.50, 9000, 20, 0]], float)
    rows = table(steps, arrivals, 8, max_tokens=16384, max_seqs=1024)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["end_s"] for r in rows] == [0.05, 0.1, 0.5]
    assert [r["scheduled_s"] for r in rows] == [0.0, 0.0, 0.05]     # step N is scheduled as N-2 ends
    assert [r["arrived_by_schedule"] for r in rows] == [1, 1, 20]
    assert [r["bucket_tokens"] for r in rows] == [1024, 4096, 16384]
    # against the client's clock: the log's zero at perf_counter 500.0, the client's start at 500.8
    from bench.core_steps import client_offsets
    assert client_offsets(steps, arrivals, zero=500.0, client_start=500.8) == {"first_arrival_s": 0.2,
                                                                               "first_step_end_s": 0.25}


def test_sampler_chunks_times_both_arms_and_restores_the_switch(capsys):
    """bench/sampler_chunks.py on small random logits: one table row a variant, the rows a chunk as the sampler
    takes them, and the module switch as it was after."""
    from bench import sampler_chunks
    from jaxpaged.runner import sampler
    before = sampler.SAMPLER_CHUNK_BYTES
    assert sampler_chunks.main(["--rows", "8", "--vocab", "500", "--iters", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 8 | 500 |")]
    assert [r.split("|")[3].strip() for r in rows] == ["top_k_p", "logprobs_20", "all"]
    assert all(r.split("|")[4].strip() == "8" for r in rows)      # 8 rows of 500 fit one 128 MiB chunk
    assert sampler.SAMPLER_CHUNK_BYTES == before


def test_temporaries_reports_every_variant_beside_the_reserve(tmp_path, capsys):
    """bench/temporaries.py on a tiny Llama (the CPU's XLA): the largest bucket's step under each sampler variant,
    with the reserve the engine sized its pool by, every variant within it."""
    import json

    from bench import temporaries
    from tests.conftest import save_tiny_llama
    save_tiny_llama(tmp_path / "m", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    out = tmp_path / "t.json"
    assert temporaries.main(["--models", str(tmp_path / "m"), "--max-model-len", "128", "--blocks", "64",
                             "--json", str(out)]) == 0
    [r] = json.loads(out.read_text())
    assert set(r["largest_bucket_variants_gib"]) == set(temporaries.variant_flags())
    assert r["largest_bucket"] == "2048 tokens, 256 rows"
    assert 0 < max(r["largest_bucket_variants_gib"].values()) <= r["reserve_gib"]


def test_ncu_blocks_splits_at_branches_and_shares_the_stall_samples(tmp_path, capsys):
    """gemv_ncu.py --blocks on a SASS page as ncu writes it (CSV: the kernel's name row, the header, one row an
    instruction): blocks end at each branch; each gets its run count, its share of the samples and its stalls."""
    import csv

    from bench.gemv_ncu import blocks
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_barrier",
              "stall_long_sb", "stall_long_sb (Not Issued)"]
    rows = [["Kernel Name", "k"], header,
            ["0", "LDS R1, [R2]", "10", "64", "0", "10", "4"],
            ["1", "@!P1 BRA 0x0", "70", "64", "0", "70", "9"],
            ["2", "HGMMA.64x64x16", "15", "32", "15", "0", "0"],
            ["3", "EXIT", "5", "1", "5", "0", "0"]]
    path = tmp_path / "sass.csv"
    with path.open("w", newline="") as f:
        csv.writer(f).writerows(rows)
    blocks(str(path))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "kernel 0 (k): 100 stall samples"
    assert out[1].startswith("  [0-1] 2 instructions x 64: 80.0% of samples; stalls {'long_sb': 80, 'barrier': 0}")
    assert out[2].startswith("  [2-3] 2 instructions x 32: 20.0% of samples; stalls {'barrier': 20, 'long_sb': 0}")


def test_number_scheduling_groups_gives_each_marked_call_its_id_and_private_callees():
    """stream_overlap_probe's rewrite of a lowered module: each call jax.experimental.scheduling_groups marked gets
    an integer _scheduling_group_id, on itself and on every op of a private copy of its callees (a jitted helper
    called from both groups is shared in the lowered module), and the module still compiles to the same values."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.scheduling_groups import scheduling_group

    from bench.stream_overlap_probe import number_scheduling_groups

    @jax.jit
    def helper(a):
        return jnp.cos(a) * 2

    def f(a, b):
        x1, y1 = scheduling_group("first")(lambda a, b: (helper(a), a @ b))(a, b)
        x2, y2 = scheduling_group("second")(lambda a, b: (helper(b), b @ a))(x1, y1)
        return x2 + y2

    a = jnp.arange(64.0).reshape(8, 8) / 64
    b = jnp.eye(8) + a.T
    lowered = jax.jit(f).lower(a, b)
    module = lowered.compiler_ir("stablehlo")
    assert number_scheduling_groups(module) == 2
    text = str(module)
    assert 'scheduling_group = "first"' in text and 'scheduling_group = "second"' in text
    for gid in (1, 2):
        assert text.count(f'@helper_group{gid}_') == 2          # the copy's definition and its one call
        assert f'stablehlo.cosine %arg0 {{mhlo.frontend_attributes = {{_scheduling_group_id = "{gid}"}}}}' in text
    compiled = lowered.compile()
    assert '_scheduling_group_id="1"' in compiled.as_text() and '_scheduling_group_id="2"' in compiled.as_text()
    np.testing.assert_allclose(np.asarray(compiled(a, b)), np.asarray(jax.jit(f)(a, b)), rtol=1e-6)


def test_schedule_sim_replays_the_scheduler_and_fits_its_own_log():
    """bench/schedule_sim.py: one request's chunks and decode steps, exactly; max_num_seqs 1 runs two requests one
    after the other; and the cost model fitted to a log the replay wrote is the model that wrote it."""
    from bench.schedule_sim import CostModel, fit, simulate

    model = CostModel(base_ms=0.3, per_ctx_ms=0.07, weights_ms=5.5, per_token_ms=0.025)
    steps: list = []
    r = simulate([10], [5], model, max_num_seqs=4, max_num_batched_tokens=4, record=steps)
    assert [s[1] for s in steps] == [4, 4, 2, 1, 1, 1, 1] and [s[3] for s in steps] == [4, 8, 10, 11, 12, 13, 14]
    assert (r.steps, r.output_tokens) == (7, 5)
    assert r.ttft_median_s == pytest.approx(sum(s[0] for s in steps[:3]))
    assert steps[0][0] == pytest.approx((0.3 + 0.07 * 4 / 1000 + 5.5) / 1000)
    assert simulate([3, 3], [2, 2], model, 1, 100).steps == 4 and simulate([3, 3], [2, 2], model, 2, 100).steps == 2

    rng = np.random.default_rng(0)
    log: list = []
    simulate(list(rng.integers(20, 400, 600)), list(rng.integers(1, 900, 600)), model, 1024, 16384, record=log)
    got = fit(np.asarray(log))
    assert got.weights_ms == pytest.approx(5.5, abs=0.06) and got.per_token_ms == pytest.approx(0.025, abs=6e-4)
    assert got.per_ctx_ms == pytest.approx(0.07, rel=0.02) and got.base_ms == pytest.approx(0.3, abs=0.05)


def test_fp8_kv_ablation_rounds_each_head_to_e4m3_at_its_own_power_of_two():
    """bench/fp8_kv_ablation.py's rounding: each [token, head] scaled by the power of two that puts its largest
    |value| in [224, 448), rounded to e4m3 and scaled back; e4m3 values times a power of two come back unchanged,
    a zero head stays zero, and the error is at most e4m3's half step."""
    import jax.numpy as jnp
    import ml_dtypes

    from bench.fp8_kv_ablation import e4m3_rounded

    exact = np.array([448.0, -1.5, 0.0625, 3.25], np.float32) * 2.0 ** -20       # e4m3 values x 2**-20
    rng = np.random.default_rng(0)
    x = np.stack([np.stack([exact, np.zeros(4, np.float32)]), rng.standard_normal((2, 4)).astype(np.float32) * 30])
    got = np.asarray(e4m3_rounded(jnp.asarray(x)))
    np.testing.assert_array_equal(got[0], x[0])
    scale = 2.0 ** np.ceil(np.log2(np.abs(x[1]).max(-1, keepdims=True) / 448))
    np.testing.assert_array_equal(got[1], (x[1] / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale)
    assert np.all(np.abs(got[1] - x[1]) <= np.abs(x[1]) * 2.0 ** -4 + scale * 2.0 ** -10)
    assert e4m3_rounded(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.bfloat16


def test_compile_profile_records_each_compile_and_counts_programs_shared_by_modules(tmp_path, capsys):
    """bench/compile_profile.py as a pytest plugin: two modules compile one program (equal digests) and one
    compiles another of its own; the summary counts compiles, distinct programs and each module's own."""
    import os
    import subprocess
    import sys
    from bench import compile_profile
    from bench.common import REPO_ROOT
    run = "    jax.jit(lambda x: x {}).block_until_ready()\n"
    body = "import jax, numpy as np\n\ndef test_it():\n" + run.format("* 3)(np.ones(5)")
    (tmp_path / "test_a.py").write_text(body)
    (tmp_path / "test_b.py").write_text(body + run.format("- 1)(np.ones(7)"))
    out = tmp_path / "profile"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                        "-p", "bench.compile_profile", "--compile-profile", str(out), "test_a.py", "test_b.py"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**{k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"},   # (its file's name)
                            "PYTHONPATH": str(REPO_ROOT)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    records = [json.loads(line) for line in (out / "main.jsonl").read_text().splitlines()]
    assert [x["test"] for x in records] == ["test_a.py::test_it", "test_b.py::test_it", "test_b.py::test_it"]
    assert {x["name"] for x in records} == {"jit__lambda"} and not any(x["hit"] for x in records)
    assert records[0]["digest"] == records[1]["digest"] != records[2]["digest"]
    compile_profile.summarize(str(out))
    table = capsys.readouterr().out
    assert "| test_b.py | " in table and "| test_a.py | " in table
    own = {line.split(" | ")[0].strip("| "): int(line.rstrip(" |").split(" | ")[-1])
           for line in table.splitlines() if line.startswith("| test_")}
    assert own == {"test_a.py": 0, "test_b.py": 1} and "3 compiles, 2 distinct programs" in table
