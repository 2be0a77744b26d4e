"""fp8 (e4m3) weights: quantized at load from a dense checkpoint (`quantization="fp8"`, vLLM's online fp8), or
read as published from fp8 checkpoints (vLLM's `fp8` format, per-tensor or block-scaled; compressed-tensors
`float-quantized`).

One device form for every source, per linear layer:
    weight: f8e4m3fn[N, K]          K-major, the layout cuBLASLt's fp8 GEMM takes
    weight_scale: f32[N, K/B]       W[n, k] = weight[n, k] * weight_scale[n, k // B]; B = K (one scale per
                                    output channel; a per-tensor scale repeated) or the checkpoint's block
    input_scale: f32[]              (static activation scales only) the checkpoint's scale for x
The matmul (fp8_linear): with one scale per channel, x is quantized to e4m3 (per token, dynamically, or by
the static input_scale) and the fp8 operands go straight into the dot, its result in the compute dtype and the
scales applied to it: that is the form XLA lowers to cuBLASLt's fp8 GEMM on Hopper (bench/fp8_probe.py), given
a multiple of 16 rows (x is padded to one); converting the operands before the dot never is. Block-scaled
weights (scales that vary along K) are expanded to the compute dtype in the program and multiply unquantized x
(W8A16).
"""
from __future__ import annotations

import functools
import json
import os
import struct
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.pallas_kernels import dot_precision

F8 = jnp.float8_e4m3fn
F8_MAX = 448.0            # the largest finite e4m3fn value
FP8_GEMM_ROWS = 16        # x's rows are padded to a multiple of this for the fp8 GEMM
_MIN_SCALE = 1e-12        # an all-zero row or tensor keeps a finite scale


class Fp8Scheme(NamedTuple):
    """What a model's fp8 linear layers are."""
    source: str                 # online | fp8 | compressed-tensors: where the weights come from
    static_input: bool          # activations scaled by the checkpoint's input_scale, else per token at run time
    block: tuple[int, int] | None   # (rows, cols) of one weight scale's block (vLLM's weight_block_size)

    def name(self) -> str:
        """The weight_quant string of DecoderConfig: fp8, fp8-static, fp8-block<r>x<c>."""
        if self.block is not None:
            return f"fp8-block{self.block[0]}x{self.block[1]}"
        return "fp8-static" if self.static_input else "fp8"


def parse_scheme_name(name: str) -> tuple[bool, int | None]:
    """weight_quant string -> (static input scale, block columns or None)."""
    if name.startswith("fp8-block"):
        return False, int(name[len("fp8-block"):].split("x")[1])
    return name == "fp8-static", None


def fp8_scheme(quant_config: dict | None) -> Fp8Scheme:
    """The fp8 scheme of a checkpoint's quantization_config, or of a dense checkpoint quantized at load
    (None); ValueError naming what is supported otherwise."""
    if quant_config is None:
        return Fp8Scheme("online", False, None)
    method = quant_config.get("quant_method")
    if method == "fp8":
        if quant_config.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 format {quant_config.get('fmt')!r} is not supported (supported: e4m3)")
        block = quant_config.get("weight_block_size")
        static = quant_config.get("activation_scheme", "dynamic") == "static"
        if block is not None and static:
            raise ValueError("block-scaled fp8 with static activation scales is not supported")
        return Fp8Scheme("fp8", static, (int(block[0]), int(block[1])) if block else None)
    if method == "compressed-tensors":
        supported = ("supported compressed-tensors fp8: float-quantized (or naive-quantized) 8-bit float weights "
                     "with tensor or channel scales, activations dynamic per token or static per tensor")
        groups = list((quant_config.get("config_groups") or {}).values())
        if quant_config.get("format") not in ("float-quantized", "naive-quantized") or len(groups) != 1:
            raise ValueError(f"compressed-tensors format {quant_config.get('format')!r} with {len(groups)} "
                             f"config groups is not supported ({supported})")
        weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations")
        if weights.get("num_bits") != 8 or weights.get("type") != "float" or \
                weights.get("strategy") not in ("tensor", "channel"):
            raise ValueError(f"compressed-tensors weights {weights} are not supported ({supported})")
        if acts is None:
            raise ValueError(f"compressed-tensors fp8 weights without quantized activations (W8A16) are not "
                             f"supported ({supported})")
        if acts.get("num_bits") != 8 or acts.get("type") != "float":
            raise ValueError(f"compressed-tensors activations {acts} are not supported ({supported})")
        return Fp8Scheme("compressed-tensors", not acts.get("dynamic", True), None)
    raise ValueError(f"quant_method {method!r} is not an fp8 format")


