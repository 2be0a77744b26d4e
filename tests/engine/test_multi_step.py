"""Multi-step scheduling (num_scheduler_steps, vLLM V0's flag): several decode steps per device program give
the same tokens as one step at a time, for greedy and seeded sampling, with every stop condition, parallel
samples, preemption, and requests whose sampling needs the host (which fall back to single steps)."""
import numpy as np
import pytest

from conftest import tiny_llama_dir
from jaxpaged import LLM, SamplingParams

pytestmark = pytest.mark.cost(60)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, "tiny_llama_multistep", num_hidden_layers=2)


def _generate(model_dir, steps, prompts, params, **kw):
    """(the RequestOutputs, the scheduler, each batch's steps a program in turn)."""
    llm = LLM(model=model_dir, dtype="float32", max_model_len=160, max_num_seqs=8, block_size=8,
              compile_buckets=False, num_scheduler_steps=steps, **kw)
    sched = llm.llm_engine.scheduler
    real_schedule, num_steps = sched.schedule, []

    def schedule():
        out = real_schedule()
        num_steps.append(out.num_steps)
        return out

    sched.schedule = schedule
    return llm.generate(prompts, params, use_tqdm=False), sched, num_steps


def _run(model_dir, steps, prompts, params, **kw):
    outs, sched, num_steps = _generate(model_dir, steps, prompts, params, **kw)
    if steps > 1:
        assert max(num_steps) > 1               # some batches ran several steps per program
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs], sched


def test_multi_step_gives_the_single_steps_tokens(model_dir):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(100, 40000, int(k)).tolist() for k in (3, 17, 40, 9, 25, 60)]
    params = [SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_tokens=30, ignore_eos=True, n=2),
              SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=11, max_tokens=17, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=29, ignore_eos=True, logprobs=1),   # needs the host
              SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)]
    want, _ = _run(model_dir, 1, prompts, params)
    for steps in (4, 7):
        got, _ = _run(model_dir, steps, prompts, params)
        assert got == want, steps


def test_prompt_logprobs_requests_decode_in_multi_step_batches(model_dir):
    """A request that asked for prompt logprobs has them scored in its prompt's chunks; its decode steps then join
    multi-step batches, and give the single steps' tokens and the same prompt logprobs."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(100, 40000, int(k)).tolist() for k in (6, 33)]
    params = [SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True, prompt_logprobs=1),
              SamplingParams(temperature=0.8, seed=4, max_tokens=18, ignore_eos=True, prompt_logprobs=0)]

    def run(steps):
        outs, _, num_steps = _generate(model_dir, steps, prompts, params, max_num_batched_tokens=16)
        prompt_lps = [[None if e is None else {t: lp.logprob for t, lp in e.items()} for e in o.prompt_logprobs]
                      for o in outs]
        return [o.outputs[0].token_ids for o in outs], prompt_lps, max(num_steps)

    want_tokens, want_lps, _ = run(1)
    tokens, lps, most_steps = run(4)
    assert most_steps == 4 and tokens == want_tokens
    assert [len(p) for p in lps] == [len(p) for p in prompts] and [p[0] for p in lps] == [None, None]
    for got, want in zip(lps, want_lps):
        for g, w in zip(got[1:], want[1:]):
            assert g.keys() == w.keys()
            np.testing.assert_allclose(list(g.values()), list(w.values()), rtol=0, atol=1e-6)


def test_multi_step_with_every_layer_unrolled(model_dir):
    """layer_dispatch="unrolled" runs the steps' loop around the one-program step: the scan's tokens."""
    rng = np.random.default_rng(10)
    prompts = [rng.integers(100, 40000, int(k)).tolist() for k in (4, 21, 37)]
    params = [SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=2, max_tokens=26, ignore_eos=True)]
    want, _ = _run(model_dir, 1, prompts, params + params[:1])
    got, _ = _run(model_dir, 5, prompts, params + params[:1], layer_dispatch="unrolled")
    assert got == want


def test_multi_step_stops_where_single_steps_stop(model_dir):
    """A stop token met inside a multi-step batch ends the request there; later tokens are discarded."""
    rng = np.random.default_rng(8)
    prompts = [rng.integers(100, 40000, int(k)).tolist() for k in (5, 12, 30)]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    free, _ = _run(model_dir, 1, prompts, [greedy] * 3)
    # stop on each request's 6th / 11th / 3rd generated token
    stops = [free[0][0][0][5], free[1][0][0][10], free[2][0][0][2]]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[t]) for t in stops]
    want, _ = _run(model_dir, 1, prompts, params)
    got, sched = _run(model_dir, 5, prompts, params)
    assert got == want
    assert [len(o[0][0]) for o in got] == [free[i][0][0].index(stops[i]) + 1 for i in range(3)]
    assert all(o[0][1] == "stop" for o in got)


def test_multi_step_under_preemption(model_dir):
    """Few blocks: multi-step batches allocate blocks for all their steps and preempt when they run out."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(100, 40000, int(k)).tolist() for k in (20, 31, 26, 15)]
    params = SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True)
    want, _ = _run(model_dir, 1, prompts, params, num_gpu_blocks_override=24)
    got, sched = _run(model_dir, 6, prompts, params, num_gpu_blocks_override=24)
    assert got == want
    assert sched.num_preemptions > 0


def test_num_scheduler_steps_is_validated(model_dir):
    with pytest.raises(ValueError, match="num_scheduler_steps must be at least 1"):
        LLM(model=model_dir, num_scheduler_steps=0)
    with pytest.raises(ValueError, match="needs the whole step in one program"):
        LLM(model=model_dir, dtype="float32", max_model_len=64, compile_buckets=False, num_scheduler_steps=4,
            layer_dispatch="per_layer")


def test_explicit_steps_equal_one_step(model_dir):
    """16 decode steps per program give an explicit single-step run's greedy tokens."""
    kw = dict(model=model_dir, dtype="float32", max_model_len=160, max_num_seqs=8, block_size=8,
              compile_buckets=False)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(100, 40000, int(k)).tolist() for k in (4, 30, 12)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = LLM(**kw, num_scheduler_steps=16)
    assert llm.llm_engine.num_scheduler_steps == 16
    multi = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    single = [o.outputs[0].token_ids for o in LLM(**kw, num_scheduler_steps=1).generate(
        prompts, params, use_tqdm=False)]
    assert multi == single
