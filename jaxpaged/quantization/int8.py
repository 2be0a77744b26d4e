"""int8 weights, read as published from compressed-tensors checkpoints:
  W8A8   format "int-quantized": weight i8[N, K] with weight_scale [N, 1] (channel) or [1] (tensor), symmetric;
         activations int8, per token at run time (dynamic) or by the checkpoint's per-tensor input_scale.
  W8A16  format "pack-quantized" with 8-bit weights: weight_packed i32[N, K/4], four values a word, the lowest
         byte first, each stored + 128 (signed -> 0..255); weight_scale [N, K/G] (group) or [N, 1] (channel);
         asymmetric schemes add weight_zero_point i32[N/4, K/G], packed the same way along the output dim.

One device form per linear layer:
    weight: i8[N, K]
    weight_scale: f32[N, K/G]       W[n, k] = (weight[n, k] - weight_zero[n, k // G]) * weight_scale[n, k // G];
                                    G = K: one scale per output channel (a per-tensor scale repeated)
    weight_zero: f32[N, K/G]        (asymmetric W8A16 only)
    input_scale: f32[]              (static W8A8 only)
The matmul (int8_linear): W8A8 rounds x to int8 (per token, or by input_scale) and puts both int8 operands into
the dot with an int32 result, the form XLA gives to cuBLAS's int8 GEMM, then applies the scales to the output.
W8A16 expands the weight to the compute dtype in the program and multiplies x unquantized: it saves the
weights' memory, not decode time (XLA writes the expanded weight out and reads it again).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.pallas_kernels import dot_precision

I8_MAX = 127.0
_MIN_SCALE = 1e-12        # an all-zero row keeps a finite scale
# The tensors of one linear layer, required first, then optional ones, by format.
TENSORS = {"int-quantized": (("weight", "weight_scale"), ("input_scale",)),
           "pack-quantized": (("weight_packed", "weight_scale"), ("weight_zero_point", "weight_shape"))}


class Int8Scheme(NamedTuple):
    """What a model's int8 linear layers are."""
    activations: bool       # W8A8 (activations int8 too), else W8A16
    static_input: bool      # W8A8 with the checkpoint's input_scale, else per token at run time
    group_size: int         # W8A16: input columns per scale; 0: one scale per output channel
    symmetric: bool         # W8A16: no zero points

    def name(self) -> str:
        """The weight_quant string of DecoderConfig: int8 (W8A8), int8-static, int8-w8a16-g<G>[-asym]."""
        if self.activations:
            return "int8-static" if self.static_input else "int8"
        return f"int8-w8a16-g{self.group_size}" + ("" if self.symmetric else "-asym")

    @property
    def format(self) -> str:
        return "int-quantized" if self.activations else "pack-quantized"


def parse_scheme_name(name: str) -> Int8Scheme:
    """weight_quant string -> Int8Scheme (the inverse of Int8Scheme.name)."""
    if not name.startswith("int8-w8a16"):
        return Int8Scheme(True, name == "int8-static", 0, True)
    group, _, asym = name[len("int8-w8a16-g"):].partition("-")
    return Int8Scheme(False, False, int(group), asym != "asym")


def is_int8(quant_config: dict | None) -> bool:
    """compressed-tensors whose weights are 8-bit integers."""
    if quant_config is None or quant_config.get("quant_method") != "compressed-tensors":
        return False
    groups = (quant_config.get("config_groups") or {}).values()
    return any((g.get("weights") or {}).get("type", "int") == "int" and (g.get("weights") or {}).get("num_bits") == 8
               for g in groups)


def int8_scheme(quant_config: dict) -> Int8Scheme:
    """The scheme of a compressed-tensors int8 quantization_config; ValueError naming what is supported."""
    supported = ("supported compressed-tensors int8: int-quantized W8A8 (symmetric channel or tensor weight "
                 "scales, symmetric activations dynamic per token or static per tensor) and pack-quantized W8A16 "
                 "(channel or group weight scales, symmetric or not)")
    groups = list((quant_config.get("config_groups") or {}).values())
    fmt = quant_config.get("format")
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors with {len(groups)} config groups is not supported ({supported})")
    weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations")
    if fmt == "int-quantized":
        if not weights.get("symmetric", True) or weights.get("strategy") not in ("channel", "tensor"):
            raise ValueError(f"compressed-tensors int8 weights {weights} are not supported ({supported})")
        if acts is None or acts.get("num_bits") != 8 or acts.get("type", "int") != "int" or \
                not acts.get("symmetric", True) or acts.get("strategy") not in ("token", "tensor"):
            raise ValueError(f"compressed-tensors int8 activations {acts} are not supported ({supported})")
        return Int8Scheme(True, not acts.get("dynamic", True), 0, True)
    if fmt == "pack-quantized":
        if acts is not None:
            raise ValueError(f"pack-quantized int8 weights with quantized activations are not supported "
                             f"({supported})")
        strategy = weights.get("strategy")
        if strategy not in ("channel", "group") or weights.get("actorder"):
            raise ValueError(f"compressed-tensors int8 weights {weights} are not supported ({supported})")
        group = int(weights.get("group_size") or 0) if strategy == "group" else 0
        return Int8Scheme(False, False, group, bool(weights.get("symmetric", True)))
    raise ValueError(f"compressed-tensors format {fmt!r} with 8-bit int weights is not supported ({supported})")


