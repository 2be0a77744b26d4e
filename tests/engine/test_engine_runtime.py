"""Runtime properties of the engine: nothing recompiles after warm-up, and a deleted LLM frees its device
memory (no runner is kept alive by JAX's caches)."""
import collections
import gc
import threading

import jax
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from conftest import tiny_llama_dir

pytestmark = pytest.mark.cost(175)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, "tiny_llama_rt")


# Every bucket compiled at start-up, on a pool and batch limits small enough for a few seconds of warm-up: five
# buckets (decodes of 1, 2 and 4 requests; mixed steps of 16 and 32 tokens), each of the tests below building
# one to three such engines.
COMPILED = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=32,
                max_num_seqs=4, compile_buckets=True)


@pytest.fixture
def exec_cache_root(tmp_path, monkeypatch, fresh_xla_cache):
    """The executable cache on, under a fresh root (nothing from earlier runs), beside a fresh XLA cache
    (fresh_xla_cache); yields that root. The CPU's resolved configuration keeps it off (XLA:CPU cannot run some
    deserialized programs): here resolve() answers with it on, as on a GPU."""
    import dataclasses

    from jaxpaged import envs
    from jaxpaged.engine import core as llm_engine
    monkeypatch.setattr(envs, "JAXPAGED_CACHE_ROOT", tmp_path)
    real = llm_engine.resolve
    monkeypatch.setattr(llm_engine, "resolve", lambda *a, **k: dataclasses.replace(
        real(*a, **k), executable_cache=True))
    return tmp_path


class CompileCounter:
    """Counts XLA backend compilations through jax.monitoring's compile-duration events, in all and by the
    compiled function's name ("jit(_pre)")."""

    def __init__(self):
        self.count = 0
        self.names: collections.Counter = collections.Counter()
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        if self.active and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1
            self.names[kwargs.get("fun_name")] += 1


@pytest.mark.parametrize("layer_dispatch", ["scan", "per_layer", "unrolled"])
def test_zero_recompilations_after_warmup(model_dir, layer_dispatch, tmp_path, tmp_path_factory, monkeypatch):
    from jaxpaged import envs
    monkeypatch.setattr(envs, "JAXPAGED_CACHE_ROOT", tmp_path)     # no executables from earlier runs
    if layer_dispatch == "unrolled":     # 2 layers per_layer is one group, the same program: JAX's jit cache
        model_dir = tiny_llama_dir(tmp_path_factory, "tiny_llama_rt3", num_hidden_layers=3)   # would hold it
    # The step functions are jitted at module level, so an engine of the same shapes built earlier in this
    # process (another test, in any order) would leave this warm-up nothing to compile: start from empty caches.
    jax.clear_caches()
    counter = CompileCounter()
    counter.active = True
    llm = LLM(model=model_dir, **COMPILED, layer_dispatch=layer_dispatch)
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


@pytest.mark.parametrize("layer_dispatch", ["scan", "unrolled"])
def test_warm_start_loads_executables_and_gives_the_same_tokens(model_dir, exec_cache_root, layer_dispatch):
    """A second engine with the same fingerprint loads every bucket's compiled step from disk (no trace,
    no compile) and generates the same tokens; a different pool shape does not reuse them. Both
    single-program steps: the layer scan and the unrolled layers."""
    kw = dict(model=model_dir, **COMPILED, layer_dispatch=layer_dispatch)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(100, 40000, int(n)).tolist() for n in (3, 40, 90, 7)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    compile_threads = []
    real_compile = jax.stages.Lowered.compile

    def compile_(self, *a, **k):
        compile_threads.append(threading.current_thread().name)
        return real_compile(self, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax.stages.Lowered, "compile", compile_)
        cold = LLM(**kw)
    n = len(cold.llm_engine.buckets.all_buckets())
    # every bucket's step compiled by XLA on the start-up threads (step.STARTUP_THREADS)
    assert sum(t.startswith("jaxpaged-compile") for t in compile_threads) == n
    assert cold.llm_engine.runner.exec_cache.misses == n and cold.llm_engine.runner.exec_cache.hits == 0
    want = [o.outputs[0].token_ids for o in cold.generate(prompts, sp, use_tqdm=False)]
    del cold
    counter = CompileCounter()
    counter.active = True
    from jaxpaged.runner.exec_cache import ExecutableCache
    threads, real_load_file = [], ExecutableCache._load_file

    def load_file(self, key):
        threads.append(threading.current_thread().name)
        return real_load_file(self, key)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ExecutableCache, "_load_file", load_file)
        warm = LLM(**kw)
    counter.active = False
    assert warm.llm_engine.runner.exec_cache.hits == n
    # unrolled layers' packed inputs on the 256-byte grid (their Mosaic GPU calls get slices of them)
    assert warm.llm_engine.run.input_align == (64 if layer_dispatch == "unrolled" else 1)
    # read ahead on the loader threads (step.STARTUP_THREADS), each file once, each taken by its bucket
    assert len(threads) == n and all(t.startswith("exec-cache") for t in threads)
    assert not warm.llm_engine.runner.exec_cache._prefetched
    assert counter.count < n          # the step itself is not compiled again (small helpers may be)
    assert [o.outputs[0].token_ids for o in warm.generate(prompts, sp, use_tqdm=False)] == want
    other = LLM(**{**kw, "num_gpu_blocks_override": 80})
    assert other.llm_engine.runner.exec_cache.hits == 0


