"""A cold start-up's lowering workers (jaxpaged/runner/lowering_workers.py): real worker processes lower
the step's programs (JAX on the CPU, jax.export), the engine compiles them, and they are the programs the
engine would have lowered itself: the same tokens and logprobs as steps traced through jit. A worker that
fails costs only time: the engine lowers its programs itself."""
import dataclasses
import os
import threading

import numpy as np
import pytest

from conftest import tiny_llama_dir
from jaxpaged import LLM, SamplingParams
from jaxpaged.runner import layerwise, lowering_workers, step
from jaxpaged.runner.program_spec import ProgramSpec
from jaxpaged.runner.step import WARM_SAMPLER_VARIANTS, StepPrograms

pytestmark = pytest.mark.cost(75)

ENGINE = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=16,
              max_num_seqs=4)
SAMPLING = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, "tiny_llama_lw", num_hidden_layers=5)


@pytest.fixture
def with_workers(tmp_path, monkeypatch, fresh_xla_cache):
    """The executable cache on under a fresh root (and a fresh XLA cache: fresh_xla_cache), and two lowering
    workers: what resolve() gives a Hopper GPU. Counts the programs this process lowered itself (ProgramSpec.lower)."""
    from jaxpaged import envs
    from jaxpaged.engine import core
    monkeypatch.setattr(envs, "JAXPAGED_CACHE_ROOT", tmp_path)
    real = core.resolve
    monkeypatch.setattr(core, "resolve", lambda *a, **k: dataclasses.replace(
        real(*a, **k), executable_cache=True, lowering_processes=2))
    lowered_here = []
    real_lower = ProgramSpec.lower
    monkeypatch.setattr(ProgramSpec, "lower", lambda self: lowered_here.append(self) or real_lower(self))
    return lowered_here


@pytest.fixture(scope="module")
def jit_reference(model_dir):
    """{layer_dispatch: generate()'s tokens and logprobs} of the engine that traces its steps through jit (no
    lowering workers, no executable cache: the CPU's defaults), made before any test's fixtures change them."""
    return {dispatch: generate(LLM(model=model_dir, **ENGINE, layer_dispatch=dispatch, compile_buckets=False,
                                   num_scheduler_steps=4 if dispatch == "unrolled" else None))
            for dispatch in ("per_layer", "unrolled")}


def generate(llm):
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": rng.integers(100, 40000, int(n)).tolist()} for n in (3, 21, 9)]
    outs = llm.generate(prompts, SAMPLING, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs])


@pytest.mark.parametrize("layer_dispatch", ["per_layer", "unrolled"])
def test_workers_lower_every_program_the_engine_runs(model_dir, jit_reference, with_workers, layer_dispatch,
                                                     monkeypatch):
    """per_layer (5 layers: groups of 4 and 1, so an embedding, two layer groups and a head per bucket) and
    unrolled (one program per bucket, and per decode bucket its multi-step program): every missing
    program comes from a worker (none lowered here), lands in the executable cache, and the steps give
    exactly the tokens and logprobs of the same engine tracing its steps through jit."""
    want = jit_reference[layer_dispatch]
    llm = LLM(model=model_dir, **ENGINE, layer_dispatch=layer_dispatch, compile_buckets=True,
              num_scheduler_steps=4 if layer_dispatch == "unrolled" else None)
    cache = llm.llm_engine.runner.exec_cache
    startup_misses = cache.misses
    assert llm.llm_engine.run.lowering_processes == 2 and startup_misses > 2
    assert with_workers == []
    # every compile is in the start-up log's per-kind seconds
    seconds = llm.llm_engine.runner.programs.compile_seconds
    assert set(seconds) == ({"pre", "layers", "post"} if layer_dispatch == "per_layer" else {"step"})
    assert sum(map(len, seconds.values())) == startup_misses
    # generate asks for logprobs: a sampler variant, whose own step then compiles on the background thread
    # (runner/step.py), lowered by a worker too; here only the variant's head and sampler (resample) are
    assert generate(llm) == want
    llm.llm_engine.runner.programs.wait_for_background_compiles()
    assert [s.jitted for s in with_workers if s.jitted is not layerwise.resample] == []
    del llm
    # The warm engine: every program loaded, none lowered or compiled again. Its logprobs come from the default
    # step and the variant's head and sampler; its own step is not compiled again in the background (the CPU
    # keeps programs compiled after the warm-up out of the executable cache: some fail to run once deserialized).
    monkeypatch.setattr(StepPrograms, "_compile_later", lambda *a, **k: None)
    warm = LLM(model=model_dir, **ENGINE, layer_dispatch=layer_dispatch, compile_buckets=True,
               num_scheduler_steps=4 if layer_dispatch == "unrolled" else None)
    assert warm.llm_engine.runner.exec_cache.misses == 0 and warm.llm_engine.runner.exec_cache.hits == startup_misses
    with_workers.clear()
    assert generate(warm) == want
    assert [s.jitted for s in with_workers if s.jitted is not layerwise.resample] == []


