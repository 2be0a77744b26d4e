"""AWQ and GPTQ int4 checkpoints, written here in their published layouts from tiny random-weight models, load
as published and compute what HF transformers computes on the same weights dequantized (float32: prompt
logprobs within 1e-4, greedy tokens equal), through XLA and through the W4A16 Pallas kernel (interpreted)."""
from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import decode_traced_anew
from jaxpaged import LLM
from jaxpaged.quantization.int4_formats import AWQ_ORDER
from quant_cases import (SIZES, built_once, check_against_hf, declare_quantization, linear_weight_names,
                         save_tiny, with_quant_config)


@dataclasses.dataclass(frozen=True)
class Int4Case:
    family: str              # conftest.TINY_MODELS key
    method: str              # awq | gptq | compressed-tensors (pack-quantized)
    group_size: int          # -1: per output channel
    sym: bool = False        # symmetric: zero point 8 (GPTQ; compressed-tensors stores none)
    desc_act: bool = False   # act order (GPTQ's desc_act, compressed-tensors' actorder "group"): groups of a
                             # permutation of the input rows

    def __str__(self):
        return (f"{self.family}-{self.method}-g{self.group_size}" + ("-sym" if self.sym else "")
                + ("-actorder" if self.desc_act else ""))

    def quantization_config(self) -> dict:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": None}
        if self.method == "gptq":
            return {"quant_method": "gptq", "bits": 4, "group_size": self.group_size, "sym": self.sym,
                    "desc_act": self.desc_act, "checkpoint_format": "gptq"}
        weights = {"num_bits": 4, "type": "int", "symmetric": self.sym,
                   "strategy": "group" if self.group_size > 0 else "channel",
                   "group_size": self.group_size if self.group_size > 0 else None,
                   "actorder": "group" if self.desc_act else None}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": None}}}


CASES = [Int4Case("llama", "awq", 32), Int4Case("qwen2", "awq", 128), Int4Case("llama", "gptq", 64, sym=True),
         Int4Case("qwen3", "gptq", 32, desc_act=True), Int4Case("llama", "gptq", -1),
         Int4Case("llama", "compressed-tensors", 128, sym=True), Int4Case("qwen2", "compressed-tensors", 64),
         Int4Case("qwen3", "compressed-tensors", 32, desc_act=True),
         # modules fused in the checkpoint, quantized as one: GLM's gate_up_proj, Phi-3's qkv_proj and gate_up_proj
         Int4Case("glm", "awq", 64), Int4Case("phi3", "gptq", 32, desc_act=True)]


