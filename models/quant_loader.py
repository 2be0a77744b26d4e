"""Which linear layers a checkpoint keeps quantized, and their tensors in the decoder's params: int4 (AWQ,
GPTQ, compressed-tensors pack-quantized; jaxpaged/quantization/int4_formats.py), int8 (compressed-tensors W8A8
and W8A16; int8.py) and fp8 (vLLM's fp8 format,
compressed-tensors float-quantized, or a dense checkpoint quantized at load; jaxpaged/quantization/fp8.py).
GGUF blocks are models/loader.py's (gguf_weight_quant, gguf_blocks)."""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.config import QUANTIZATION_METHODS
from jaxpaged.quantization import fp8, int8
from jaxpaged.quantization.int4_formats import (INT4_METHODS, TENSORS, Int4Scheme, check_scheme, concat_outputs,
                                                device_layout, from_checkpoint, int4_scheme)

from .config import DecoderConfig
from .param_tables import FUSED_MODULES, LINEAR_MODULES

FP8_TENSORS = ("weight", "weight_scale", "weight_scale_inv", "input_scale")   # one fp8 layer's tensors
CHECKPOINT_KINDS = ("int4", "int8", "fp8")   # weight_quant prefixes of layers read from a checkpoint's tensors


def linear_inputs(cfg: DecoderConfig) -> dict[str, int]:
    """Each linear layer's input features."""
    return {"qkv_proj": cfg.hidden_size, "o_proj": cfg.num_heads * cfg.head_dim,
            "gate_up_proj": cfg.hidden_size, "down_proj": cfg.intermediate_size}


def checkpoint_quantization(hf_config: dict, quantization: str | None) -> str | None:
    """The quantization method a model runs with: the one asked for, else the one config.json's
    quantization_config declares (vLLM's detection). A declared method jaxpaged cannot read, or one that
    contradicts the request, is refused naming what is supported. quantization="fp8" on a dense checkpoint
    quantizes it at load."""
    declared = (hf_config.get("quantization_config") or {}).get("quant_method")
    supported = ", ".join(QUANTIZATION_METHODS)
    if declared is not None and declared not in QUANTIZATION_METHODS:
        raise ValueError(f"the checkpoint holds {declared!r}-quantized weights (config.json's quantization_config), "
                         f"which jaxpaged does not load; supported quantization: {supported}")
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {quantization!r} is not supported; supported: {supported}")
    if quantization in INT4_METHODS and declared != quantization:
        raise ValueError(f"quantization={quantization!r}, but config.json's quantization_config declares "
                         f"{declared!r}: the checkpoint must be {quantization}-quantized")
    if declared is not None and quantization not in (None, declared):
        raise ValueError(f"quantization={quantization!r} contradicts config.json's quantization_config "
                         f"({declared!r}); leave it unset to run the checkpoint as published")
    return quantization or declared


def _is_fp8(method: str, quant_config: dict | None) -> bool:
    """fp8 weights: vLLM's fp8 method, or compressed-tensors whose weights are floats."""
    if method == "fp8":
        return True
    groups = (quant_config or {}).get("config_groups") or {}
    return method == "compressed-tensors" and any((g.get("weights") or {}).get("type") == "float"
                                                  for g in groups.values())


def _weight_kind(method: str, quant_config: dict | None) -> str:
    """fp8, int8 or int4: what a quantized checkpoint's (or quantization="fp8"'s) linear weights are."""
    if _is_fp8(method, quant_config):
        return "fp8"
    return "int8" if quant_config is not None and int8.is_int8(quant_config) else "int4"


def weight_quant_of(method: str, quant_config: dict | None, cfg: DecoderConfig) -> tuple[tuple[str, str], ...]:
    """DecoderConfig.weight_quant for an int4, int8 or fp8 method: every linear layer in the checkpoint's scheme
    (quant_config None: a dense checkpoint that quantization="fp8" quantizes at load)."""
    inputs = linear_inputs(cfg)
    # modules a checkpoint leaves dense: AWQ's modules_to_not_convert, compressed-tensors' ignore
    kept = (quant_config or {}).get("modules_to_not_convert") or (quant_config or {}).get("ignore") or []
    if any("lm_head" not in m for m in kept):
        raise ValueError(f"{method} checkpoint keeps {[m for m in kept if 'lm_head' not in m]} unquantized: "
                         "unquantized decoder layers are not supported (only lm_head)")
    kind = _weight_kind(method, quant_config)
    if kind == "fp8":
        f8 = fp8.fp8_scheme(quant_config)
        if f8.block is not None and any(k % f8.block[1] for k in inputs.values()):
            raise ValueError(f"fp8 weight blocks of {f8.block[1]} columns do not divide the linear layers' "
                             f"inputs {sorted(set(inputs.values()))}")
        return tuple((linear, f8.name()) for linear in sorted(inputs))
    if kind == "int8":
        i8 = int8.int8_scheme(quant_config or {})
        for linear, k in inputs.items():
            int8.check_scheme(i8, linear, k)
        return tuple((linear, i8.name()) for linear in sorted(inputs))
    scheme = int4_scheme(quant_config or {})
    name = f"int4-g{scheme.group_size}" + ("-actorder" if scheme.act_order else "")
    for linear, k in inputs.items():
        check_scheme(scheme, linear, k)
    return tuple((linear, name) for linear in sorted(inputs))


def quantized_tensor_names(cfg: DecoderConfig, quant_config: dict | None) -> frozenset[str]:
    """The tensor names (the last part of an HF name) that a quantized checkpoint's linear layers hold; empty
    for dense weights and for weights quantized at load."""
    kinds = {q.split("-")[0] for _, q in cfg.weight_quant}
    if "int4" in kinds:
        return frozenset(sum(TENSORS[int4_scheme(quant_config or {}).method], ()))
    if "int8" in kinds:
        return frozenset(sum(int8.TENSORS[int8.int8_scheme(quant_config or {}).format], ()))
    if "fp8" in kinds and quant_config is not None:
        return frozenset(FP8_TENSORS)
    return frozenset()


