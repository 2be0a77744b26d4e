"""bench/throughput.py and bench/latency.py end to end through the real jaxpaged.LLM (tiny model, CPU)."""
import json

import numpy as np
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    import bench.common
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    return tmp_path


def test_throughput_tiny_llama(results_dir, capsys):
    pytest.importorskip("jaxpaged.llm")
    from bench import throughput
    m = throughput.main(["--model", "tiny-llama", "--dataset", "random", "--input-len", "16", "--output-len", "4",
                         "--num-prompts", "3", "--max-model-len", "256", "--no-tqdm", "--result-name", "t",
                         "--step-log", str(results_dir / "steps.csv")])
    out = capsys.readouterr().out
    steps = np.loadtxt(results_dir / "steps.csv", delimiter=",", ndmin=2)   # seconds, tokens, requests, context
    assert steps.shape[1] == 6 and (steps[:, 0] > 0).all() and steps[:, 1].sum() == 48 + 12 - 3
    assert (results_dir / "steps.png").stat().st_size > 0
    assert "Throughput: " in out and " requests/s, " in out and " output tokens/s" in out
    assert m["total_prompt_tokens"] == 48 and m["total_output_tokens"] == 12 and m["num_wrong_output_len"] == 0
    data = json.loads((results_dir / "t.json").read_text())
    assert data["meta"]["jax_version"] and data["meta"]["device"] and "bench/throughput.py" in data["meta"]["command"]


def test_latency_tiny_llama(results_dir):
    pytest.importorskip("jaxpaged.llm")
    from bench import latency
    m = latency.main(["--model", "tiny-llama", "--batch-size", "2", "--input-len", "8", "--output-len", "3",
                      "--num-iters-warmup", "1", "--num-iters", "2", "--max-model-len", "256", "--decode-step",
                      "--result-name", "l"])
    assert len(m["latencies"]) == 2 and m["avg_latency"] > 0 and "decode_step_ms" in m and "bandwidth_floor_ms" in m
    assert (results_dir / "l.md").exists()