def quantize(w: np.ndarray, group: int, sym: bool, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w f32[K, N] -> (q u8[K, N], scales f16[K/G, N], zeros u8[K/G, N]): round-to-nearest per group of input
    rows, the groups cut from the rows in the order `rows` gives (a permutation with act order)."""
    k, n = w.shape
    wg = w[rows].reshape(k // group, group, n)
    if sym:
        scales = (np.abs(wg).max(1) / 7.0).astype(np.float16)
        zeros = np.full(scales.shape, 8, np.uint8)
    else:
        lo, hi = np.minimum(wg.min(1), 0), np.maximum(wg.max(1), 0)
        scales = ((hi - lo) / 15.0).astype(np.float16)
        zeros = np.clip(np.round(-lo / scales.astype(np.float32)), 0, 15).astype(np.uint8)
    s = scales.astype(np.float32)[:, None]
    q_sorted = np.clip(np.round(wg / s) + zeros[:, None], 0, 15).astype(np.uint8).reshape(k, n)
    q = np.empty_like(q_sorted)
    q[rows] = q_sorted
    return q, scales, zeros


def pack_columns(v: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """u8[R, N] -> i32[R, N/8]: nibble i of word c holds column 8c + order[i]."""
    words = np.zeros((v.shape[0], v.shape[1] // 8), np.uint32)
    for i, col in enumerate(order):
        words |= v[:, col::8].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def pack_rows(v: np.ndarray) -> np.ndarray:
    """u8[K, N] -> i32[K/8, N]: nibble j of row i holds input row 8i + j (GPTQ's qweight)."""
    return pack_columns(v.T).T.copy()


# Act order: GPTQ orders a layer's input rows by its input's statistics, so the layers that read one input
# (q, k and v; gate and up) share the permutation.
READS_INPUT_OF = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}


def input_of(prefix: str) -> str:
    """model.layers.0.self_attn.v_proj -> model.layers.0.self_attn.q_proj: the module whose input it reads."""
    parent, module = prefix.rsplit(".", 1)
    return f"{parent}.{READS_INPUT_OF.get(module, module)}"


def write_int4_checkpoint(case: Int4Case, path: Path):
    """A tiny model saved by transformers, its linear weights replaced by the case's packed tensors; returns
    HF's model carrying the dequantized weights (the reference)."""
    from safetensors.numpy import load_file, save_file
    hf = save_tiny(case.family, path)
    tensors = load_file(str(path / "model.safetensors"))
    for name in linear_weight_names(tensors):
        w = tensors.pop(name).T                                             # [K, N]
        group = case.group_size if case.group_size > 0 else w.shape[0]
        prefix = name[:-len(".weight")]
        rows = (np.random.default_rng(zlib.crc32(input_of(prefix).encode())).permutation(w.shape[0])
                if case.desc_act else np.arange(w.shape[0]))
        q, scales, zeros = quantize(w, group, case.sym, rows)
        g_of_row = np.empty(w.shape[0], np.int64)
        g_of_row[rows] = np.arange(w.shape[0]) // group
        if case.method == "awq":
            tensors[prefix + ".qweight"] = pack_columns(q, AWQ_ORDER)
            tensors[prefix + ".qzeros"] = pack_columns(zeros, AWQ_ORDER)
        elif case.method == "compressed-tensors":
            # packed by the library's own packer: signed int4 (value - 8), along the input dim; zero points
            # (asymmetric only) along the output dim
            from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
            signed = lambda v: torch.from_numpy(v.astype(np.int16) - 8).to(torch.int8)
            tensors[prefix + ".weight_packed"] = pack_to_int32(signed(q.T), 4).numpy()
            tensors[prefix + ".weight_shape"] = np.array([w.shape[1], w.shape[0]], np.int64)
            if not case.sym:
                tensors[prefix + ".weight_zero_point"] = pack_to_int32(signed(zeros.T), 4, packed_dim=0).numpy()
            if case.desc_act:
                tensors[prefix + ".weight_g_idx"] = g_of_row.astype(np.int32)
        else:
            tensors[prefix + ".qweight"] = pack_rows(q)
            tensors[prefix + ".qzeros"] = pack_columns((zeros - 1) & 15)     # the original format: zero - 1
            tensors[prefix + ".g_idx"] = g_of_row.astype(np.int32)
        if case.method == "compressed-tensors":
            tensors[prefix + ".weight_scale"] = np.ascontiguousarray(scales.T)      # [N, K/G]
        else:
            tensors[prefix + ".scales"] = scales
        dequant = (q.astype(np.float32) - zeros[g_of_row]) * scales.astype(np.float32)[g_of_row]
        hf.get_submodule(prefix).weight.data = torch.from_numpy(np.ascontiguousarray(dequant.T))
    save_file(tensors, str(path / "model.safetensors"))
    declare_quantization(path, case.quantization_config())
    return hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return built_once(tmp_path_factory, write_int4_checkpoint)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_int4_checkpoint_equals_hf_on_its_dequantized_weights(checkpoints, case):
    """The method is detected from config.json (no quantization argument), as vLLM does."""
    path, hf = checkpoints(case)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=8, max_num_batched_tokens=16)
    scheme = dict(llm.llm_engine.model_config.weight_quant)
    group = case.group_size if case.group_size > 0 else 0
    assert set(scheme.values()) == {f"int4-g{group}" + ("-actorder" if case.desc_act else "")}
    check_against_hf(llm, hf)


@pytest.mark.parametrize("dispatch", [{}, {"layer_dispatch": "unrolled", "num_scheduler_steps": 4}],
                         ids=["default", "unrolled"])