def test_per_layer_programs_compile_in_parallel_once_and_load_warm(tmp_path_factory, exec_cache_root):
    """Per-layer dispatch over 5 layers in groups of 4 and 1: each bucket's step is four programs (the
    embedding, a 4-layer and a 1-layer group, the head). A cold start compiles each distinct program once,
    on the start-up threads (buckets of one input layout share their embedding and head), and the steps
    run those executables. A second start over the same cache loads every program and compiles none, then
    or while generating. A shared program that fails to run falls back: its bucket's step is traced, the
    next bucket that runs it compiles it again. All give the tokens of the step through jit."""
    from jaxpaged.runner.buckets import Bucket
    from jaxpaged.runner.exec_cache import ExecutableCache
    from jaxpaged.runner.sampler import SamplerFlags
    model = tiny_llama_dir(tmp_path_factory, "tiny_llama_rt5", num_hidden_layers=5)
    # max_num_seqs = max_num_batched_tokens = 4: decode buckets of 1 and 4 rows (2 and 3 pad to 4), and a mixed
    # one of 4 tokens and 4 rows, whose input layout the 4-row decode bucket shares
    kw = dict(model=model, **COMPILED, layer_dispatch="per_layer")
    kw.update(max_num_batched_tokens=4, max_num_seqs=4)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(100, 40000, int(n)).tolist() for n in (3, 21, 9)]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    compile_threads = []
    real_compile = jax.stages.Lowered.compile

    def compile_(self, *a, **k):
        compile_threads.append(threading.current_thread().name)
        return real_compile(self, *a, **k)

    counter = CompileCounter()
    counter.active = True
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax.stages.Lowered, "compile", compile_)
        cold = LLM(**kw)
    assert [len(g) for g, *_ in cold.llm_engine.runner.programs.layer_groups] == [4, 1]
    buckets = cold.llm_engine.buckets.all_buckets()
    layouts = {(b.padded_num_tokens, b.padded_num_reqs) for b in buckets}
    assert len(buckets) == 3 and len(layouts) == 2
    programs = {"jit(_pre)": len(layouts), "jit(_layers)": 2 * len(buckets), "jit(_post)": len(layouts)}
    n = sum(programs.values())
    assert {name: counter.names[name] for name in programs} == programs
    assert len(compile_threads) == n and all(t.startswith("jaxpaged-compile") for t in compile_threads)
    cache = cold.llm_engine.runner.exec_cache
    assert cache.misses == n and cache.hits == 0 and len(list(exec_cache_root.rglob("*.bin"))) == n
    counter.names.clear()
    want = [o.outputs[0].token_ids for o in cold.generate(prompts, sp, use_tqdm=False)]
    assert not counter.names.keys() & programs.keys()        # the steps ran the compiled executables
    step, decode4 = cold.llm_engine.runner.programs, Bucket(4, 4, True)
    shared = step._program_keys(step._layout(*step.dummy_inputs(decode4)), step.options(decode4, 1), SamplerFlags())[0]
    assert shared[0] == "pre"
    del cold

    counter.count = 0
    warm = LLM(**kw)
    assert warm.llm_engine.runner.exec_cache.hits == n and warm.llm_engine.runner.exec_cache.misses == 0
    assert [o.outputs[0].token_ids for o in warm.generate(prompts, sp, use_tqdm=False)] == want
    assert counter.count == 0, counter.names
    del warm
    counter.active = False

    real_load = ExecutableCache.load

    def broken(*args):
        raise jax.errors.JaxRuntimeError("NOT_FOUND: Function wrapped_convert not found")

    def load(self, key):        # the embedding of the 4-row layout, in two buckets' steps, fails to run
        compiled = real_load(self, key)
        return broken if compiled is not None and key == shared else compiled

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ExecutableCache, "load", load)
        fallback = LLM(**kw)
    # the failed bucket's four programs are dropped, the mixed bucket compiles its embedding and head again
    assert fallback.llm_engine.runner.exec_cache.hits == n - 4
    assert len(list(exec_cache_root.rglob("*.bin"))) == n - 2
    assert [o.outputs[0].token_ids for o in fallback.generate(prompts, sp, use_tqdm=False)] == want


