"""--kv-cache-dtype fp8: an e4m3 pool (held as bytes) with per-layer k_scale / v_scale (the checkpoint's, those
--calculate-kv-scales computes, else 1.0) holds twice bf16's tokens in the same memory, and greedy bf16 SmolLM2
stays close to its own bf16 cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import hf_default_gguf_model, save_tiny_llama
from jaxpaged import LLM, SamplingParams
from jaxpaged.config import EngineArgs
from jaxpaged.pallas_kernels import CPU_BF16_CACHE_DTYPE, FP8_CACHE_DTYPE

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
           "The three laws of thermodynamics are", "Translate to French: good morning", "List three fruits:",
           "Why is the sky blue?", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def engines():
    """bf16 SmolLM2 (issue 26's setting) over its bf16 cache, over an e4m3 cache with scales of 1.0, and over an
    e4m3 cache with --calculate-kv-scales."""
    return (LLM(dtype="bfloat16", max_model_len=256),
            LLM(dtype="bfloat16", max_model_len=256, kv_cache_dtype="fp8"),
            LLM(dtype="bfloat16", max_model_len=256, kv_cache_dtype="fp8", calculate_kv_scales=True))


def test_the_pool_holds_e4m3_bytes_and_twice_bf16s_tokens(engines):
    dense, fp8, _ = (e.llm_engine.core for e in engines)
    assert fp8.runner.kv_cache.dtype == FP8_CACHE_DTYPE and dense.runner.kv_cache.dtype == CPU_BF16_CACHE_DTYPE
    assert fp8.num_blocks - 1 >= 2 * (dense.num_blocks - 1) * 0.99     # the same bytes: 1 byte per value, not 2


def _top_choices(dense: LLM, fp8: LLM) -> int:
    """How many of the tokens fp8 picks greedily (8 prompts x 32) are also the dense cache's top choice after the
    same tokens (teacher-forced); fp8's blocks all return to its pool."""
    outs = fp8.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    seqs = [{"prompt_token_ids": o.prompt_token_ids + list(o.outputs[0].token_ids)} for o in outs]
    scored = dense.generate(seqs, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ranks = [entry[t].rank for o, s in zip(outs, scored)
             for entry, t in zip(s.prompt_logprobs[len(o.prompt_token_ids):], o.outputs[0].token_ids)]
    assert len(ranks) == 256
    pool = fp8.llm_engine.core.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1
    return sum(r == 1 for r in ranks)


def test_greedy_smollm2_stays_close_to_its_own_cache(engines):
    """Each token the fp8 run picks, judged by the bf16 cache's run on the same prefix (teacher-forced): the share
    that is also its top choice. Measured with scales of 1.0 / with --calculate-kv-scales (SmolLM2's first layer's
    V lies mostly below e4m3's smallest normal at a scale of 1.0): 241 / 247 of 256 on a Xeon with AVX-512 BF16 and
    AMX; CPUs differ by a few tokens, where their bf16 math tips near-ties. The measure costs about 3 tokens itself:
    the bf16 cache's own greedy tokens, judged the same way, are its top choice on 253. Guarded below 90% and 95%.
    Issue 26 asks 97%: missed."""
    dense, fp8, calibrated = engines
    plain, scaled = _top_choices(dense, fp8), _top_choices(dense, calibrated)
    print(f"top choices of the bf16 cache: scales 1.0 {plain} of 256, calculated {scaled} of 256")
    assert plain >= 0.90 * 256 and scaled >= 0.95 * 256


def test_calculated_kv_scales_are_the_calibration_prompts_largest_values():
    """--calculate-kv-scales: each layer's k_scale and v_scale are the calibration prompt's largest |k| / 200 and
    |v| / 100 (vLLM's constants), k after its rotation: as HF transformers' float32 SmolLM2, loading the same GGUF
    file, holds them in its KV cache after that prompt (float32 on both sides: the values equal). Per-layer
    dispatch: the layers' weights a list of trees (the engines above stack them)."""
    from jaxpaged.models.kv_calibration import CALIBRATION_TEXT
    calibrated = LLM(dtype="float32", max_model_len=256, kv_cache_dtype="fp8", calculate_kv_scales=True,
                     layer_dispatch="per_layer")
    hf = hf_default_gguf_model()
    ids = calibrated.get_tokenizer().encode(CALIBRATION_TEXT)
    with torch.no_grad():
        cache = hf(torch.tensor([ids]), use_cache=True).past_key_values
    layers = [(c.keys, c.values) for c in cache.layers] if hasattr(cache, "layers") else \
        list(zip(cache.key_cache, cache.value_cache))
    want = np.array([[k.abs().max().item() / 200, v.abs().max().item() / 100] for k, v in layers])
    layers = [lp["self_attn"] for group, *_ in calibrated.llm_engine.core.runner.programs.layer_groups
              for lp in group]
    got = np.array([[float(a["k_scale"]), float(a["v_scale"])] for a in layers])
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert np.ptp(got[:, 1]) > 0 and got[0, 1] < 0.01          # one scale per layer; the first layer's V is small


def test_calibrated_params_in_either_layer_layout():
    """calibrated_params sets the same scales in stacked layers (the scan) and in a list of per-layer trees, the
    other weights untouched; an all-zero layer keeps a finite scale."""
    from jaxpaged.models.kv_calibration import MIN_SCALE, calibrated_params
    amax = np.array([[400.0, 100.0], [0.0, 1.0]], np.float32)
    want = np.array([[2.0, 1.0], [MIN_SCALE, 0.01]], np.float32)
    w = np.ones((2, 3), np.float32)
    rows = [w[0], w[1]]
    one = lambda i: {"self_attn": {"k_scale": 1.0, "v_scale": 1.0}, "w": rows[i]}      # noqa: E731
    stacked = calibrated_params({"layers": {"self_attn": {"k_scale": np.ones(2), "v_scale": np.ones(2)},
                                                  "w": w}, "norm": 1}, amax)
    listed = calibrated_params({"layers": [one(0), one(1)], "norm": 1}, amax)
    np.testing.assert_allclose(np.stack([stacked["layers"]["self_attn"]["k_scale"],
                                         stacked["layers"]["self_attn"]["v_scale"]], 1), want, rtol=1e-6)
    np.testing.assert_allclose([[float(lp["self_attn"]["k_scale"]), float(lp["self_attn"]["v_scale"])]
                                for lp in listed["layers"]], want, rtol=1e-6)
    assert stacked["layers"]["w"] is w and listed["layers"][1]["w"] is rows[1] and listed["norm"] == 1


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
    assert engine_args_from(make_parser().parse_args(["--kv-cache-dtype", "fp8", "--calculate-kv-scales"])
                            ).calculate_kv_scales
    with pytest.raises(ValueError, match="calculate_kv_scales sets the scales of an fp8 KV cache"):
        EngineArgs(calculate_kv_scales=True)
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--kv-cache-dtype", "int8"])
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e5m2' is not supported; supported: auto, fp8, "
                                         "fp8_e4m3"):
        EngineArgs(kv_cache_dtype="fp8_e5m2")