def test_a_worker_that_fails_costs_only_time(model_dir, jit_reference, with_workers, monkeypatch, caplog):
    """Workers that cannot start (their module missing: each exits at once): the engine lowers every
    program itself, says so in a warning, and runs as without workers."""
    want = jit_reference["per_layer"]
    monkeypatch.setattr(lowering_workers, "WORKER_MODULE", "jaxpaged.runner.no_such_worker")
    # the start-up's programs are what this is about: the logprobs variant runs as the default step and its head
    # and sampler, its own step not compiled in the background
    monkeypatch.setattr(StepPrograms, "_compile_later", lambda *a, **k: None)
    llm = LLM(model=model_dir, **ENGINE, layer_dispatch="per_layer", compile_buckets=True)
    n = llm.llm_engine.runner.exec_cache.misses
    assert len(with_workers) == n
    assert "the worker exited" in caplog.text
    assert generate(llm) == want


def test_workers_lower_the_common_variants_heads(model_dir, jit_reference, with_workers, monkeypatch):
    """warm_sampler_variants (a GPU's default) compiled in the background (large layers): the head and sampler of
    every WARM_SAMPLER_VARIANTS variant for every single-step bucket are lowered by the workers, never traced here
    (where, while the engine serves, the tracing would hold the GIL from its loop). A cold start-up's workers
    export them after its steps, and they are lowered here before the engine serves, then compiled in the
    background; a start-up whose steps are all cached has the background start workers for them, at
    BACKGROUND_NICE, as it is itself. A logprobs request (logprobs=1: the warmed width) then runs on them with
    nothing lowered here: the jit reference's tokens and logprobs."""
    from jaxpaged.engine import core
    real = core.resolve
    monkeypatch.setattr(core, "resolve", lambda *a, **k: dataclasses.replace(real(*a, **k), warm_sampler_variants=True,
                                                                            variants_in_background=True))
    # the variant's own step is the first test's; here its head and sampler alone serve it
    monkeypatch.setattr(StepPrograms, "_compile_later", lambda *a, **k: None)
    jobs: list = []
    real_workers = lowering_workers.LoweringWorkers.__init__
    monkeypatch.setattr(lowering_workers.LoweringWorkers, "__init__",
                        lambda self, js: jobs.extend(js) or real_workers(self, js))

    def heads_of(js):
        return [w for j in js for w in j.work if isinstance(w, lowering_workers.HeadWork)]

    for cold in (True, False):
        jobs.clear()
        llm = LLM(model=model_dir, **ENGINE, layer_dispatch="per_layer", compile_buckets=True)
        programs = llm.llm_engine.runner.programs
        programs.wait_for_background_compiles()
        single_step_buckets = {k[1] for k in programs._resamplers}        # each bucket's layout
        assert len(single_step_buckets) >= 3
        assert len(programs._resamplers) == len(WARM_SAMPLER_VARIANTS) * len(single_step_buckets)
        assert {k[2] for k in programs._resamplers} == set(WARM_SAMPLER_VARIANTS)
        assert len(programs.compile_seconds["resample"]) == len(programs._resamplers)
        assert len(heads_of(jobs)) == len(programs._resamplers)
        with_steps = [j for j in jobs if any(isinstance(w, lowering_workers.StepWork) for w in j.work)]
        if cold:      # every head with the start-up's steps: the shapes foreseen were the warm-up's
            assert len(heads_of(with_steps)) == len(programs._resamplers)
            assert all(j.nice == 0 for j in jobs)
        else:         # no start-up workers: the background's own
            assert with_steps == [] and all(j.nice == step.BACKGROUND_NICE for j in jobs)
        assert with_workers == []
        assert generate(llm) == jit_reference["per_layer"]
        assert with_workers == []
        del llm, programs
    nice_there = []
    bg = step._BackgroundCompiler()
    bg.submit(lambda: nice_there.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    bg.join()
    bg.close()
    assert nice_there == [min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + step.BACKGROUND_NICE)]
