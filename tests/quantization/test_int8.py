"""int8 weights from compressed-tensors checkpoints written here from tiny random-weight models: W8A8
("int-quantized": channel or tensor weight scales, activations per token or by a static scale) and W8A16
("pack-quantized" 8-bit, packed by the library's own packer: channel or group scales, symmetric or not). Each
computes what HF transformers computes with the same weights dequantized and, for W8A8, the same int8 rounding
of each linear layer's input."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from jaxpaged import LLM
from quant_cases import (W8A8_TOLERANCE, built_once, check_against_hf, declare_quantization, linear_weight_names,
                         save_tiny, with_quant_config)

STATIC_INPUT_SCALE = 0.05     # int8's range covers |x| <= 6.35: the tiny models' normed inputs stay inside


@dataclasses.dataclass(frozen=True)
class Int8Case:
    family: str
    activations: bool            # W8A8 (int-quantized), else W8A16 (pack-quantized)
    strategy: str                # W8A8: channel | tensor; W8A16: channel | group
    static: bool = False         # W8A8: the checkpoint's input_scale, else per token
    sym: bool = True             # W8A16: symmetric (no zero points)
    group_size: int = 64

    def __str__(self):
        kind = "w8a8" if self.activations else "w8a16"
        return (f"{self.family}-{kind}-{self.strategy}" + ("-static" if self.static else "")
                + ("" if self.sym else "-asym"))

    def quantization_config(self) -> dict:
        weights = {"num_bits": 8, "type": "int", "strategy": self.strategy, "symmetric": self.sym,
                   "dynamic": False, "group_size": self.group_size if self.strategy == "group" else None}
        acts = None
        if self.activations:
            acts = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": not self.static,
                    "strategy": "tensor" if self.static else "token"}
        return {"quant_method": "compressed-tensors", "ignore": ["lm_head"],
                "format": "int-quantized" if self.activations else "pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": acts}}}

    def scheme_name(self) -> str:
        if self.activations:
            return "int8-static" if self.static else "int8"
        group = self.group_size if self.strategy == "group" else 0
        return f"int8-w8a16-g{group}" + ("" if self.sym else "-asym")


CASES = [Int8Case("llama", True, "channel"), Int8Case("qwen2", True, "tensor", static=True),
         Int8Case("qwen3", False, "group"), Int8Case("llama", False, "channel", sym=False),
         Int8Case("qwen2", False, "group", sym=False)]


class FakeQuantInput(torch.nn.Module):
    """HF's linear layer with its input rounded to int8 as jaxpaged's W8A8 matmul rounds it: per token (its
    largest magnitude to 127), or by a static scale (saturating); ties to even on both sides."""

    def __init__(self, linear: torch.nn.Linear, input_scale: float | None):
        super().__init__()
        self.linear, self.input_scale = linear, input_scale

    def forward(self, x):
        if self.input_scale is None:
            scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127.0
        else:
            scale = torch.tensor(self.input_scale, dtype=torch.float32)
        return self.linear(torch.round(x / scale).clamp(-128, 127) * scale)


def quantize_weight(w: torch.Tensor, case: Int8Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w f32[N, K] -> (q i8[N, K], scale f32[N, K/G] or [1], zero i8[N, K/G] or None)."""
    n, k = w.shape
    cols = case.group_size if case.strategy == "group" else k
    wg = w.reshape(n, k // cols, cols) if case.strategy != "tensor" else w.reshape(1, 1, -1)
    if case.sym:
        scale = wg.abs().amax(-1).clamp(min=1e-12) / 127.0
        zero = None
        q = torch.round(wg / scale[..., None]).clamp(-128, 127)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = (hi - lo).clamp(min=1e-12) / 255.0
        zero = torch.round(-128 - lo / scale).clamp(-128, 127)
        q = torch.round(wg / scale[..., None] + zero[..., None]).clamp(-128, 127)
    q = q.reshape(n, k).to(torch.int8)
    return q, (scale.reshape(1) if case.strategy == "tensor" else scale), (
        None if zero is None else zero.to(torch.int8))


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    n, k = q.shape
    groups = scale.shape[-1] if scale.dim() == 2 else 1
    s = scale.reshape(-1, groups).expand(n, groups)
    z = torch.zeros_like(s) if zero is None else zero.float()
    w = (q.float().reshape(n, groups, k // groups) - z[..., None]) * s[..., None]
    return w.reshape(n, k)


def write_int8_checkpoint(case: Int8Case, path: Path):
    """A tiny model whose linear weights are replaced by the case's int8 tensors. Returns HF's model with the
    weights dequantized and, for W8A8, its inputs rounded as jaxpaged's."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import load_file, save_file
    hf = save_tiny(case.family, path, initializer_range=0.1)     # 5x HF's default, as the fp8 suite
    tensors = load_file(str(path / "model.safetensors"))
    for name in linear_weight_names(tensors):
        prefix = name[:-len(".weight")]
        q, scale, zero = quantize_weight(tensors[name], case)
        del tensors[name]
        if case.activations:
            tensors[f"{prefix}.weight"] = q
            if case.static:
                tensors[f"{prefix}.input_scale"] = torch.tensor([STATIC_INPUT_SCALE])
        else:
            tensors[f"{prefix}.weight_packed"] = pack_to_int32(q, 8)
            tensors[f"{prefix}.weight_shape"] = torch.tensor(list(q.shape))
            if zero is not None:
                tensors[f"{prefix}.weight_zero_point"] = pack_to_int32(zero, 8, packed_dim=0).contiguous()
        tensors[f"{prefix}.weight_scale"] = scale.contiguous()
        module = hf.get_submodule(prefix)
        module.weight.data = dequantize_weight(q, scale, zero)
        if case.activations:
            parent, child = prefix.rsplit(".", 1)
            setattr(hf.get_submodule(parent), child,
                    FakeQuantInput(module, STATIC_INPUT_SCALE if case.static else None))
    save_file(tensors, str(path / "model.safetensors"))
    declare_quantization(path, case.quantization_config())
    return hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return built_once(tmp_path_factory, write_int8_checkpoint)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_int8_equals_hf_on_the_same_rounding(checkpoints, case):
    """The method is detected from config.json. W8A16 within float tolerance; W8A8 within W8A8_TOLERANCE (a
    rounding of an activation can flip on a 1e-7 difference upstream; the matmul itself is exact:
    test_int8_matmul_equals_its_reference)."""
    path, hf = checkpoints(case)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=8, max_num_batched_tokens=16)
    assert set(dict(llm.llm_engine.model_config.weight_quant).values()) == {case.scheme_name()}
    check_against_hf(llm, hf, **(W8A8_TOLERANCE if case.activations else {}))


@pytest.mark.parametrize("static", [False, True])
def test_int8_matmul_equals_its_reference(static):
    """int8_linear (int8 operands into the dot with an int32 result, scales on the output) against the
    dequantized operands' float64 product, on random inputs with per-channel weight scales."""
    import jax.numpy as jnp

    from jaxpaged.quantization import int8
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.float32)
    w = rng.integers(-128, 128, (96, 256)).astype(np.int8)
    w_scale = rng.uniform(1e-3, 2e-3, (96, 1)).astype(np.float32)
    input_scale = jnp.float32(0.02) if static else None
    y = np.asarray(int8.int8_linear(x, jnp.asarray(w), jnp.asarray(w_scale), None, input_scale), np.float64)
    xq, x_scale = int8.quantize_activations(x, input_scale)
    ref = (np.asarray(xq, np.float64) * np.asarray(x_scale, np.float64)) @ (w.astype(np.float64) * w_scale).T
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


def test_int8_weights_take_a_quarter_of_float32(checkpoints):
    """Each int8 linear layer's params (weight, scales) are about a quarter of its float32 weight's bytes."""
    import jax

    from jaxpaged.models.loader import load_model
    path, _ = checkpoints(CASES[2])                       # W8A16, a scale per 64 inputs
    layers = load_model(path, "float32").params["layers"]
    linears = [v for v in jax.tree_util.tree_leaves(layers, is_leaf=lambda t: isinstance(t, dict) and "weight" in t)
               if isinstance(v, dict)]
    assert len(linears) == 4 and all(v["weight"].dtype == np.int8 for v in linears)
    for v in linears:
        assert sum(t.nbytes for t in v.values()) < 0.3 * v["weight"].size * 4


def test_unsupported_int8_checkpoints_are_refused(checkpoints, tmp_path):
    path, _ = checkpoints(CASES[0])
    ct = CASES[0].quantization_config()
    group = ct["config_groups"]["group_0"]
    w8a16 = CASES[2].quantization_config()
    for qc, message in [
            ({**ct, "config_groups": {"g": {**group, "input_activations": {**group["input_activations"],
                                                                          "symmetric": False}}}},
             "int8 activations .* not supported"),
            ({**ct, "config_groups": {"g": {**group, "weights": {**group["weights"], "strategy": "group"}}}},
             "int8 weights .* not supported"),
            ({**w8a16, "config_groups": {"g": {**w8a16["config_groups"]["group_0"], "weights": {
                **w8a16["config_groups"]["group_0"]["weights"], "actorder": "group"}}}},
             "int8 weights .* not supported"),
            ({**w8a16, "config_groups": {"g": {**w8a16["config_groups"]["group_0"], "weights": {
                **w8a16["config_groups"]["group_0"]["weights"], "group_size": 96}}}}, "group size 96"),
            ({**ct, "format": "naive-quantized"}, "format 'naive-quantized' with 8-bit int weights")]:
        with pytest.raises(ValueError, match=message):
            LLM(model=str(with_quant_config(path, tmp_path, qc)))
