"""bench/ab_compare.py: figures read from result files, ratios and verdicts at 3%, the report, and one part's
orchestration with the runs faked (the real runs: `bash bench/ab_compare.sh --smoke qwen` on the CPU)."""
import json

import pytest

from bench import ab_compare as ab
from bench.common import write_result


def run(rev, rnd=1, **figures):
    return {"rev": rev, "round": rnd, "status": "ok", "seconds": 100.0, "figures": figures, "commands": [f"cmd {rev}"]}


def rows_by_figure(rows):
    return {r["figure"]: r for r in rows}


def test_offline_ratio_and_verdicts():
    runs = [run("base", 1, output_tok_s=100.0, output_tokens=5, bad_requests=0),
            run("new", 1, output_tok_s=97.5, output_tokens=5, bad_requests=0),
            run("base", 2, output_tok_s=102.0, output_tokens=5, bad_requests=0),
            run("new", 2, output_tok_s=98.5, output_tokens=5, bad_requests=0)]
    rows = rows_by_figure(ab.compare("qwen", runs))
    assert rows["output_tok_s"]["base"] == pytest.approx(101.0)
    assert rows["output_tok_s"]["new/base"] == pytest.approx(98.0 / 101.0)
    assert rows["output_tok_s"]["verdict"] == "pass"          # 2.97% slower
    assert rows["outputs"]["verdict"] == "pass"
    runs[1]["figures"]["output_tok_s"] = 93.0                  # mean 95.75: 5.2% slower
    assert rows_by_figure(ab.compare("qwen", runs))["output_tok_s"]["verdict"] == "FAIL"


def test_tpot_is_judged_lower_is_better_and_missing_figures():
    base = dict(c1_output_tok_s=400.0, c1_median_tpot_ms=2.50, c10_output_tok_s=3000.0, c10_median_tpot_ms=3.0,
                c1_output_tokens=30000, c10_output_tokens=30000, c1_bad_requests=0, c10_bad_requests=0)
    new = dict(base, c1_median_tpot_ms=2.60, c10_median_tpot_ms=2.0)   # +4%: FAIL; faster: pass
    del new["c10_output_tok_s"]
    rows = rows_by_figure(ab.compare("serve", [run("base", **base), run("new", **new)]))
    assert rows["c1_median_tpot_ms"]["verdict"] == "FAIL"
    assert rows["c10_median_tpot_ms"]["verdict"] == "pass"
    assert rows["c1_output_tok_s"]["verdict"] == "pass"
    assert rows["c10_output_tok_s"]["verdict"] == "missing"
    assert ab.overall(list(rows.values())) == "FAIL"


def test_outputs_differ_or_a_revision_missing():
    rows = rows_by_figure(ab.compare("llama", [run("base", output_tok_s=1.0, output_tokens=10, bad_requests=0),
                                               run("new", output_tok_s=1.0, output_tokens=11, bad_requests=0)]))
    assert rows["outputs"]["verdict"] == "FAIL" and "[10, 11]" in rows["outputs"]["note"]
    rows = ab.compare("llama", [run("base", output_tok_s=1.0, output_tokens=10, bad_requests=0)])
    assert {r["verdict"] for r in rows} == {"missing"} and ab.overall(rows) == "INCOMPLETE"


def test_read_figures_from_result_files(tmp_path):
    write_result("throughput-qwen2-0.5b-sharegpt", {"output_tokens_per_second": 48000.0, "engine_startup_s": 22.5,
                                                    "total_output_tokens": 191578, "num_wrong_output_len": 0},
                 meta={}, results_dir=tmp_path / "off")
    assert ab.read_figures(tmp_path / "off", None, serve=False) == {
        "output_tok_s": 48000.0, "init_s": 22.5, "output_tokens": 191578, "bad_requests": 0}
    # --step-log: the run's step log adds its mixed and decode seconds (2 mixed steps: more tokens than requests)
    (tmp_path / "off" / ab.STEP_LOG).write_text("# seconds,tokens,requests,context_tokens,gc_seconds,gc_gen2_seconds\n"
                                                "0.4,16384,86,16384,0,0\n0.3,16384,160,32768,0,0\n"
                                                "0.01,160,160,33000,0,0\n0.02,150,150,34000,0,0\n")
    figs = ab.read_figures(tmp_path / "off", None, serve=False)
    assert figs["mixed_s"] == pytest.approx(0.7) and figs["decode_s"] == pytest.approx(0.03)
    assert figs["median_mixed_step_ms"] == pytest.approx(350.0) and figs["output_tok_s"] == 48000.0
    for c, skipped in ((1, 0), (10, 3)):
        write_result(f"serve-openqa-c{c}", {"output_throughput": 400.0 * c, "median_tpot_ms": 2.5, "failed": 0,
                                            "skipped": skipped, "total_output_tokens": 30000}, meta={},
                     results_dir=tmp_path / "srv")
    log = tmp_path / "srv.log"
    log.write_text("INFO ... Serving qwen on http://0.0.0.0:8011 (engine ready in 31.4 s)\n")
    figs = ab.read_figures(tmp_path / "srv", log, serve=True)
    assert figs["c1_output_tok_s"] == 400.0 and figs["c1_median_tpot_ms"] == 2.5 and figs["init_s"] == 31.4
    assert "c10_output_tok_s" not in figs and "c10_output_tokens" not in figs and figs["c10_skipped"] == 3