def test_the_w4a16_kernel_runs_inside_the_model(checkpoints, dispatch):
    """attention_backend="pallas" runs the Pallas kernels (interpreted here), the W4A16 matmul among them; also
    with every layer unrolled into one program of several decode steps (what a GPU runs for a 4-bit 8B model)."""
    case = CASES[1]                     # Qwen2: a dense bias beside the quantized q/k/v
    path, hf = checkpoints(case)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=8, max_num_batched_tokens=32,
              attention_backend="pallas", quantization="awq", **dispatch)
    assert llm.llm_engine.core.run.layer_dispatch == dispatch.get("layer_dispatch", "scan")
    check_against_hf(llm, hf)


def test_an_awq_checkpoint_in_chatglms_layout_loads_its_fused_modules(checkpoints, tmp_path):
    """ChatGLM2/3 and GLM-4 as THUDM published them, quantized with AWQ: q, k and v fused into
    query_key_value (its packed tensors joined on their output axis), dense, dense_h_to_4h (gate and up fused)
    and dense_4h_to_h quantized under ChatGLM's names, with ChatGLM's config.json (conftest.chatglm_layout and
    chatglm_config). Made from the GLM AWQ case, whose HF model carries the dequantized weights."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from conftest import chatglm_config, chatglm_layout
    case = next(c for c in CASES if c.family == "glm")
    path, hf = checkpoints(case)
    # AWQ packs and scales along the output axis, so q, k and v join on the last
    out = chatglm_layout(load_file(str(path / "model.safetensors")), hf.config.num_hidden_layers,
                         lambda parts: np.concatenate(parts, axis=-1))
    folder = tmp_path / "chatglm-awq"
    folder.mkdir()
    save_file(out, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(chatglm_config(hf.config)))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / f, folder)
    declare_quantization(folder, case.quantization_config())
    llm = LLM(model=str(folder), dtype="float32", max_model_len=128, block_size=8, max_num_batched_tokens=16)
    assert llm.llm_engine.model_config.architecture == "ChatGLMModel"
    assert set(dict(llm.llm_engine.model_config.weight_quant).values()) == {f"int4-g{case.group_size}"}
    check_against_hf(llm, hf)


def test_an_awq_baichuan_checkpoint_splits_its_quantized_w_pack(tmp_path):
    """Baichuan2-13B (ALiBi) quantized with AWQ, as AutoAWQ writes it: W_pack (q, k and v fused) is one
    quantized linear layer, whose packed columns the loader splits into q, k and v. Quantizing W_pack whole
    equals quantizing its three parts (AWQ's groups run along the input rows of each output column), so the
    reference is HF's Llama carrying each part's dequantized weights."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from conftest import save_tiny_baichuan
    from jaxpaged.engine.llm_engine import resolve_model_path
    case = Int4Case("baichuan", "awq", 32)
    hf = save_tiny_baichuan(tmp_path, alibi=True, hidden_size=SIZES["hidden_size"],
                            intermediate_size=SIZES["intermediate_size"])      # the kernel's 128-row slabs
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("W_pack.weight", "o_proj.weight", "gate_proj.weight",
                                                       "up_proj.weight", "down_proj.weight"))]:
        w = tensors.pop(name).T                                             # [K, N]
        prefix = name[:-len(".weight")]
        q, scales, zeros = quantize(w, case.group_size, False, np.arange(w.shape[0]))
        tensors[prefix + ".qweight"] = pack_columns(q, AWQ_ORDER)
        tensors[prefix + ".qzeros"] = pack_columns(zeros, AWQ_ORDER)
        tensors[prefix + ".scales"] = scales
        g_of_row = np.arange(w.shape[0]) // case.group_size
        dequant = torch.from_numpy(np.ascontiguousarray(
            ((q.astype(np.float32) - zeros[g_of_row]) * scales.astype(np.float32)[g_of_row]).T))
        if prefix.endswith("W_pack"):
            attn = hf.hf.get_submodule(prefix.rsplit(".", 1)[0])
            for part, weight in zip((attn.q_proj, attn.k_proj, attn.v_proj), dequant.chunk(3)):
                part.weight.data = weight.contiguous()
        else:
            hf.hf.get_submodule(prefix).weight.data = dequant
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(resolve_model_path(None)) / f, tmp_path)
    declare_quantization(tmp_path, case.quantization_config())
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=128, block_size=8, max_num_batched_tokens=16)
    assert llm.llm_engine.model_config.architecture == "BaichuanForCausalLM"
    assert set(dict(llm.llm_engine.model_config.weight_quant).values()) == {f"int4-g{case.group_size}"}
    check_against_hf(llm, hf)