def test_cached_executable_that_fails_to_run_falls_back(model_dir, exec_cache_root, monkeypatch):
    """A loaded executable that fails in warm-up is dropped from disk and the step compiled as usual.
    The failing executable is a stand-in that raises XLA's runtime error, as qwen2-0.5b's deserialized
    bf16 programs do on XLA:CPU ("Function wrapped_convert not found")."""
    from jaxpaged.runner.exec_cache import ExecutableCache
    kw = dict(model=model_dir, **COMPILED)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = LLM(**kw).generate([[5, 6, 7, 8, 9]], sp, use_tqdm=False)[0].outputs[0].token_ids
    files = sorted(p.name for p in exec_cache_root.rglob("*.bin"))
    real_load = ExecutableCache.load

    def broken(*args):
        raise jax.errors.JaxRuntimeError("NOT_FOUND: Function wrapped_convert not found")

    def load_broken(self, key):
        return broken if real_load(self, key) is not None else None

    monkeypatch.setattr(ExecutableCache, "load", load_broken)
    again = LLM(**kw)
    assert again.generate([[5, 6, 7, 8, 9]], sp, use_tqdm=False)[0].outputs[0].token_ids == want
    cache = again.llm_engine.runner.exec_cache
    assert cache.hits == 0 and cache.misses == len(files) == len(again.llm_engine.buckets.all_buckets())
    assert not list(exec_cache_root.rglob("*.bin"))    # dropped from disk (and not stored again this run)


def test_a_step_out_of_memory_at_start_up_says_which_and_what_to_lower(model_dir, monkeypatch):
    """A step that runs out of device memory in warm-up fails the start-up with its bucket and the flags that make
    room, not XLA's bare error. Mocked: the step raises XLA's out-of-memory error, which the CPU's memory does not
    give a tiny model here (on the H100 a 4-bit llama3-8b's 16,384-token step did, before EXPAND_IN_TURN)."""
    from jaxpaged.runner.step import StepPrograms

    def out_of_memory(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.09GiB")

    monkeypatch.setattr(StepPrograms, "_run", out_of_memory)
    with pytest.raises(RuntimeError, match=r"The step of \d+ tokens, \d+ rows, 1 step ran out of device memory "
                                           r"at start-up.*--gpu-memory-utilization.*--max-num-batched-tokens"):
        LLM(model=model_dir, **COMPILED)


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
    assert not kv.req_to_blocks and not kv.num_cached_blocks and not kv.replaced and not kv.swapped
    batch = engine.runner.batch          # the runner's own per-request state: empty, freed rows zeroed
    assert not batch.rows and not batch.block_table.any() and not any(batch.token_ids)
    assert not engine.scheduler.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.output_processor.parents and not engine.output_processor._samples
    assert engine.core._inflight is None
    assert not any(batch.params) and len(batch._free_rows) == len(batch.num_blocks) - 1   # every row back


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


def test_core_stats_carry_device_memory_in_use(model_dir, monkeypatch):
    """CoreStats.device_memory_bytes (/metrics' jaxpaged:device_memory_used_bytes): the device allocator's
    bytes_in_use, 0 on the CPU (it keeps no count), read at most once per DEVICE_MEMORY_PERIOD_S."""
    import time
    from types import SimpleNamespace

    from jaxpaged.engine import core as core_mod
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, num_gpu_blocks_override=32)
    core = llm.llm_engine.core
    assert core.core_stats().device_memory_bytes == 0
    now = [time.monotonic() + core_mod.DEVICE_MEMORY_PERIOD_S]
    monkeypatch.setattr(core_mod.time, "monotonic", lambda: now[0])
    for in_use, elapsed, seen in ((123, 0.0, 123), (456, 0.5, 123), (456, 1.0, 456)):
        monkeypatch.setattr(core.runner, "_device", SimpleNamespace(memory_stats=lambda b=in_use: {"bytes_in_use": b}))
        now[0] += elapsed * core_mod.DEVICE_MEMORY_PERIOD_S
        assert core.core_stats().device_memory_bytes == seen


