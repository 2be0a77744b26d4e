"""The device sampler's functions against a plain NumPy reference on random logits."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.runner import sampler
from jaxpaged.runner.sampler import SamplerFlags, SamplingInputs, _mask_top_k_p, apply_logit_bias, apply_penalties

sample = jax.jit(sampler.sample, static_argnames="flags")   # as the runner's step: one compile per variant

R, V = 4, 50


def inputs(**kw):
    base = dict(temperature=np.zeros(R, np.float32), top_k=np.zeros(R, np.int32), top_p=np.ones(R, np.float32),
                min_p=np.zeros(R, np.float32), seeds=np.arange(R, dtype=np.uint32), positions=np.zeros(R, np.int32),
                presence_penalty=np.zeros(R, np.float32), frequency_penalty=np.zeros(R, np.float32),
                repetition_penalty=np.ones(R, np.float32), output_ids=np.full((R, 0), -1, np.int32),
                prompt_ids=np.full((R, 0), -1, np.int32), bias_ids=np.full((R, 0), -1, np.int32),
                bias_values=np.zeros((R, 0), np.float32))
    base.update(kw)
    return SamplingInputs(**base)


def pad(rows, width):
    out = np.full((len(rows), width), -1, np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def np_penalties(logits, prompts, outputs, pres, freq, rep):
    out = logits.astype(np.float64).copy()
    for i in range(len(out)):
        counts = np.bincount(np.array(outputs[i], int), minlength=V)
        seen = (counts > 0) | (np.bincount(np.array(prompts[i], int), minlength=V) > 0)
        row = out[i]
        row[seen] = np.where(row[seen] > 0, row[seen] / rep[i], row[seen] * rep[i])
        row -= freq[i] * counts
        row -= pres[i] * (counts > 0)
    return out


def np_top_k_p(logits, top_k, top_p, min_p):
    out = np.full_like(logits, -np.inf)
    for i, row in enumerate(logits):
        order = np.argsort(-row, kind="stable")
        k = top_k[i] if top_k[i] > 0 else V
        keep = np.zeros(V, bool)
        keep[:k] = True
        p = np.exp(row[order] - row[order][0])
        p = np.where(keep, p, 0)
        p /= p.sum()
        keep &= (np.cumsum(p) - p) < top_p[i]
        keep &= p >= min_p[i] * p[0]
        keep[0] = True
        out[i, order[keep]] = row[order[keep]]
    return out


@pytest.fixture
def logits():
    return np.random.default_rng(0).normal(0, 2, (R, V)).astype(np.float32)


def test_penalties_match_numpy(logits):
    prompts = [[1, 2, 3], [4], [], [5, 5, 6]]
    outputs = [[1, 1, 7], [8, 9, 8, 8], [10], []]
    pres = np.array([0.5, 0.0, 1.5, -0.3], np.float32)
    freq = np.array([0.25, 0.7, 0.0, 0.4], np.float32)
    rep = np.array([1.3, 1.0, 2.0, 0.8], np.float32)
    inp = inputs(presence_penalty=pres, frequency_penalty=freq, repetition_penalty=rep,
                 output_ids=pad(outputs, 8), prompt_ids=pad(prompts, 4))
    got = np.asarray(apply_penalties(jnp.asarray(logits), inp))
    np.testing.assert_allclose(got, np_penalties(logits, prompts, outputs, pres, freq, rep), rtol=1e-6, atol=1e-6)
    # greedy sampling picks the argmax of the penalised logits
    ids = np.asarray(sample(jnp.asarray(logits), inp, flags=SamplerFlags(penalties=True))[0])
    np.testing.assert_array_equal(ids, np_penalties(logits, prompts, outputs, pres, freq, rep).argmax(-1))


def test_logit_bias_matches_numpy(logits):
    bias = [{3: 5.0, 7: -2.0}, {}, {0: -np.inf, 49: 100.0}, {11: 0.5}]
    ids = pad([list(b) for b in bias], 4)
    vals = np.zeros((R, 4), np.float32)
    for i, b in enumerate(bias):
        vals[i, :len(b)] = list(b.values())
    inp = inputs(bias_ids=ids, bias_values=vals)
    ref = logits.astype(np.float64).copy()
    for i, b in enumerate(bias):
        for t, v in b.items():
            ref[i, t] += v
    got = np.asarray(apply_logit_bias(jnp.asarray(logits), inp))
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    out = sample(jnp.asarray(logits), inp, flags=SamplerFlags(logit_bias=True))[0]
    assert np.asarray(out)[2] == 49
    np.testing.assert_array_equal(np.asarray(out), ref.argmax(-1))


def test_top_k_top_p_min_p_mask_matches_numpy(logits):
    top_k = np.array([0, 5, 0, 3], np.int32)
    top_p = np.array([0.5, 1.0, 0.9, 0.8], np.float32)
    min_p = np.array([0.0, 0.0, 0.1, 0.05], np.float32)
    got = np.asarray(_mask_top_k_p(jnp.asarray(logits), inputs(top_k=top_k, top_p=top_p, min_p=min_p)))
    ref = np_top_k_p(logits, top_k, top_p, min_p)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
    np.testing.assert_allclose(got[~np.isinf(ref)], ref[~np.isinf(ref)], rtol=1e-6)
    assert (~np.isinf(got[1])).sum() == 5


def test_sampled_tokens_stay_inside_the_mask(logits):
    inp = inputs(temperature=np.full(R, 1.5, np.float32), top_k=np.array([1, 2, 3, 4], np.int32))
    allowed = np.argsort(-logits, axis=-1)
    for pos in range(20):
        inp.positions = np.full(R, pos, np.int32)
        ids = np.asarray(sample(jnp.asarray(logits), inp, flags=SamplerFlags(top_k_p=True))[0])
        for i in range(R):
            assert ids[i] in allowed[i, :i + 1]


def test_seeded_sampling_is_independent_of_the_batch(logits):
    temp = np.ones(R, np.float32)
    seeds = np.array([11, 22, 33, 44], np.uint32)
    full = np.asarray(sample(jnp.asarray(logits), inputs(temperature=temp, seeds=seeds), flags=SamplerFlags())[0])
    # the same row, alone (padded with greedy rows) and moved to another row, samples the same token
    for i in range(R):
        row = np.roll(logits, 2 - i, axis=0)
        s = np.roll(seeds, 2 - i)
        t = np.where(np.arange(R) == 2, 1.0, 0.0).astype(np.float32)
        got = np.asarray(sample(jnp.asarray(row), inputs(temperature=t, seeds=s), flags=SamplerFlags())[0])
        assert got[2] == full[i]
    # and the sample is a real draw: across positions the tokens vary
    draws = {int(np.asarray(sample(jnp.asarray(logits), inputs(temperature=temp * 5, seeds=seeds,
                                                                    positions=np.full(R, p, np.int32)),
                                   flags=SamplerFlags())[0])[0]) for p in range(30)}
    assert len(draws) > 3


def test_sampling_follows_the_distribution():
    # two tokens with p = 0.75 / 0.25: 400 draws (seed x position) land near 300 / 100
    logits = np.full((R, V), -1e9, np.float32)
    logits[:, 3], logits[:, 4] = np.log(0.75), np.log(0.25)
    hits = 0
    for pos in range(100):
        ids = sample(jnp.asarray(logits), inputs(temperature=np.ones(R, np.float32),
                                                 positions=np.full(R, pos, np.int32)), flags=SamplerFlags())[0]
        hits += int((np.asarray(ids) == 3).sum())
    assert 260 <= hits <= 340


def test_logprobs_rank_and_top_k(logits):
    inp = inputs(bias_ids=np.array([[5], [-1], [-1], [-1]], np.int32),
                 bias_values=np.array([[50.0], [0], [0], [0]], np.float32))
    ids, lp, rank, top_ids, top_lp = map(np.asarray, sample(jnp.asarray(logits), inp,
                                                            flags=SamplerFlags(logit_bias=True, num_logprobs=4)))
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    assert ids[0] == 5                                  # bias changes the choice, not the reported logprob
    np.testing.assert_allclose(lp, ref[np.arange(R), ids], rtol=1e-5)
    np.testing.assert_array_equal(rank, (ref > ref[np.arange(R), ids][:, None]).sum(-1) + 1)
    np.testing.assert_array_equal(top_ids, np.argsort(-ref, axis=-1)[:, :4])
    np.testing.assert_allclose(top_lp, np.sort(ref, axis=-1)[:, ::-1][:, :4], rtol=1e-5)
    assert rank[1] == 1


def test_gumbel_noise_has_the_gumbel_distribution():
    # 64 (seed, position) rows x 4096 entries: the moments of the standard Gumbel (mean Euler's gamma, variance
    # pi^2 / 6), its CDF exp(-exp(-g)) at three points, and no correlation between neighbouring entries or rows
    seeds = np.repeat(np.arange(8, dtype=np.uint32), 8)
    positions = np.tile(np.arange(8, dtype=np.int32), 8)
    g = np.asarray(jax.jit(sampler._gumbel, static_argnums=2)(seeds, positions, 4096), np.float64)
    assert abs(g.mean() - 0.5772157) < 0.01
    assert abs(g.var() - np.pi ** 2 / 6) < 0.03
    for x in (-1.0, 0.5, 3.0):
        assert abs((g < x).mean() - np.exp(-np.exp(-x))) < 0.005
    assert abs(np.corrcoef(g[:, :-1].ravel(), g[:, 1:].ravel())[0, 1]) < 0.01
    assert abs(np.corrcoef(g[:-1].ravel(), g[1:].ravel())[0, 1]) < 0.01


def test_gumbel_max_draws_follow_the_softmax():
    # 8 tokens with unequal probabilities, 4096 draws over (seed, position): a chi-square test with 7 degrees
    # of freedom well inside its 0.1% tail (24.3)
    p = np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
    logits = np.full((64, V), -1e9, np.float32)
    logits[:, :8] = np.log(p)
    counts = np.zeros(8)
    run = jax.jit(lambda lg, s, pos: sampler.sample(lg, SamplingInputs(
        temperature=jnp.ones(64), top_k=jnp.zeros(64, jnp.int32), top_p=jnp.ones(64), min_p=jnp.zeros(64),
        seeds=s, positions=pos, presence_penalty=jnp.zeros(64), frequency_penalty=jnp.zeros(64),
        repetition_penalty=jnp.ones(64), output_ids=jnp.full((64, 0), -1, jnp.int32),
        prompt_ids=jnp.full((64, 0), -1, jnp.int32), bias_ids=jnp.full((64, 0), -1, jnp.int32),
        bias_values=jnp.zeros((64, 0))), SamplerFlags())[0])
    for pos in range(64):
        ids = np.asarray(run(jnp.asarray(logits), jnp.arange(1000, 1064, dtype=jnp.uint32),
                             jnp.full(64, pos, jnp.int32)))
        counts += np.bincount(ids, minlength=V)[:8]
    assert counts.sum() == 4096
    expected = 4096 * p
    assert ((counts - expected) ** 2 / expected).sum() < 24.3


def test_a_variants_sampler_in_row_chunks_gives_the_whole_batchs_results(monkeypatch):
    """A variant's sampler takes its rows in chunks (SAMPLER_CHUNK_BYTES bounds its [rows, V] temporaries): 37
    rows in chunks of 8, the last one padded, give what all 37 at once give, token for token and logprob for
    logprob, with every variant path on (top-k/p/min-p, penalties, logit bias, logprobs) and seeded sampling."""
    rows, vocab = 37, 300
    rng = np.random.default_rng(7)
    logits = jnp.asarray(rng.normal(size=(rows, vocab)).astype(np.float32) * 3)
    ids = lambda: rng.integers(-1, vocab, (rows, 6)).astype(np.int32)  # noqa: E731
    inp = SamplingInputs(
        temperature=rng.choice([0.0, 0.7, 1.3], rows).astype(np.float32),
        top_k=rng.integers(0, 40, rows).astype(np.int32),
        top_p=rng.uniform(0.3, 1, rows).astype(np.float32), min_p=rng.uniform(0, 0.1, rows).astype(np.float32),
        seeds=np.arange(rows, dtype=np.uint32), positions=rng.integers(0, 9, rows).astype(np.int32),
        presence_penalty=rng.uniform(0, 1, rows).astype(np.float32),
        frequency_penalty=rng.uniform(0, 1, rows).astype(np.float32),
        repetition_penalty=rng.uniform(1, 1.5, rows).astype(np.float32), output_ids=ids(), prompt_ids=ids(),
        bias_ids=ids(), bias_values=rng.normal(size=(rows, 6)).astype(np.float32))
    flags = SamplerFlags(top_k_p=True, penalties=True, logit_bias=True, num_logprobs=3)
    monkeypatch.setattr(sampler, "SAMPLER_CHUNK_BYTES", 0)
    whole = jax.jit(sampler.sample, static_argnames="flags")(logits, inp, flags)
    monkeypatch.setattr(sampler, "SAMPLER_CHUNK_BYTES", 8 * vocab * 4 + 100)
    assert sampler.sampler_chunk_rows(rows, vocab, flags) == 8
    assert sampler.sampler_chunk_rows(rows, vocab, SamplerFlags()) == rows    # the plain sampler runs whole
    chunked = jax.jit(sampler.sample, static_argnames="flags")(logits, inp, flags)
    for a, b in zip(whole, chunked):
        assert a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # top-k/p alone, as the warm-up compiles it: the penalties' and bias's inputs empty ([R, 0]), no logprobs
    empty = dataclasses.replace(inp, output_ids=inp.output_ids[:, :0], prompt_ids=inp.prompt_ids[:, :0],
                                bias_ids=inp.bias_ids[:, :0], bias_values=inp.bias_values[:, :0])
    top_k_p = SamplerFlags(top_k_p=True)
    chunked = jax.jit(sampler.sample, static_argnames="flags")(logits, empty, top_k_p)
    monkeypatch.setattr(sampler, "SAMPLER_CHUNK_BYTES", 0)
    whole = jax.jit(sampler.sample, static_argnames="flags")(logits, empty, top_k_p)
    for a, b in zip(whole, chunked):
        assert a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