def test_inconsistent_or_unsupported_int4_checkpoints_are_refused(checkpoints, tmp_path):
    path, _ = checkpoints(CASES[0])                                           # an AWQ checkpoint
    with pytest.raises(ValueError, match="contradicts config.json's quantization_config"):
        LLM(model=str(path), quantization="gguf")
    with pytest.raises(ValueError, match="'gptq', but config.json's quantization_config declares 'awq'"):
        LLM(model=str(path), quantization="gptq")
    cfg = json.loads((path / "config.json").read_text())
    ct = CASES[5].quantization_config()
    for change, message in [({"bits": 8}, "8-bit weights is not supported"),
                            ({"version": "gemv"}, "AWQ version 'gemv' is not supported"),
                            ({"group_size": 96}, "group size 96"),
                            ({"quant_method": "hqq"}, "'hqq'-quantized weights .* supported quantization: awq, "
                                                      "compressed-tensors, fp8, gguf, gptq"),
                            ({**ct, "format": "float-quantized"}, "compressed-tensors format 'float-quantized'"),
                            ({**ct, "config_groups": {"g": {**ct["config_groups"]["group_0"], "input_activations":
                                                            {"num_bits": 8}}}}, "quantized activations")]:
        with pytest.raises(ValueError, match=message):
            LLM(model=str(with_quant_config(path, tmp_path, {**cfg["quantization_config"], **change})))


def test_fused_layers_must_share_their_input_grouping():
    """q, k and v run as one matmul: act-order checkpoints whose parts permute the input differently are
    refused at load, naming the layer."""
    from jaxpaged.quantization.int4_formats import Int4Weight, concat_outputs
    part = lambda g_idx: Int4Weight(np.zeros((4, 8), np.uint8), np.ones((2, 8), np.float32),
                                    np.zeros((2, 8), np.float32), np.asarray(g_idx, np.int32))
    joined = concat_outputs([part([0, 0, 1, 1]), part([0, 0, 1, 1])], "layer 0 qkv_proj")
    assert joined.q.shape == (4, 16) and joined.g_idx.tolist() == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="layer 0 qkv_proj: the fused parts group the input rows differently"):
        concat_outputs([part([0, 0, 1, 1]), part([0, 1, 0, 1])], "layer 0 qkv_proj")


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_the_server_flag_reaches_the_engine_args(method):
    from jaxpaged.server.cli import engine_args_from, make_parser
    args = engine_args_from(make_parser().parse_args(["--quantization", method]))
    assert args.quantization == method


ALL_KERNELS = ["rms_norm_gemv_x", "rope_qkv", "silu_mul_gemv_x"]
TRACED = ["rms_norm_gemv_x", "rope_qkv+kv_write", "silu_mul_gemv_x"]


# One case with its layers unrolled (the GPU's dispatch); the others under the layer scan, whose program holds each
# interpreted kernel once rather than once a layer (it compiles in half the time; the kernels are the same).
@pytest.mark.parametrize("case,kernels,dispatch", [
    (CASES[0], TRACED, "unrolled"), (CASES[1], TRACED, "scan"), (CASES[3], ["rope_qkv+kv_write"], "scan"),
    (CASES[8], ["rms_norm_gemv_x", "silu_mul_gemv_x"], "scan"), (CASES[9], ["rope_qkv+kv_write"], "scan"),
    (Int4Case("gemma2", "awq", 64), TRACED[:2], "scan")],
    ids=["llama-awq-g32", "qwen2-awq-g128", "qwen3-gptq-actorder", "glm-awq-g64", "phi3-gptq-actorder",
         "gemma2-awq-g64"])