# One request's sampling parameters per sampler variant (runner/sampler.py SamplerFlags); seeded, so the
# tokens are the same on any path. Not prompt logprobs: they read every token's hidden states, which a step
# does not hand out, and compile their own step on first use.
VARIANTS = {"top-k/p": dict(temperature=0.8, top_p=0.9, top_k=20, seed=5),
            "penalties": dict(temperature=0.8, presence_penalty=0.5, repetition_penalty=1.2, seed=6),
            "logit bias": dict(temperature=0.0, logit_bias={7: 8.0, 11: -3.0}),
            "logprobs": dict(temperature=0.7, logprobs=3, seed=7)}
STEP_PROGRAMS = ("packed_step", "whole_step", "_layers", "_pre", "_post")


# Under the scan every variant; under the other dispatches one whose inputs keep the plain layout (top-k/p) and
# one of each other kind: inputs of their own layout (penalties' histories), one step a program (logprobs).
@pytest.mark.parametrize("layer_dispatch,steps,variants", [
    ("scan", 1, tuple(VARIANTS)), ("per_layer", 1, ("top-k/p", "penalties")), ("unrolled", 4, ("top-k/p", "logprobs"))],
    ids=["scan-1", "per_layer-1", "unrolled-4"])
def test_a_new_sampler_variant_never_compiles_the_model_in_the_loop(model_dir, layer_dispatch, steps, variants,
                                                                    tmp_path, monkeypatch):
    """After warm-up (the default sampler variant), each variant's first batch runs the default step and
    then only the head and that variant's sampler (layerwise.resample): the engine's thread compiles no
    step program. The variant's own step compiles on the background thread meanwhile; once it is there the
    same requests run on it with no compile at all, and give the same tokens and logprobs. Under unrolled
    layers with 4 steps a program, top-k/p decodes are multi-step batches: first run one step at a time,
    then on the variant's own multi-step program."""
    from jaxpaged import envs
    monkeypatch.setattr(envs, "JAXPAGED_CACHE_ROOT", tmp_path)
    jax.clear_caches()
    # no prefix caching: the second run of the same prompts must schedule the same batches
    llm = LLM(model=model_dir, **COMPILED, layer_dispatch=layer_dispatch, num_scheduler_steps=steps,
              enable_prefix_caching=False)
    programs = llm.llm_engine.runner.programs
    one_by_one = []
    real_one_by_one = programs._steps_one_by_one
    monkeypatch.setattr(programs, "_steps_one_by_one", lambda *a: one_by_one.append(a[-2].num_steps) or
                        real_one_by_one(*a))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(100, 40000, int(n)).tolist() for n in (5, 30, 70)]
    compiled_on: collections.Counter = collections.Counter()

    def on_event(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled_on[threading.current_thread().name, kwargs.get("fun_name")] += 1

    jax.monitoring.register_event_duration_secs_listener(on_event)

    def run(params):
        """(each request's tokens, the ids of every logprobs entry), every logprob value in that order."""
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True, **params), use_tqdm=False)
        entries = [e for o in outs for e in [*(o.prompt_logprobs or []), *(o.outputs[0].logprobs or [])] if e]
        return ([o.outputs[0].token_ids for o in outs], [list(e) for e in entries],
                np.array([lp.logprob for e in entries for lp in e.values()]))

    try:
        for name in variants:
            params = VARIANTS[name]
            compiled_on.clear()
            first = run(params)
            main = [fn for (thread, fn), _ in compiled_on.items() if thread == threading.main_thread().name]
            assert not [fn for fn in main if any(p in str(fn) for p in STEP_PROGRAMS)], (name, main)
            assert any("resample" in str(fn) for fn in main), (name, main)
            if name == "top-k/p":           # the only variant here that multi-step batches take
                assert one_by_one and set(one_by_one) == {steps} if steps > 1 else not one_by_one
            programs.wait_for_background_compiles()
            assert any(thread == "jaxpaged-variant-compile" for thread, _ in compiled_on), name
            one_by_one.clear()
            compiled_on.clear()
            again = run(params)
            assert not compiled_on and not one_by_one, (name, compiled_on)
            assert again[:2] == first[:2], name
            np.testing.assert_allclose(again[2], first[2], atol=1e-5, err_msg=name)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)