@pytest.mark.parametrize("run_s, revs", [(1.0, ["base", "new", "base", "new"]), (200.0, ["base", "new"])])
def test_run_part_alternates_revisions_and_writes_the_report(tmp_path, monkeypatch, run_s, revs):
    """qwen with the runs faked: base, new, base, new where a second round fits the 570 s (runs of 200 s: not);
    each run's command names its revision's own script."""
    clock = [0.0]
    monkeypatch.setattr(ab.time, "perf_counter", lambda: clock[0])
    tree = tmp_path / "base_tree"
    tree.mkdir()
    (tree / "AB_REV").write_text("a" * 40 + "\n")
    monkeypatch.setattr(ab, "BASE_TREE", tree)
    monkeypatch.setattr(ab, "AB_ROOT", tmp_path / "ab")
    monkeypatch.setattr(ab, "git_revision", lambda: "b" * 40 + "-dirty")
    calls = []

    argvs = []

    def fake_run_logged(argv, log, timeout_s, cwd, env):
        argvs.append(argv)
        rev = "base" if str(tree) in argv[1] else "new"
        calls.append((rev, env["JAXPAGED_GIT_REV"], env["PYTHONPATH"].split(":")[0]))
        write_result("throughput-qwen2-0.5b-sharegpt", {
            "output_tokens_per_second": 100.0 if rev == "base" else 99.0, "engine_startup_s": 5.0,
            "total_output_tokens": 7, "num_wrong_output_len": 0}, meta={}, results_dir=env["JAXPAGED_BENCH_RESULTS"])
        with open(log, "a") as f:
            f.write("$ " + " ".join(argv) + "\n")
        clock[0] += run_s
        return 0, run_s

    monkeypatch.setattr(ab.suite, "run_logged", fake_run_logged)
    ab.run_part("qwen", rounds=1, deadline_s=570, smoke=False, command="c", step_log=True)   # --step-log
    assert all(argv[-2:] == ["--step-log", str(tmp_path / "ab" / "results" / f"qwen-{rev}-r1" / ab.STEP_LOG)]
               for rev, argv in zip(["base", "new"], argvs[-2:]))
    calls.clear()
    saved = []
    report = ab.run_part("qwen", rounds=2, deadline_s=570, smoke=False, command="bash bench/ab_compare.sh qwen",
                         save=lambda r: saved.append(len(r["runs"])))
    assert [c[0] for c in calls] == revs and saved == list(range(1, len(revs) + 1))
    assert calls[0][1] == "a" * 40 and calls[1][1].endswith("-dirty")
    assert calls[0][2].endswith("ab/base/site") and calls[1][2].endswith("ab/new/site")
    rows = rows_by_figure(report["comparison"])
    assert rows["output_tok_s"]["new/base"] == pytest.approx(0.99) and ab.overall(report["comparison"]) == "PASS"
    path = ab.write([report], "ab-qwen", tmp_path / "out")
    assert json.loads(path.read_text())["revisions"]["base"] == "a" * 40
    md = path.with_suffix(".md").read_text()
    assert "**verdict: PASS**" in md and "| qwen | output_tok_s | 100.00 | 99.00 | 0.9900 | pass |" in md
    assert f"{tree}/bench/throughput.py" in md and ab.short(report["revisions"]["new"]) == "bbbbbbb-dirty"
