"""The engine end to end on a tiny random-weight Llama with the SmolLM2 tokenizer (CPU, float32):
greedy parity across chunked prefill / prefix caching / preemption (recompute, swap), seeded sampling,
penalties and logit bias against a NumPy reference over HF logits, min_tokens, stop strings, logprobs,
abort, n > 1, beam search."""
import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from jaxpaged import BeamSearchParams, SamplingParams
from conftest import save_tiny_llama

MAX_LEN = 192


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama")
    hf = save_tiny_llama(d, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=False, initializer_range=0.2)
    return str(d), hf


def make_llm(model_dir, **kw):
    from jaxpaged import LLM
    args = dict(dtype="float32", num_gpu_blocks_override=96, max_model_len=MAX_LEN, max_num_batched_tokens=256,
                max_num_seqs=8, block_size=16)
    args.update(kw)
    return LLM(model=model_dir[0], **args)


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].double().numpy()


RNG = np.random.default_rng(1)
BASE = RNG.integers(100, 40000, 40).tolist()                     # a prefix shared by every prompt
PROMPTS = [BASE + RNG.integers(100, 40000, n).tolist() for n in (5, 23, 50, 9, 70, 1)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_greedy_matches_hf(model_dir, reference):
    hf = model_dir[1]
    ids = list(PROMPTS[0])
    for t in reference[0][:8]:
        assert int(np.argmax(hf_logits(hf, ids))) == t
        ids.append(t)
    assert len(set(reference[0])) > 3        # the random model does not just repeat itself


@pytest.mark.parametrize("kw", [
    dict(enable_chunked_prefill=True, max_num_batched_tokens=32),
    dict(enable_chunked_prefill=False, enable_prefix_caching=False),
    dict(enable_prefix_caching=False, max_num_batched_tokens=32),
    dict(num_gpu_blocks_override=12, preemption_mode="recompute"),
    dict(num_gpu_blocks_override=12, preemption_mode="swap", swap_space=0.01),
    dict(layer_dispatch="per_layer", max_num_batched_tokens=32),
    dict(layer_dispatch="unrolled", max_num_batched_tokens=32),
], ids=["chunked", "no-chunking-no-caching", "no-caching", "preempt-recompute", "preempt-swap", "per-layer",
        "unrolled"])
def test_greedy_identical_across_scheduling(model_dir, reference, kw):
    llm = make_llm(model_dir, **kw)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    eng = llm.llm_engine
    if "preemption_mode" in kw:
        assert eng.scheduler.num_preemptions > 0
    if kw.get("max_num_batched_tokens") == 32:
        assert eng.stats.num_steps > len(PROMPTS) * 24 // 8
    # vLLM's counters: each request's whole prompt once, however it was chunked, cached or recomputed
    assert eng.stats.prompt_tokens == sum(map(len, PROMPTS))
    if eng.args.enable_prefix_caching:       # each request looked up once, preempted or not, in tokens
        kv = eng.kv_manager
        assert kv.prefix_cache_queries == sum(map(len, PROMPTS))
        if "preemption_mode" in kw:
            assert 0 < kv.prefix_cache_hits <= 32 * (len(PROMPTS) - 1)
        else:                                # the 5 prompts after the first hit BASE's two full blocks
            assert kv.prefix_cache_hits == 32 * (len(PROMPTS) - 1)
    assert eng.kv_manager.pool.num_free_blocks == eng.num_blocks - 1


def test_per_layer_dispatch_equals_the_layer_scan(model_dir, llm):
    """Seeded sampling, logprobs and prompt logprobs come out the same when each layer is its own dispatch."""
    per_layer = make_llm(model_dir, layer_dispatch="per_layer")
    assert per_layer.llm_engine.runner.programs.layer_groups is not None
    assert llm.llm_engine.runner.programs.layer_groups is None
    # attention may take kernels XLA's CUDA graphs can't capture only where no while loop holds the layers:
    # per-layer programs of one step, not the layer scan nor a multi-step loop
    from jaxpaged.runner.buckets import Bucket
    decode = Bucket(8, 8, True)
    assert not per_layer.llm_engine.runner.programs.options(decode, 1).in_loop
    assert per_layer.llm_engine.runner.programs.options(decode, 4).in_loop
    assert llm.llm_engine.runner.programs.options(decode, 1).in_loop
    params = [SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=12, logprobs=2, prompt_logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
    a = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    b = per_layer.generate(PROMPTS[:2], params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
    lp = lambda o: [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]
    np.testing.assert_allclose(lp(a[0]), lp(b[0]), rtol=1e-5, atol=1e-5)
    plp = lambda o: [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
    np.testing.assert_allclose(plp(a[0]), plp(b[0]), rtol=1e-5, atol=1e-5)


def test_layer_groups_that_do_not_divide_the_layers(tmp_path_factory):
    """Per-layer dispatch runs the layers in groups of config.LAYERS_PER_DISPATCH; with 5 layers in groups
    of 4 the last group has one layer and compiles its own program. Greedy tokens equal the layer scan's,
    and so do those of all 5 layers unrolled into one program. An unknown dispatch is refused."""
    from jaxpaged.config import LAYERS_PER_DISPATCH
    from jaxpaged.runner.layerwise import group_layers
    assert LAYERS_PER_DISPATCH == 4
    d = tmp_path_factory.mktemp("tiny_llama_5")
    save_tiny_llama(d, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=2,
                    num_key_value_heads=1, initializer_range=0.2)
    scan = make_llm((str(d),), layer_dispatch="scan")
    grouped = make_llm((str(d),), layer_dispatch="per_layer")
    assert [len(g) for g, *_ in grouped.llm_engine.runner.programs.layer_groups] == [4, 1]
    want = [o.outputs[0].token_ids for o in scan.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in grouped.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    unrolled = make_llm((str(d),), layer_dispatch="unrolled")
    assert [len(g) for g, *_ in unrolled.llm_engine.runner.programs.layer_groups] == [5]
    assert [o.outputs[0].token_ids for o in unrolled.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    with pytest.raises(ValueError, match="layer_dispatch must be one of scan, per_layer, unrolled"):
        make_llm((str(d),), layer_dispatch="layerwise")
    with pytest.raises(ValueError, match="layers per dispatch must be at least 1"):     # would run no layer
        group_layers([{}] * 5, list(range(5)), 0)


def test_layer_groups_of_differing_layers(tmp_path_factory):
    """Gemma 2's layers alternate windowed and full attention (window 24, shorter than the requests): per-layer
    groups of 4 and 1 layers, and all 5 unrolled, each compile their layers' own windows, and give the layer
    scan's greedy tokens (the scan picks each layer's window with a switch on the layer index)."""
    from conftest import save_tiny_model
    d = tmp_path_factory.mktemp("tiny_gemma2_5")
    save_tiny_model("gemma2", d, num_hidden_layers=5, initializer_range=0.2)
    prompts = [{"prompt_token_ids": RNG.integers(3, 320, n).tolist()} for n in (30, 41, 7)]
    scan = make_llm((str(d),), layer_dispatch="scan")
    want = [o.outputs[0].token_ids for o in scan.generate(prompts, GREEDY, use_tqdm=False)]
    for dispatch, groups in (("per_layer", [(1, 0, 1, 0), (1,)]), ("unrolled", [(1, 0, 1, 0, 1)])):
        llm = make_llm((str(d),), layer_dispatch=dispatch)
        assert [kinds for *_, kinds in llm.llm_engine.runner.programs.layer_groups] == groups
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want


def test_prefix_cache_reports_cached_tokens(llm):
    outs = llm.generate([PROMPTS[2], PROMPTS[2]], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[1].num_cached_tokens >= 32


def test_seeded_sampling_reproducible_alone_and_in_a_batch(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], sp, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([PROMPTS[1]], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.7, seed=i, max_tokens=10) for i in range(3)]
    batch = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[4]], [others[0], sp, others[1], others[2]],
                         use_tqdm=False)
    assert alone == again == batch[1].outputs[0].token_ids
    other_seed = llm.generate([PROMPTS[1]], sp.clone(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def np_sampler_reference(logits, prompt, out, sp):
    """Plain NumPy: repetition (prompt + output), frequency, presence penalties, then logit bias; argmax."""
    x = logits.copy()
    counts = np.bincount(np.array(out, int), minlength=len(x)) if out else np.zeros(len(x))
    seen = (counts > 0) | (np.bincount(np.array(prompt, int), minlength=len(x)) > 0)
    x[seen] = np.where(x[seen] > 0, x[seen] / sp.repetition_penalty, x[seen] * sp.repetition_penalty)
    x -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0)
    for t, v in (sp.logit_bias or {}).items():
        x[t] += v
    return int(np.argmax(x))


@pytest.mark.parametrize("sp", [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8),
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.7),
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={500: 4.0, 1234: 2.5}),
], ids=["repetition", "frequency-presence", "logit-bias"])
def test_penalties_and_logit_bias_against_numpy(llm, model_dir, sp):
    hf = model_dir[1]
    prompt = PROMPTS[3]
    got = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    out = []
    for _ in range(sp.max_tokens):
        out.append(np_sampler_reference(hf_logits(hf, prompt + out), prompt, out, sp))
    assert got == out


def test_min_tokens_and_stop_token_ids(llm, reference):
    first = reference[0][0]
    sp = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[first])
    out = llm.generate([PROMPTS[0]], sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "stop" and out.stop_reason == first
    out = llm.generate([PROMPTS[0]], sp.clone(min_tokens=3), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 3 and first not in out.token_ids[:3]
    assert out.finish_reason == "length" or out.token_ids[-1] == first


def test_stop_strings_across_token_boundaries(llm, reference):
    tok = llm.get_tokenizer()
    ids = reference[4]
    text = llm.generate([PROMPTS[4]], GREEDY, use_tqdm=False)[0].outputs[0].text
    # a stop string made of the end of token 3 and the start of token 4
    cut = len(tok.decode(ids[:4]))
    stop = text[cut - 2:cut + 2]
    assert len(tok.decode(ids[3:4])) >= 2 and len(tok.decode(ids[4:5])) >= 2
    at = text.find(stop)
    out = llm.generate([PROMPTS[4]], GREEDY.clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:at] and out.finish_reason == "stop" and out.stop_reason == stop
    out = llm.generate([PROMPTS[4]], GREEDY.clone(stop=[stop], include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:at + len(stop)]
    assert len(out.token_ids) == len(tok(text[:at + len(stop)]).input_ids) or len(out.token_ids) <= 5


def test_logprobs_top_k_and_sampled(llm, model_dir, reference):
    hf = model_dir[1]
    out = llm.generate([PROMPTS[0]], GREEDY.clone(max_tokens=4, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference[0][:4]
    ids = list(PROMPTS[0])
    total = 0.0
    for t, entry in zip(out.token_ids, out.logprobs):
        x = hf_logits(hf, ids)
        lp = x - np.log(np.exp(x - x.max()).sum()) - x.max()
        top = np.argsort(-lp)[:3].tolist()
        assert set(entry) == set(top) | {t}
        assert entry[t].rank == 1
        for tid in top:
            assert abs(entry[tid].logprob - lp[tid]) < 1e-3
        assert [entry[tid].rank for tid in top] == [1, 2, 3]
        total += lp[t]
        ids.append(t)
    assert abs(out.cumulative_logprob - total) < 1e-3
    # a sampled token outside the top-k is still reported, with its true rank
    biased = llm.generate([PROMPTS[0]], GREEDY.clone(max_tokens=1, logprobs=1, logit_bias={777: 100.0}),
                          use_tqdm=False)[0].outputs[0]
    assert biased.token_ids == [777] and set(biased.logprobs[0]) == {777, reference[0][0]}
    assert biased.logprobs[0][777].rank > 1


@pytest.mark.parametrize("chunk", [None, 16])
def test_prompt_logprobs_match_hf(model_dir, llm, reference, chunk):
    """prompt_logprobs: each prompt token's logprob under the model, with the top-k, in one prefill or in
    chunks (max_num_batched_tokens 16 splits the 45-token prompt into three steps)."""
    hf = model_dir[1]
    engine = llm if chunk is None else make_llm(model_dir, max_num_batched_tokens=chunk)
    prompt = PROMPTS[0]
    out = engine.generate([prompt], GREEDY.clone(max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].double().numpy()
    lps = logits - logits.max(-1, keepdims=True)
    lps = lps - np.log(np.exp(lps).sum(-1, keepdims=True))
    for p in range(1, len(prompt)):
        entry, tok = out.prompt_logprobs[p], prompt[p]
        assert abs(entry[tok].logprob - lps[p - 1, tok]) < 1e-3
        # the rank, up to float32-vs-float64 ties with neighbouring logprobs
        above_surely = int((lps[p - 1] > lps[p - 1, tok] + 1e-4).sum())
        above_maybe = int((lps[p - 1] > lps[p - 1, tok] - 1e-4).sum())
        assert above_surely + 1 <= entry[tok].rank <= above_maybe + 1
        top = np.argsort(-lps[p - 1])[:2].tolist()
        assert set(entry) == set(top) | {tok}
    assert out.outputs[0].token_ids == reference[0][:2]
    # a one-token prompt has only the first entry, as vLLM's: [None]
    one = engine.generate([prompt[:1]], GREEDY.clone(max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]


def test_n_samples_share_prompt_and_differ(llm):
    eng = llm.llm_engine
    hits0 = eng.kv_manager.prefix_cache_hits
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = llm.generate([PROMPTS[4]], sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    # samples 1 and 2 reuse the prompt's full blocks (in tokens)
    assert eng.kv_manager.prefix_cache_hits - hits0 >= 2 * (len(PROMPTS[4]) // 16 * 16)
    again = llm.generate([PROMPTS[4]], sp, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_refused_on_arrival(llm):
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([[5] * MAX_LEN], GREEDY, use_tqdm=False)
    small = llm.llm_engine
    assert not small.has_unfinished_requests()


def test_never_fitting_request_is_refused_at_once(model_dir):
    """A pool of 8 blocks of 16 (128 slots) under max_model_len 192: a request that needs more than the whole
    pool is a ValueError naming it before anything is queued, not a request that waits forever; one that
    needs exactly the pool (prompt + max_tokens - 1 = 128) runs to its end, alone, without a preemption."""
    llm = make_llm(model_dir, num_gpu_blocks_override=9)
    eng = llm.llm_engine
    prompt = RNG.integers(100, 40000, 100).tolist()
    with pytest.raises(ValueError, match=r"needs up to 129 tokens of KV cache \(100 in the prompt, max_tokens=30\), "
                       r"more than the whole KV cache holds: 128 tokens \(8 blocks of 16\)"):
        llm.generate([PROMPTS[0], prompt], SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert not eng.has_unfinished_requests() and eng.kv_manager.pool.num_free_blocks == 8
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=29, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 29 and eng.scheduler.num_preemptions == 0


def test_counters_mean_what_vllms_mean(llm):
    """vLLM V1's counters (server/metrics.py exports them), exact, for an 18-token prompt with block size 16:
    prompt_tokens counts the whole prompt of every request (cached tokens too) and prefix_cache_queries /
    hits count tokens; an n = 2 request is two requests; an abort before the first step counts no prompt."""
    eng = llm.llm_engine
    prompt = np.random.default_rng(18).integers(100, 40000, 18).tolist()     # in no other test's cache

    def counters():
        c, r = eng.core.core_stats(), eng.request_stats
        return np.array([c.prompt_tokens, c.prefix_cache_queries, c.prefix_cache_hits, c.num_preemptions,
                         r.generation_tokens, r.finished_by_reason["length"], r.finished_by_reason["abort"]])

    def moved(run):
        before = counters()
        run()
        return (counters() - before).tolist()

    def generate(**kw):
        return lambda: llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True, **kw), use_tqdm=False)

    #                              prompt  queried  hit  preempt  generated  length  abort
    assert moved(generate()) ==             [18, 18, 0, 0, 4, 1, 0]
    assert moved(generate()) ==             [18, 18, 16, 0, 4, 1, 0]       # the first block's 16 from the cache
    assert moved(generate(n=2, seed=1)) ==  [36, 36, 32, 0, 8, 2, 0]
    assert moved(lambda: (eng.add_request("gone", prompt, SamplingParams(max_tokens=4)),
                          eng.abort_request("gone"))) == [0, 0, 0, 0, 0, 0, 1]


def test_abort_frees_blocks_immediately(llm):
    """An abort frees the request's blocks at once, and the runner drops its row: also when it was the only
    running request, so that the next schedule is empty and launches nothing (a client that leaves an otherwise
    idle server, again and again, must not grow the runner's batch)."""
    eng = llm.llm_engine
    free0 = eng.kv_manager.pool.num_free_blocks
    for victim in ("victim", "victim-2"):
        eng.add_request(victim, PROMPTS[4], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
        for _ in range(3):
            eng.step()
        assert eng.kv_manager.pool.num_free_blocks < free0 and victim in eng.runner.batch.rows
        eng.abort_request(victim)
        assert eng.kv_manager.pool.num_free_blocks == free0
        while eng.has_unfinished_requests():
            eng.step()
        eng.step()                       # idle: nothing to schedule
        assert eng.kv_manager.pool.num_free_blocks == free0
        assert not eng.runner.batch.rows, eng.runner.batch.rows


@pytest.fixture(scope="module")
def alm(model_dir):
    """The server's engine: AsyncLLM over an engine-core process, the `llm` fixture's arguments."""
    from jaxpaged.config import EngineArgs
    from jaxpaged.engine.async_llm import AsyncLLM
    a = AsyncLLM(EngineArgs(model=model_dir[0], dtype="float32", num_gpu_blocks_override=96, max_model_len=MAX_LEN,
                            max_num_batched_tokens=256, max_num_seqs=8, block_size=16,
                            usage_context="openai_api_server"))
    yield a
    a.shutdown()


def test_async_abort_frees_blocks(alm):
    """An abort ends the stream with finish_reason "abort" and frees the request's blocks in the core
    process (its gauges come back with the next message)."""
    free0 = alm.info.num_blocks - 1

    async def go():
        gen = alm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=90, ignore_eos=True), "a1")
        first = await gen.__anext__()
        assert not first.finished
        await alm.abort("a1")
        last = await gen.__anext__()
        assert last.finished and last.outputs[0].finish_reason == "abort"
        deadline = time.monotonic() + 120          # polled: the core takes the abort between its steps
        while time.monotonic() < deadline:
            stats = alm.core_stats
            if stats.num_free_blocks == free0 and stats.num_requests_running == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(go())


def test_async_submit_sends_at_once_and_an_unread_stream_closes_to_an_abort(alm):
    """AsyncLLM.submit (what the server's handlers call): the request is in the core before its stream is read,
    its outputs queue up; a stream closed without being read aborts its request and frees its blocks; read to
    its end, a submitted request gives what generate gives."""
    free0 = alm.info.num_blocks - 1
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    text, ids = alm.input_processor.tokenize_prompt(PROMPTS[2])

    async def until(check) -> bool:
        deadline = time.monotonic() + 120          # polled: the core reports with its next step's message
        while time.monotonic() < deadline:
            if check(alm.core_stats):
                return True
            await asyncio.sleep(0.01)
        return False

    async def go():
        stream = alm.submit({"prompt": text, "prompt_token_ids": ids}, params, "s1")
        assert await until(lambda st: st.num_requests_running == 1)        # running, its stream unread
        stream.close()
        assert await until(lambda st: st.num_free_blocks == free0 and st.num_requests_running == 0)
        stream.close()                                                       # (idempotent)
        outs = [o async for o in alm.submit({"prompt": text, "prompt_token_ids": ids}, params, "s2")]
        ref = [o async for o in alm.generate(PROMPTS[2], params, "g2")]
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == ref[-1].outputs[0].token_ids
        assert len(outs[-1].outputs[0].token_ids) == 40
        return True

    assert asyncio.run(go())


def test_async_slow_consumer_gets_coalesced_deltas(llm, alm):
    """A DELTA consumer that falls behind receives the backlog as one output (as vLLM's collector does);
    the concatenated deltas (text, tokens, logprobs) equal the whole request's output, n = 2.
    The consumer falls behind for sure, at any machine speed: after its first output it waits until the
    output task has queued the request's last output, so everything after the first is one backlog."""
    from jaxpaged.sampling_params import RequestOutputKind
    kw = dict(temperature=0.8, seed=7, n=2, max_tokens=24, ignore_eos=True, logprobs=2)
    whole = llm.generate([PROMPTS[1]], SamplingParams(**kw), use_tqdm=False)[0]
    last_pushed = threading.Event()
    op = alm.output_processor
    real_process = op.process

    def process(core_outputs):              # on the loop: these outputs go to their queues next
        outputs, to_abort = real_process(core_outputs)
        if any(o.finished for o in outputs):
            last_pushed.set()
        return outputs, to_abort

    op.process = process

    async def go():
        got = {0: [[], "", []], 1: [[], "", []]}
        chunks, last = 0, None
        async for out in alm.generate(PROMPTS[1], SamplingParams(**kw, output_kind=RequestOutputKind.DELTA), "d1"):
            chunks += 1
            for c in out.outputs:
                got[c.index][0] += c.token_ids
                got[c.index][1] += c.text
                got[c.index][2] += c.logprobs
            last = out
            if not out.finished:            # fall behind: the rest of the request queues up meanwhile
                assert await asyncio.to_thread(last_pushed.wait, 120)
        return got, chunks, last

    try:
        got, chunks, last = asyncio.run(go())
    finally:
        del op.process
    assert last.finished and chunks <= 2    # the first output, then the whole backlog as one
    for c in whole.outputs:
        toks, text, lps = got[c.index]
        assert toks == c.token_ids and text == c.text
        assert len(lps) == len(c.logprobs)
        for mine, ref in zip(lps, c.logprobs):     # same tokens; values to float noise (another batch shape)
            assert mine.keys() == ref.keys()
            np.testing.assert_allclose([v.logprob for v in mine.values()], [v.logprob for v in ref.values()],
                                       atol=1e-4)
    assert {c.index: c.finish_reason for c in last.outputs} == {0: "length", 1: "length"}


def reference_beam_search(hf, prompt, width, max_tokens, length_penalty, eos=(2,)):
    """vLLM's algorithm over full HF forwards (no KV cache at all)."""
    beams, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        cands = []
        for toks, cum in beams:
            x = hf_logits(hf, toks)
            lp = x - x.max() - np.log(np.exp(x - x.max()).sum())
            for t in np.argsort(-lp)[:2 * width].tolist():
                (done if t in eos else cands).append((toks + [t], cum + lp[t]))
        beams = sorted(cands, key=lambda b: b[1], reverse=True)[:width]
    done += beams
    score = lambda b: b[1] / ((len(b[0]) - (b[0][-1] in eos)) ** length_penalty)
    return sorted(done, key=score, reverse=True)[:width]


def test_beam_search_more_beams_than_max_num_seqs(llm, model_dir):
    """3 prompts x width 3 = 9 beams against max_num_seqs 8: the prompts go in waves, results as the
    reference; a width above max_num_seqs is a clear error."""
    hf = model_dir[1]
    prompts = [PROMPTS[0][:12], PROMPTS[3][:9], PROMPTS[5][:15]]
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(beam_width=3, max_tokens=4))
    for p, out in zip(prompts, outs):
        ref = reference_beam_search(hf, p, 3, 4, 1.0)
        assert [s.tokens for s in out.sequences] == [r[0] for r in ref]
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="beam_width 9 exceeds max_num_seqs 8"):
        llm.beam_search([{"prompt_token_ids": prompts[0]}], BeamSearchParams(beam_width=9, max_tokens=2))


def test_beam_search_matches_reference_and_shares_blocks(llm, model_dir, monkeypatch):
    hf = model_dir[1]
    eng = llm.llm_engine
    kv = eng.kv_manager
    copies, shared = [], []
    real = eng.scheduler.schedule

    def spy():
        out = real()
        copies.extend(out.blocks_to_copy)
        ids = [b for r in eng.scheduler.running for b in kv.get_block_ids(r.request_id)]
        shared.append(len(ids) - len(set(ids)))
        return out

    monkeypatch.setattr(eng.scheduler, "schedule", spy)
    prompts = [PROMPTS[0][:30], PROMPTS[5][:21]]
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=1.0)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for p, out in zip(prompts, outs):
        ref = reference_beam_search(hf, p, 3, 6, 1.0)
        assert [s.tokens for s in out.sequences] == [r[0] for r in ref]
        np.testing.assert_allclose([s.cum_logprob for s in out.sequences], [r[1] for r in ref], rtol=1e-4)
        assert all(s.text == llm.get_tokenizer().decode(s.tokens, skip_special_tokens=True) for s in out.sequences)
    assert copies                                  # diverging beams copied a shared partly filled block
    assert max(shared) >= 2 * 3                    # beams share their prompt blocks
    assert kv.pool.num_free_blocks == eng.num_blocks - 1 and not eng.has_unfinished_requests()


def test_beam_search_finishes_on_a_pool_too_small_for_its_beams(llm, model_dir):
    """Two prompts of 52 and 41 tokens at beam width 4 need 13 blocks of 16 with every beam held at once; over
    9 the beams preempt each other, and the ones that hold blocks once they have given their candidates are
    parked (their children recompute): the same sequences and scores as on the large pool, and every block
    back at the end."""
    rng = np.random.default_rng(7)
    prompts = [{"prompt_token_ids": rng.integers(100, 40000, n).tolist()} for n in (52, 41)]
    params = BeamSearchParams(beam_width=4, max_tokens=10)
    small = make_llm(model_dir, num_gpu_blocks_override=10, max_num_batched_tokens=32)
    got, want = small.beam_search(prompts, params), llm.beam_search(prompts, params)
    for g, w in zip(got, want):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]
        np.testing.assert_allclose([s.cum_logprob for s in g.sequences], [s.cum_logprob for s in w.sequences],
                                   rtol=1e-5)
    eng = small.llm_engine
    assert eng.scheduler.num_preemptions > 0
    assert eng.kv_manager.pool.num_free_blocks == eng.num_blocks - 1 and not eng.has_unfinished_requests()
    assert not eng.runner.batch.rows