def test_the_common_sampler_variants_compile_nothing_in_the_loop(model_dir, tmp_path, monkeypatch):
    """With RunConfig.warm_sampler_variants (on for GPUs) the head and sampler of top-k/p and of logprobs (the
    sampled token's, and up to 8 top ones) compile for every bucket at start-up (small layers: before the engine
    is ready, no background thread): the first requests of those variants compile nothing at all on the engine's
    thread."""
    import dataclasses

    from jaxpaged import envs
    from jaxpaged.engine import core
    from jaxpaged.runner.step import WARM_SAMPLER_VARIANTS
    monkeypatch.setattr(envs, "JAXPAGED_CACHE_ROOT", tmp_path)
    real = core.resolve
    monkeypatch.setattr(core, "resolve", lambda *a, **k: dataclasses.replace(real(*a, **k), warm_sampler_variants=True))
    jax.clear_caches()
    llm = LLM(model=model_dir, **COMPILED, layer_dispatch="scan")
    programs = llm.llm_engine.runner.programs
    assert not llm.llm_engine.run.variants_in_background and programs._background is None
    # every bucket is a single-step one (one step a program on the CPU)
    assert len(programs._resamplers) == len(llm.llm_engine.buckets.all_buckets()) * len(WARM_SAMPLER_VARIANTS)
    compiled_on: collections.Counter = collections.Counter()

    def on_event(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled_on[threading.current_thread().name, kwargs.get("fun_name")] += 1

    jax.monitoring.register_event_duration_secs_listener(on_event)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(100, 40000, int(n)).tolist() for n in (4, 33, 61)]
    try:
        for params in (dict(temperature=0.8, top_p=0.9, seed=1), dict(temperature=0.0, top_k=5),
                       dict(temperature=0.7, logprobs=3, seed=2), dict(temperature=0.0, logprobs=0)):
            llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True, **params), use_tqdm=False)
            main = [fn for (thread, fn) in compiled_on if thread == threading.main_thread().name]
            assert not main, (params, main)
        programs.wait_for_background_compiles()
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)


@pytest.mark.parametrize("step_autotune", [True, False])
def test_gpu_compiles_autotune_only_the_steps_that_run_says(model_dir, tmp_path, monkeypatch, step_autotune):
    """On GPUs the head-and-sampler programs compiled while serving (layerwise.resample) get
    NO_AUTOTUNE_GPU_COMPILER_OPTIONS (no XLA autotuning, which would time GEMMs on the device running the
    steps); the step programs get XLA's defaults, or the same options where RunConfig.step_autotune is off
    (large layers). No GPU here: the engine's run config is told it is on one, and the options each XLA compile
    is handed are recorded (XLA:CPU then compiles it without them)."""
    import dataclasses

    from jaxpaged import envs
    from jaxpaged.runner import step
    monkeypatch.setattr(envs, "JAXPAGED_CACHE_ROOT", tmp_path)
    jax.clear_caches()
    llm = LLM(model=model_dir, **COMPILED, layer_dispatch="scan")
    programs = llm.llm_engine.runner.programs
    programs.run = dataclasses.replace(programs.run, platform="gpu", step_autotune=step_autotune)
    options: list = []

    class Recording:
        def __init__(self, kind, lowered):
            self.kind, self.lowered = kind, lowered

        def compile(self, compiler_options=None):
            options.append((self.kind, compiler_options))
            return self.lowered.compile()

    real_compile = step.StepPrograms._compile
    monkeypatch.setattr(step.StepPrograms, "_compile", lambda self, key, lowered, compiler_options=None: (
        real_compile(self, key, Recording(key[0], lowered), compiler_options)))
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=3), use_tqdm=False)
    programs.wait_for_background_compiles()
    assert ("resample", step.NO_AUTOTUNE_GPU_COMPILER_OPTIONS) in options
    assert all(o == step.NO_AUTOTUNE_GPU_COMPILER_OPTIONS for kind, o in options if kind == "resample")
    assert any(kind != "resample" for kind, _ in options)       # the variant's own step, in the background
    want = None if step_autotune else step.NO_AUTOTUNE_GPU_COMPILER_OPTIONS
    assert all(o == want for kind, o in options if kind != "resample")


