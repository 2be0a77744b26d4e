"""fp8 weights: a dense checkpoint quantized at load (quantization="fp8"), vLLM's fp8 checkpoints (per-tensor
with dynamic or static activation scales, block-scaled) and compressed-tensors float-quantized ones (channel or
tensor weight scales, dynamic per-token or static activations), written here from tiny random-weight models.
Each computes what HF transformers computes with the same fp8 weights dequantized and, where the activations
are quantized (W8A8), the same e4m3 rounding of each linear layer's input: float32 logprobs within 1e-4,
greedy tokens equal."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from jaxpaged import LLM
from quant_cases import (W8A8_TOLERANCE, built_once, check_against_hf, declare_quantization, linear_weight_names,
                         save_tiny, with_quant_config)

F8_MAX = 448.0
STATIC_INPUT_SCALE = 0.02      # |x| up to ~9 in e4m3's range: the tiny models' normed inputs stay inside


@dataclasses.dataclass(frozen=True)
class Fp8Case:
    family: str
    source: str                  # online | fp8 | compressed-tensors
    weights: str = "tensor"      # tensor | channel | block (128 x 128)
    static: bool = False         # activations scaled by a checkpoint's input_scale, else per token

    def __str__(self):
        return f"{self.family}-{self.source}-{self.weights}" + ("-static" if self.static else "")

    def quantization_config(self) -> dict | None:
        if self.source == "online":
            return None
        if self.source == "fp8":
            cfg = {"quant_method": "fp8", "activation_scheme": "static" if self.static else "dynamic"}
            return {**cfg, "weight_block_size": [128, 128]} if self.weights == "block" else cfg
        acts = ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
                if self.static else
                {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True})
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts, "weights": {
                    "num_bits": 8, "type": "float", "strategy": self.weights, "symmetric": True,
                    "dynamic": False}}}}


CASES = [Fp8Case("llama", "online", "channel"), Fp8Case("qwen2", "online", "channel"),
         Fp8Case("llama", "fp8"), Fp8Case("qwen3", "fp8", static=True), Fp8Case("llama", "fp8", "block"),
         Fp8Case("qwen2", "compressed-tensors", "channel"), Fp8Case("llama", "compressed-tensors", static=True)]


def to_f8(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn)


class FakeQuantInput(torch.nn.Module):
    """HF's linear layer with its input rounded to e4m3 as jaxpaged's W8A8 matmul rounds it: per token (its
    largest magnitude to 448), or by a static scale (saturating)."""

    def __init__(self, linear: torch.nn.Linear, input_scale: float | None):
        super().__init__()
        self.linear, self.input_scale = linear, input_scale

    def forward(self, x):
        if self.input_scale is None:
            scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / F8_MAX
            return self.linear(to_f8(x / scale).float() * scale)
        scale = torch.tensor(self.input_scale, dtype=torch.float32)
        return self.linear(to_f8((x / scale).clamp(-F8_MAX, F8_MAX)).float() * scale)


def quantize_weight(w: torch.Tensor, weights: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w f32[N, K] -> (f8[N, K], scales): per tensor f32[1], per channel f32[N, 1], or per 128 x 128 block
    f32[ceil(N/128), K/128] (vLLM's weight_scale_inv)."""
    if weights == "tensor":
        scale = w.abs().max().clamp(min=1e-12).reshape(1) / F8_MAX
        return to_f8(w / scale), scale
    if weights == "channel":
        scale = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / F8_MAX
        return to_f8(w / scale), scale
    n, k = w.shape
    rows = -(-n // 128)
    padded = torch.nn.functional.pad(w, (0, 0, 0, rows * 128 - n)).reshape(rows, 128, k // 128, 128)
    scale = padded.abs().amax((1, 3)).clamp(min=1e-12) / F8_MAX                        # [rows, K/128]
    full = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
    return to_f8(w / full), scale


def dequantize_weight(wq: torch.Tensor, scale: torch.Tensor, weights: str) -> torch.Tensor:
    n = wq.shape[0]
    if weights == "block":
        scale = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
    return wq.float() * scale


def write_fp8_checkpoint(case: Fp8Case, path: Path):
    """A tiny model; unless online, its linear weights replaced by the case's fp8 tensors. Returns HF's model
    with the weights jaxpaged computes with (dequantized) and, for W8A8, its inputs rounded as jaxpaged's."""
    from safetensors.torch import load_file, save_file
    hf = save_tiny(case.family, path, initializer_range=0.1)     # 5x HF's default: see W8A8_TOLERANCE
    tensors = load_file(str(path / "model.safetensors"))
    weights = "channel" if case.source == "online" else case.weights
    for name in linear_weight_names(tensors):
        prefix = name[:-len(".weight")]
        wq, scale = quantize_weight(tensors[name], weights)
        if case.source != "online":
            tensors[name] = wq
            scale_name = "weight_scale_inv" if weights == "block" else "weight_scale"
            tensors[f"{prefix}.{scale_name}"] = scale if weights != "tensor" or case.source != "fp8" else scale[0]
            if case.static:
                tensors[f"{prefix}.input_scale"] = torch.tensor([STATIC_INPUT_SCALE])
        module = hf.get_submodule(prefix)
        module.weight.data = dequantize_weight(wq, scale, weights)
        if weights != "block":               # W8A8: the input is rounded too (block-scaled weights run W8A16)
            parent, child = prefix.rsplit(".", 1)
            setattr(hf.get_submodule(parent), child,
                    FakeQuantInput(module, STATIC_INPUT_SCALE if case.static else None))
    if case.source != "online":
        save_file(tensors, str(path / "model.safetensors"))
        declare_quantization(path, case.quantization_config())
    return hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return built_once(tmp_path_factory, write_fp8_checkpoint)




@pytest.mark.parametrize("case", CASES, ids=str)
def test_fp8_equals_hf_on_the_same_rounding(checkpoints, case):
    """W8A16 (block-scaled weights, unquantized activations) within float tolerance; W8A8 within
    W8A8_TOLERANCE (the matmul itself is exact: test_fp8_matmul_equals_its_reference)."""
    path, hf = checkpoints(case)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=8, max_num_batched_tokens=16,
              quantization="fp8" if case.source == "online" else None)
    expected = {"block": "fp8-block128x128"}.get(case.weights, "fp8-static" if case.static else "fp8")
    assert set(dict(llm.llm_engine.model_config.weight_quant).values()) == {expected}
    check_against_hf(llm, hf, **({} if case.weights == "block" else W8A8_TOLERANCE))


@pytest.mark.parametrize("static", [False, True])
def test_fp8_matmul_equals_its_reference(static):
    """fp8_linear (fp8 operands into the dot, scales on the output) against the dequantized operands'
    float64 product: equal to float32 rounding, on random inputs with per-channel weight scales."""
    import jax.numpy as jnp

    from jaxpaged.quantization import fp8
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.float32)
    w, w_scale = fp8.quantize_per_channel(jnp.asarray(rng.standard_normal((256, 96)) * 0.1, jnp.float32))
    input_scale = jnp.float32(STATIC_INPUT_SCALE * 20) if static else None
    y = np.asarray(fp8.fp8_linear(x, w, w_scale, input_scale), np.float64)
    xq, x_scale = fp8.quantize_activations(x, input_scale)
    ref = (np.asarray(xq.astype(jnp.float32), np.float64) * np.asarray(x_scale, np.float64)) @ \
        (np.asarray(w.astype(jnp.float32), np.float64) * np.asarray(w_scale, np.float64)).T
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