def quantize_per_channel(w_kn: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A dense weight [K, N] (the decoder's kernel layout) -> (f8[N, K], f32[N, 1]): one scale per output
    channel, its largest magnitude mapped to e4m3's largest value."""
    w = w_kn.astype(jnp.float32).T
    scale = jnp.maximum(jnp.max(jnp.abs(w), axis=1, keepdims=True), _MIN_SCALE) / F8_MAX
    return (w / scale).astype(F8), scale


def quantize_activations(x: jax.Array, input_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (f8[M, K], f32[M, 1] or f32[]): per token from its largest magnitude, or by the static
    input_scale (values beyond e4m3's range saturate)."""
    x = x.astype(jnp.float32)
    if input_scale is None:
        scale = jnp.maximum(jnp.max(jnp.abs(x), axis=1, keepdims=True), _MIN_SCALE) / F8_MAX
    else:
        scale = input_scale.astype(jnp.float32)
    return jnp.clip(x / scale, -F8_MAX, F8_MAX).astype(F8), scale


def fp8_linear(x: jax.Array, weight: jax.Array, weight_scale: jax.Array, input_scale: jax.Array | None = None,
               block_cols: int | None = None) -> jax.Array:
    """x dtype[M, K] @ W -> dtype[M, N] for the device form above."""
    if block_cols is not None:
        w = dequantize(weight, weight_scale, block_cols, x.dtype)
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=dot_precision(x.dtype))
    xq, sx = quantize_activations(x, input_scale)
    m = x.shape[0]
    if m % FP8_GEMM_ROWS:        # cuBLASLt's fp8 GEMM takes multiples of 16 rows; XLA expands w otherwise
        xq = jnp.pad(xq, ((0, -m % FP8_GEMM_ROWS), (0, 0)))
    out = jnp.float32 if x.dtype == jnp.float32 else x.dtype
    y = jax.lax.dot_general(xq, weight, (((1,), (1,)), ((), ())), preferred_element_type=out)[:m]
    return (y.astype(jnp.float32) * sx * weight_scale[:, 0]).astype(x.dtype)


def dequantize(weight: jax.Array, weight_scale: jax.Array, block_cols: int, dtype=jnp.float32) -> jax.Array:
    """f8[N, K] with scales f32[N, K/B] -> dtype[N, K]."""
    n, k = weight.shape
    w = weight.astype(jnp.float32).reshape(n, k // block_cols, block_cols) * weight_scale[:, :, None]
    return w.reshape(n, k).astype(dtype)


def expand_block_scales(scale_inv: np.ndarray, block: tuple[int, int], n: int) -> np.ndarray:
    """vLLM's block scales f32[ceil(N / rows), ceil(K / cols)] -> one row per output channel f32[N, K / cols]
    (fused layers join on N, where a part's last block row can be partial)."""
    return np.repeat(scale_inv.astype(np.float32), block[0], axis=0)[:n]


def read_fp8_tensor(path: str, name: str) -> np.ndarray:
    """An F8_E4M3 tensor of a safetensors file as float8_e4m3fn numpy, read from the file's header and bytes
    (safetensors' numpy and flax readers have no fp8 dtype)."""
    import ml_dtypes
    size, header = _safetensors_header(path, os.stat(path).st_mtime_ns)
    info = header[name]
    if info["dtype"] != "F8_E4M3":
        raise ValueError(f"{name}: {info['dtype']} is not F8_E4M3")
    start, end = info["data_offsets"]
    with open(path, "rb") as f:
        f.seek(8 + size + start)
        data = f.read(end - start)
    return np.frombuffer(data, dtype=ml_dtypes.float8_e4m3fn).reshape(info["shape"])


@functools.lru_cache(maxsize=8)
def _safetensors_header(path: str, mtime_ns: int) -> tuple[int, dict]:
    """(header bytes, header) of a safetensors file, read once per file (and version: mtime_ns) for all of its
    fp8 tensors."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        return size, json.loads(f.read(size))