def check_scheme(scheme: Int8Scheme, name: str, in_features: int) -> None:
    if scheme.group_size and in_features % scheme.group_size:
        raise ValueError(f"int8 layer {name}: group size {scheme.group_size} does not divide its "
                         f"{in_features} inputs")


def _bytes(words: np.ndarray) -> np.ndarray:
    """i32[..., W] -> i8[..., 4W]: each word's four bytes, lowest first, less the stored offset of 128."""
    b = (words.astype(np.uint32)[..., None] >> np.arange(0, 32, 8, dtype=np.uint32)) & 255
    return (b.astype(np.int16) - 128).astype(np.int8).reshape(*words.shape[:-1], -1)


def from_checkpoint(t: dict[str, np.ndarray], scheme: Int8Scheme) -> dict[str, np.ndarray]:
    """One linear layer's tensors (TENSORS[scheme.format] by name) -> the device form's arrays (weight_scale
    per output channel, zeros as floats)."""
    out: dict[str, np.ndarray]
    if scheme.activations:
        weight = np.asarray(t["weight"], np.int8)
        n = weight.shape[0]
        scale = np.broadcast_to(np.asarray(t["weight_scale"], np.float32).reshape(-1, 1), (n, 1))
        out = {"weight": weight, "weight_scale": np.ascontiguousarray(scale)}
        if scheme.static_input:
            out["input_scale"] = np.asarray(t["input_scale"], np.float32).reshape(())
        return out
    n = t["weight_packed"].shape[0]
    k = int(t["weight_shape"][1]) if "weight_shape" in t else t["weight_packed"].shape[1] * 4
    out = {"weight": _bytes(t["weight_packed"])[:, :k], "weight_scale": np.asarray(t["weight_scale"], np.float32)}
    if not scheme.symmetric:
        out["weight_zero"] = _bytes(t["weight_zero_point"].T).T[:n].astype(np.float32)
    return out


def concat_outputs(parts: list[dict[str, np.ndarray]], scheme: Int8Scheme) -> dict[str, np.ndarray]:
    """Parts of one fused layer (q, k, v; gate, up) joined on the output dim; static input scales fused to
    the largest of the parts' (vLLM's choice: no part's input saturates)."""
    out = {key: np.concatenate([p[key] for p in parts]) for key in parts[0] if key != "input_scale"}
    if scheme.static_input:
        out["input_scale"] = np.asarray(max(float(p["input_scale"]) for p in parts), np.float32)
    return out


def quantize_activations(x: jax.Array, input_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (i8[M, K], f32[M, 1] or f32[]): per token from its largest magnitude, or by the static
    input_scale; rounded to nearest (ties to even), saturating."""
    x = x.astype(jnp.float32)
    if input_scale is None:
        scale = jnp.maximum(jnp.max(jnp.abs(x), axis=1, keepdims=True), _MIN_SCALE) / I8_MAX
    else:
        scale = input_scale.astype(jnp.float32)
    return jnp.clip(jnp.round(x / scale), -I8_MAX - 1, I8_MAX).astype(jnp.int8), scale


def dequantize(weight: jax.Array, weight_scale: jax.Array, weight_zero: jax.Array | None, dtype) -> jax.Array:
    """i8[N, K] with scales (and zeros) f32[N, K/G] -> dtype[N, K]."""
    n, k = weight.shape
    groups = weight_scale.shape[1]
    w = weight.astype(jnp.float32).reshape(n, groups, k // groups)
    if weight_zero is not None:
        w = w - weight_zero[:, :, None]
    return (w * weight_scale[:, :, None]).reshape(n, k).astype(dtype)


def int8_linear(x: jax.Array, weight: jax.Array, weight_scale: jax.Array, weight_zero: jax.Array | None = None,
                input_scale: jax.Array | None = None, activations: bool = True) -> jax.Array:
    """x dtype[M, K] @ W -> dtype[M, N] for the device form above."""
    if not activations:
        w = dequantize(weight, weight_scale, weight_zero, x.dtype)
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=dot_precision(x.dtype))
    xq, sx = quantize_activations(x, input_scale)
    y = jax.lax.dot_general(xq, weight, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    return (y.astype(jnp.float32) * sx * weight_scale[:, 0]).astype(x.dtype)