def test_online_fp8_under_per_layer_weights(checkpoints):
    """The GPU's per-layer weights (a list of trees, as per_layer and unrolled dispatch load them) quantize at
    load as the stacked ones do."""
    path, hf = checkpoints(CASES[0])
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=8, quantization="fp8",
              layer_dispatch="unrolled")
    check_against_hf(llm, hf, **W8A8_TOLERANCE)


def test_fp8_weights_take_a_quarter_of_float32(checkpoints):
    """The linear layers' weights are one byte each (plus a scale per output channel)."""
    from jaxpaged.engine.cache_sizing import tree_bytes
    from jaxpaged.models.loader import load_model
    path, _ = checkpoints(CASES[0])
    dense, quant = (load_model(path, "float32", quantization=q).params["layers"] for q in (None, "fp8"))
    assert tree_bytes(quant) < 0.3 * tree_bytes(dense)


def test_unsupported_fp8_checkpoints_are_refused(checkpoints, tmp_path):
    path, _ = checkpoints(CASES[2])                                           # vLLM fp8, per tensor
    cfg = json.loads((path / "config.json").read_text())
    ct = CASES[5].quantization_config()
    w8a16 = {"group_0": {**ct["config_groups"]["group_0"], "input_activations": None}}
    for qc, message in [({**cfg["quantization_config"], "fmt": "e5m2"}, "fp8 format 'e5m2' is not supported"),
                        ({**cfg["quantization_config"], "weight_block_size": [128, 96]},
                         "blocks of 96 columns do not divide"),
                        ({**ct, "config_groups": w8a16}, "without quantized activations"),
                        ({**ct, "ignore": ["lm_head", "re:.*down_proj"]}, "unquantized decoder layers")]:
        with pytest.raises(ValueError, match=message):
            LLM(model=str(with_quant_config(path, tmp_path, qc)))