def test_the_operand_kernels_give_a_4bit_decode_row_what_xla_gives(checkpoints, monkeypatch, case, kernels,
                                                                   dispatch):
    """In float16 (the half-precision dtype the CPU's Pallas attention takes: its bf16 pool is held as uint16), one
    request's decode steps through the Pallas kernels (interpreted), with the kernels around the W4A16 GEMVs
    (pallas_kernels/int4_operands.py) on against all off: the greedy tokens and their logprobs are those XLA
    computes (to half precision's tolerance). Llama's and Qwen2's (q/k/v's bias) take all three: the norms before
    q/k/v and gate/up as rms_norm_gemv_x, the MLP's product as silu_mul_gemv_x (gate/up in one split), q, k and v
    as rope_qkv, which also stores k and v into the pool (ROPE_WRITES_KV); Qwen3's with act order only rope_qkv,
    with its q/k norms (ROPE_QK_NORM): act order permutes x's rows, so its norms and product keep XLA's; so
    do Phi-3's (LongRoPE through rope_qkv); GLM's norms and product take the kernels, its RoPE (on half of each
    head, adjacent pairs) XLA's; Gemma 2's norms ((1 + w), four a layer) and RoPE take them, its GELU product
    XLA's."""
    import jaxpaged.models.decoder as decoder
    path, _ = checkpoints(case)
    prompt = {"prompt_token_ids": np.random.default_rng(2).integers(0, 320, 11).tolist()}
    calls: dict[str, int] = {}
    for name in ALL_KERNELS:
        kernel = getattr(decoder, name)
        monkeypatch.setattr(decoder, name, lambda *a, _k=kernel, _n=name, **kw: calls.update(
            {_n + ("+kv_write" if kw.get("kv_write") is not None else ""): 1}) or _k(*a, **kw))

    def run(on: bool):
        for switch in ("INT4_NORM_KERNEL", "INT4_SILU_KERNEL", "INT4_ROPE_KERNEL", "ROPE_QK_NORM",
                       "ROPE_WRITES_KV"):
            monkeypatch.setattr(decoder, switch, on)
        calls.clear()
        tokens, logprobs = decode_traced_anew(path, prompt, dtype="float16", max_model_len=128, block_size=8,
                                              max_num_batched_tokens=32, attention_backend="pallas",
                                              quantization=case.method, layer_dispatch=dispatch)
        return sorted(calls), tokens, logprobs
    traced, xla_tokens, xla_lps = run(False)
    assert traced == []
    traced, tokens, lps = run(True)
    assert traced == kernels            # traced into the decode step's program
    assert tokens == xla_tokens
    np.testing.assert_allclose(lps, xla_lps, rtol=0, atol=0.05)


def test_a_prefill_expands_each_4bit_layer_in_its_turn(checkpoints, monkeypatch):
    """EXPAND_IN_TURN: each 4-bit linear layer's expansion for XLA's dot waits behind an optimization barrier on the
    layer's input, so an unrolled step holds one layer's expanded weights at a time (on the H100, XLA otherwise
    expanded later layers ahead of their turn: a 16,384-token llama3-8b AWQ step's temporaries 10.51 GiB, with
    the barrier 1.46 GiB, as bf16's). XLA:CPU does not hoist them, so this reads the lowered step: one barrier a
    quantized layer (q/k/v, o, gate/up, down) in the layer's body, none with the switch off."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.models import decoder, load_model
    from paged_runner import PagedRunner

    path, _ = checkpoints(CASES[0])
    runner = PagedRunner(load_model(path, dtype="float32"), num_blocks=64)

    def barriers(on: bool) -> int:
        monkeypatch.setattr(decoder, "EXPAND_IN_TURN", on)
        ids = jnp.arange(16, dtype=jnp.int32)
        lowered = jax.jit(runner.model.apply).lower({"params": runner.params}, ids, runner.kv, runner.meta(16),
                                                   jnp.arange(16, dtype=jnp.int32))
        return lowered.as_text().count("optimization_barrier")

    assert barriers(True) - barriers(False) == 4 and barriers(False) == 0
