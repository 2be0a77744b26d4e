"""Runtime properties of the engine: nothing recompiles after warm-up, and a deleted LLM frees its device
memory (no runner is kept alive by JAX's caches)."""
import gc

import jax
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from conftest import tiny_llama_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, "tiny_llama_rt")


class CompileCounter:
    """Counts XLA backend compilations through jax.monitoring's compile-duration events."""

    def __init__(self):
        self.count = 0
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        if self.active and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


@pytest.mark.parametrize("layer_dispatch", ["scan", "per_layer"])
def test_zero_recompilations_after_warmup(model_dir, layer_dispatch):
    counter = CompileCounter()
    counter.active = True
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
              max_num_batched_tokens=64, max_num_seqs=8, compile_buckets=True, layer_dispatch=layer_dispatch)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, int(n)).tolist() for n in rng.integers(1, 120, 20)]
    params = [SamplingParams(temperature=float(t), max_tokens=int(m), ignore_eos=True, seed=int(i))
              for i, (t, m) in enumerate(zip(rng.choice([0.0, 0.7, 1.0], 20), rng.integers(1, 40, 20)))]
    assert counter.count > 0          # the counter sees the warm-up's compilations
    counter.count = 0
    outs = llm.generate(prompts, params, use_tqdm=False)
    counter.active = False
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert counter.count == 0, f"{counter.count} compilations after warm-up"


def test_deleted_llm_frees_device_memory(model_dir):
    gc.collect()
    before = sum(x.nbytes for x in jax.live_arrays())
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, num_gpu_blocks_override=200)
    llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert sum(x.nbytes for x in jax.live_arrays()) > before
    del llm
    gc.collect()
    assert sum(x.nbytes for x in jax.live_arrays()) == before


def test_no_state_left_behind(model_dir):
    """After a mix of finished, stopped, aborted, parallel-sampled and refused requests, every per-request
    table in the engine is empty and every block is back in the pool (nothing leaks per request)."""
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    engine = llm.llm_engine
    rng = np.random.default_rng(3)
    for i in range(6):
        engine.add_request(f"r{i}", rng.integers(100, 40000, 20 + i).tolist(),
                           SamplingParams(max_tokens=12, ignore_eos=True, n=1 + i % 3, seed=i,
                                          stop_token_ids=[int(rng.integers(100, 40000))]))
    with pytest.raises(ValueError):
        engine.add_request("too-long", [5] * 300, SamplingParams(max_tokens=4))
    for _ in range(3):
        engine.step()
    engine.abort_request(["r1", "r4"])
    while engine.has_unfinished_requests():
        engine.step()
    kv = engine.kv_manager
    assert kv.pool.num_free_blocks == kv.pool.num_blocks - 1
    assert not kv.req_to_blocks and not kv.num_cached_blocks and not kv.table_rows and not kv.swapped
    assert not kv.block_table.any()          # freed rows are zeroed
    assert not engine.scheduler.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.output_processor.parents and not engine.output_processor.child_to_parent
    assert engine._inflight is None
    assert not engine.runner._sampling_slots and not engine.runner._sampling_owner   # no Request kept alive


def test_out_of_vocab_logit_bias_is_refused(model_dir):
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, num_gpu_blocks_override=32)
    with pytest.raises(ValueError, match="out-of-vocab"):
        llm.generate(["Hi"], SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}), use_tqdm=False)
    (out,) = llm.generate(["Hi"], SamplingParams(max_tokens=2, logit_bias={5: 1.0}), use_tqdm=False)
    assert len(out.outputs[0].token_ids) >= 1


def test_logprobs_above_max_logprobs_are_refused(model_dir):
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, num_gpu_blocks_override=32, max_logprobs=5)
    with pytest.raises(ValueError, match="greater than max allowed: 5"):
        llm.generate(["Hi"], SamplingParams(max_tokens=2, logprobs=6), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt logprobs of 9"):
        llm.generate(["Hi"], SamplingParams(max_tokens=2, prompt_logprobs=9), use_tqdm=False)
    (out,) = llm.generate(["Hi"], SamplingParams(max_tokens=2, logprobs=5), use_tqdm=False)
    assert all(len(e) >= 5 for e in out.outputs[0].logprobs)


def test_waste_average_is_exported(model_dir):
    """The run-weighted KV waste: only each sequence's last block is partly empty, so with block size 16
    and prompts of 100-300 tokens it stays small."""
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, num_gpu_blocks_override=400)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(100, 40000, int(n)).tolist() for n in rng.integers(100, 200, 12)]
    llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    stats = llm.llm_engine.stats
    assert stats.waste_slots_allocated > 0
    assert 0.0 < stats.kv_cache_waste_avg < 0.06