class _Lowered:
    """A lowered program whose compile fails with `errors` in turn, then returns its name."""

    def __init__(self, name, *errors):
        self.name, self.errors, self.calls = name, list(errors), 0

    def compile(self, compiler_options=None):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.name


def test_a_compile_whose_child_process_failed_to_launch_is_tried_again(monkeypatch, caplog):
    """XLA's GPU compile runs ptxas as a child process, whose launch can fail on a busy host ("Failed to launch
    ptxas", once on the H200's host): that compile is tried again, up to COMPILE_ATTEMPTS in all, with a warning;
    any other compile error is the program's and raises at once. (No GPU here: the lowered programs are fakes.)"""
    import types

    from jaxpaged.runner import step
    monkeypatch.setattr(step, "COMPILE_RETRY_S", 0.0)
    programs = types.SimpleNamespace(compile_seconds={}, temp_bytes={}, _variant_cache=None, step_compiler_options=None)
    launch = jax.errors.JaxRuntimeError("INTERNAL: Failed to launch ptxas")
    flaky = _Lowered("compiled", launch, launch)
    with caplog.at_level("WARNING", logger="jaxpaged.runner"):
        assert step.StepPrograms._compile(programs, ("step",), flaky) == "compiled"
    assert flaky.calls == 3 and len(programs.compile_seconds["step"]) == 1
    assert sum("Failed to launch ptxas; trying again" in r.getMessage() for r in caplog.records) == 2
    always = _Lowered("never", *[launch] * step.COMPILE_ATTEMPTS)
    with pytest.raises(jax.errors.JaxRuntimeError, match="Failed to launch"):
        step.StepPrograms._compile(programs, ("step",), always)
    assert always.calls == step.COMPILE_ATTEMPTS
    wrong = _Lowered("never", jax.errors.JaxRuntimeError("INVALID_ARGUMENT: a bad program"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="a bad program"):
        step.StepPrograms._compile(programs, ("step",), wrong)
    assert wrong.calls == 1


def test_a_failed_background_head_keeps_the_others(caplog):
    """The warm-up's head-and-sampler programs compile in the background together: one that fails is logged and
    left out (its variant's first request compiles it, as without the warm-up), and every other one is kept."""
    import types

    from jaxpaged.runner import step
    keys = [("resample", i, f"variant{i}") for i in range(4)]

    def compile_transient(key, lowered):
        if key == keys[1]:
            raise RuntimeError("a compile that failed")
        return lowered.compile()

    programs = types.SimpleNamespace(_variant_cache=None, _resamplers={}, _compile_transient=compile_transient,
                                     run=types.SimpleNamespace(lowering_processes=0),
                                     _head_lowered={k: _Lowered(k[2]) for k in keys})
    with caplog.at_level("INFO", logger="jaxpaged.runner"):
        step.StepPrograms._compile_resamplers(programs, {k: None for k in keys})
    assert programs._resamplers == {k: k[2] for k in keys if k != keys[1]} and not programs._head_lowered
    assert any("of variant1 failed" in r.getMessage() and r.exc_info for r in caplog.records)
    assert any("(3 programs, 1 failed)" in r.getMessage() for r in caplog.records)


def test_programs_the_executable_cache_keeps_are_not_written_to_jaxs_cache_too():
    """With the executable cache on a GPU (StepPrograms._variant_cache), a program compiled by StepPrograms._compile
    is not written to JAX's persistent compilation cache as well (its write serializes the executable again,
    holding the GIL from the engine loop): JAX's minimum compile time for a write is infinite in that compile's
    thread only. Without that cache (the CPU, or the cache off), JAX's setting stands."""
    import types

    from jax._src import config as jax_config

    from jaxpaged.runner import step
    setting = jax_config.persistent_cache_min_compile_time_secs
    before = setting.value

    class Recording:
        def compile(self, compiler_options=None):
            seen = {}
            other = threading.Thread(target=lambda: seen.update(other=setting.value))
            other.start()
            other.join()
            return setting.value, seen["other"]

    with_cache = types.SimpleNamespace(compile_seconds={}, temp_bytes={}, _variant_cache=object(),
                                       step_compiler_options=None)
    assert step.StepPrograms._compile(with_cache, ("step",), Recording()) == (float("inf"), before)
    assert setting.value == before
    without = types.SimpleNamespace(compile_seconds={}, temp_bytes={}, _variant_cache=None, step_compiler_options=None)
    assert step.StepPrograms._compile(without, ("step",), Recording()) == (before, before)