def quantized_layer_params(tensors: dict[tuple[int, str], dict], cfg: DecoderConfig, dtype,
                           quant_config: dict) -> dict[tuple, list]:
    """A quantized checkpoint's tensors ((layer, HF module) -> {tensor name: numpy array}) -> (param path
    under a layer -> each layer's array) in the decoder's form, separate parts joined on the output dim (a
    layer the checkpoint stores fused, FUSED_MODULES, is one part)."""
    convert: Callable[[list[dict], list[str]], dict[str, np.ndarray]]
    kind = _weight_kind(quant_config.get("quant_method", ""), quant_config)
    if kind == "fp8":
        convert = functools.partial(_fp8_layer, scheme=fp8.fp8_scheme(quant_config))
    elif kind == "int8":
        convert = functools.partial(_int8_layer, scheme=int8.int8_scheme(quant_config))
    else:
        convert = functools.partial(_int4_layer, scheme=int4_scheme(quant_config))
    out: dict[tuple, list] = {}
    for path, modules in LINEAR_MODULES.items():
        if not (cfg.quant_of(path[-1]) or "").startswith(CHECKPOINT_KINDS):
            continue
        for i in range(cfg.num_layers):
            names = [FUSED_MODULES[path]] if (i, FUSED_MODULES.get(path)) in tensors else modules
            parts = [tensors.get((i, module), {}) for module in names]
            layer = convert(parts, [f"model.layers.{i}.{module}" for module in names])
            for key, value in layer.items():
                out.setdefault(path + (key,), []).append(jnp.asarray(value, _PARAM_DTYPES.get(key, dtype)))
    return out


# The params of quantized layers held in a dtype of their own (the rest, an int4 layer's scales among them, in the
# model's): an int4 layer's zeros are the checkpoint's integers; a layer's "weight" keeps the dtype its converter
# gives it (fp8 or int8)
_PARAM_DTYPES = {"qweight": jnp.int32, "perm": jnp.int32, "zeros": jnp.uint8, "weight": None,
                 "weight_scale": jnp.float32, "weight_zero": jnp.float32, "input_scale": jnp.float32}


def _require(parts: list[dict], where: list[str], names: tuple[str, ...], method: str) -> None:
    for t, w in zip(parts, where):
        if any(n not in t for n in names):
            raise ValueError(f"{method} checkpoint lacks {w}.{{{','.join(n for n in names if n not in t)}}}")


def _int4_layer(parts: list[dict], where: list[str], scheme: Int4Scheme) -> dict[str, np.ndarray]:
    _require(parts, where, TENSORS[scheme.method][0], scheme.method)
    weights = concat_outputs([from_checkpoint(t, scheme) for t in parts], where[0])
    return device_layout(weights, scheme.act_order)


def _int8_layer(parts: list[dict], where: list[str], scheme: int8.Int8Scheme) -> dict[str, np.ndarray]:
    required: tuple[str, ...] = int8.TENSORS[scheme.format][0]
    required += ("input_scale",) if scheme.static_input else ()
    required += () if scheme.symmetric else ("weight_zero_point",)
    _require(parts, where, required, "compressed-tensors int8")
    return int8.concat_outputs([int8.from_checkpoint(t, scheme) for t in parts], scheme)


def _fp8_layer(parts: list[dict], where: list[str], scheme: fp8.Fp8Scheme) -> dict[str, np.ndarray]:
    """fp8 parts -> weight f8[N, K], weight_scale f32[N, K/B] (per-tensor scales repeated per channel; block
    scales one row per channel), input_scale f32[] (static: the largest of the parts', as vLLM fuses them)."""
    scale_name = "weight_scale_inv" if scheme.block is not None else "weight_scale"
    _require(parts, where, ("weight", scale_name) + (("input_scale",) if scheme.static_input else ()),
             scheme.source)
    weights, scales = [], []
    for t in parts:
        w = t["weight"]
        n = w.shape[0]
        s = np.asarray(t[scale_name], np.float32)
        if scheme.block is not None:
            scales.append(fp8.expand_block_scales(s, scheme.block, n))
        else:
            scales.append(np.broadcast_to(s.reshape(-1, 1), (n, 1)))
        weights.append(w)
    out = {"weight": np.asarray(np.concatenate(weights), fp8.F8), "weight_scale": np.concatenate(scales)}
    if scheme.static_input:
        out["input_scale"] = np.asarray(max(float(np.max(t["input_scale"])) for t in parts), np.float32)
    return out


def quantize_online(layers: dict, cfg: DecoderConfig) -> None:
    """quantization="fp8" on a dense checkpoint, in place: each fp8 linear layer's kernel [K, N] (stacked
    [L, K, N], or a list of one per layer) -> weight f8[N, K] and weight_scale f32[N, 1], one scale per output
    channel; biases stay."""
    one = jax.jit(fp8.quantize_per_channel)
    stacked = jax.jit(jax.vmap(fp8.quantize_per_channel))
    for path in LINEAR_MODULES:
        if not (cfg.quant_of(path[-1]) or "").startswith("fp8"):
            continue
        node = layers
        for key in path:
            node = node[key]
        kernel = node.pop("kernel")
        if isinstance(kernel, list):
            pairs = [one(k) for k in kernel]
            node["weight"], node["weight_scale"] = [w for w, _ in pairs], [sc for _, sc in pairs]
        else:
            node["weight"], node["weight_scale"] = stacked(kernel)
