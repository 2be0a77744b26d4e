"""The KV pool's activation reserve (engine/cache_sizing.py) against XLA's memory analysis of the compiled steps.

XLA:CPU's analysis stands in for the GPU's here (bench/temporaries.py measures the GPU's); the reserve's terms are
the same on both: the layers at the token budget, and the head's logits with a variant sampler's chunk."""
import jax

from bench.temporaries import largest_bucket_variants
from jaxpaged import LLM
from jaxpaged.engine.cache_sizing import activation_reserve
from jaxpaged.models import decoder
from jaxpaged.runner import sampler
from jaxpaged.runner.sampler import SamplerFlags
from tests.conftest import save_tiny_llama

EVERY_VARIANT = SamplerFlags(top_k_p=True, penalties=True, logit_bias=True, num_logprobs=5, num_prompt_logprobs=5)


def _largest_step_temporaries(llm, flags: SamplerFlags) -> int:
    """XLA's temporaries of the largest bucket's step under `flags` (bench/temporaries.py's measure)."""
    runner = llm.llm_engine.core.runner
    bucket = max(runner.buckets.all_buckets(), key=lambda b: (b.padded_num_tokens, b.padded_num_reqs))
    return largest_bucket_variants("tiny", runner.programs, runner, bucket, {"it": flags})["it"]


def test_the_reserve_holds_every_sampler_variants_step_and_the_chunks_shrink_it(tmp_path, monkeypatch):
    """A tiny Llama with SmolLM2's 49,152-token vocabulary at the CPU's budget (2,048 tokens, 256 rows): the
    largest step under the plain sampler and under every variant at once (top-k/p, penalties, logit bias,
    logprobs, prompt logprobs) fits the reserve, with the sampler's and the prompt head's chunks set small enough
    to split those 256 rows and 2,048 tokens; and the chunks take the variant's temporaries well below what the
    same step holds with every row at once."""
    save_tiny_llama(tmp_path, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2)
    monkeypatch.setattr(sampler, "SAMPLER_CHUNK_BYTES", 8 << 20)
    monkeypatch.setattr(decoder, "PROMPT_HEAD_BYTES", 32 << 20)
    llm = LLM(model=str(tmp_path), max_model_len=256, dtype="float32", num_gpu_blocks_override=64)
    core = llm.llm_engine.core
    reserve = activation_reserve(core.model_config, core.run.max_num_batched_tokens, core.run.max_num_seqs,
                                 core.dtype)
    plain = _largest_step_temporaries(llm, SamplerFlags())
    chunked = _largest_step_temporaries(llm, EVERY_VARIANT)
    assert 0 < plain <= chunked <= reserve, (plain, chunked, reserve)
    monkeypatch.setattr(sampler, "SAMPLER_CHUNK_BYTES", 0)
    monkeypatch.setattr(decoder, "PROMPT_HEAD_BYTES", 0)
    jax.clear_caches()
    whole = _largest_step_temporaries(llm, EVERY_VARIANT)
    assert chunked < whole / 2, (chunked, whole)


def test_a_program_over_the_reserve_is_named_at_start_up(caplog):
    """The warm-up's largest program against the reserve the pool left: over it, a warning names its bucket and
    what to lower; within it, or on the CPU (a fixed pool budget), nothing. The GPU's figures are mocked here."""
    import logging
    import types

    from jaxpaged.engine.core import EngineCore

    def core(temp, platform="gpu"):
        programs = types.SimpleNamespace(largest_temporaries=lambda n: [("16384 tokens, 1024 rows, 1 step", temp)])
        return types.SimpleNamespace(run=types.SimpleNamespace(platform=platform),
                                     args=types.SimpleNamespace(num_gpu_blocks_override=None),
                                     runner=types.SimpleNamespace(programs=programs), activation_reserve=3 << 30)
    with caplog.at_level(logging.WARNING, logger="jaxpaged.engine"):
        EngineCore._check_reserve(core(2 << 30))
        EngineCore._check_reserve(core(5 << 30, platform="cpu"))
        assert not caplog.records
        EngineCore._check_reserve(core(5 << 30))
    [record] = caplog.records
    assert "16384 tokens, 1024 rows, 1 step takes 5.00 GiB" in record.message
    assert "3.00 GiB" in record.message and "--gpu-memory-utilization" in record.message


def test_an_engine_samples_the_same_tokens_with_its_rows_in_chunks(tmp_path, monkeypatch):
    """Requests with top-k/p, penalties and logprobs (seeded), through the engine with the variant sampler over
    its rows in chunks of 2 (a batch of 6 padded to 8 rows: four chunks) and over all rows at once: the same tokens
    and logprobs."""
    from jaxpaged import SamplingParams
    save_tiny_llama(tmp_path, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2)
    prompts = [f"Tell me about the number {i}" for i in range(6)]
    params = [SamplingParams(temperature=0.9, top_p=0.8, top_k=40, presence_penalty=0.5, seed=i, max_tokens=4,
                             ignore_eos=True, logprobs=2) for i in range(6)]

    def run(chunk_bytes):
        monkeypatch.setattr(sampler, "SAMPLER_CHUNK_BYTES", chunk_bytes)
        assert sampler.sampler_chunk_rows(8, 49152, SamplerFlags(top_k_p=True)) == (2 if chunk_bytes else 8)
        jax.clear_caches()
        try:
            outs = LLM(model=str(tmp_path), max_model_len=64, num_gpu_blocks_override=64).generate(
                prompts, params, use_tqdm=False)
        finally:
            jax.clear_caches()
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in e.items()} for e in o.outputs[0].logprobs])
                for o in outs]
    whole = run(0)
    chunked = run(2 * 49152 * 4)
    assert chunked == whole
