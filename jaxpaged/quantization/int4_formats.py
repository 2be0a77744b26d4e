"""AWQ, GPTQ and compressed-tensors int4 checkpoints, read as published and repacked on the host into the
W4A16 kernel's layout (pallas_kernels/int4_matmul.py: W[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]).

The published layouts (int32 words of eight 4-bit values, the lowest bits first):
  AWQ (GEMM):  qweight i32[K, N/8] and qzeros i32[K/G, N/8] packed along the output dim, word c holding
               columns 8c + AWQ_ORDER[i] in its nibbles i = 0..7; scales f16[K/G, N].
  GPTQ:        qweight i32[K/8, N] packed along the input dim (nibble j of row i is input row 8i + j);
               qzeros i32[K/G, N/8] packed along the output dim in order, holding zero - 1 (the original
               format; checkpoint_format "gptq_v2" holds the zero itself); scales f16[K/G, N]; g_idx i32[K],
               each input row's group: arange(K) // G, or a permutation's groups with desc_act (act order).
  compressed-tensors pack-quantized (W4A16): weight_packed i32[N, K/8] packed along the input dim in order,
               each value stored + 8 (signed int4 -> 0..15); weight_scale [N, K/G]; asymmetric schemes add
               weight_zero_point i32[N/8, K/G] (packed along the output dim, + 8), symmetric ones have none
               (zero point 0, so 8 once offset); actorder "group" adds weight_g_idx i32[K], as GPTQ's g_idx.
Symmetric GPTQ stores the zero point 8 like any other, so one path reads both.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxpaged.pallas_kernels.int4_matmul import check_group_size, pack_int4

INT4_METHODS = ("awq", "compressed-tensors", "gptq")
# The tensors of one linear layer each method's checkpoints hold, required first, then optional ones.
TENSORS = {"awq": (("qweight", "qzeros", "scales"), ()),
           "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
           "compressed-tensors": (("weight_packed", "weight_scale"), ("weight_zero_point", "weight_g_idx",
                                                                      "weight_shape"))}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)     # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]


class Int4Scheme(NamedTuple):
    """What a checkpoint's quantization_config says about its linear layers."""
    method: str             # awq | gptq | compressed-tensors
    group_size: int         # input rows per scale; 0: one group over all of K (per output channel)
    act_order: bool         # GPTQ desc_act: groups are a permutation's, g_idx gives each row's
    zeros_minus_one: bool   # GPTQ's original format stores zero - 1

    def group_of(self, in_features: int) -> int:
        return self.group_size or in_features


class Int4Weight(NamedTuple):
    """One linear layer's weight: 4-bit values, per-group scales and zero points, [K, N] orientation."""
    q: np.ndarray           # u8[K, N], 0..15
    scales: np.ndarray      # f32[K/G, N]
    zeros: np.ndarray       # f32[K/G, N], whole numbers
    g_idx: np.ndarray       # i32[K]: the group of each input row


def int4_scheme(quant_config: dict) -> Int4Scheme:
    """The scheme of an AWQ, GPTQ or compressed-tensors quantization_config; ValueError naming what is
    supported otherwise."""
    method = quant_config.get("quant_method")
    if method not in INT4_METHODS:
        raise ValueError(f"quant_method {method!r} is not an int4 method ({', '.join(INT4_METHODS)})")
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(quant_config)
    bits = quant_config.get("bits", quant_config.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method} with {bits}-bit weights is not supported (4-bit only)")
    group = quant_config.get("group_size", quant_config.get("q_group_size", 128))
    group = 0 if group in (-1, None) else int(group)
    if method == "awq":
        version = str(quant_config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (supported: gemm)")
        if not quant_config.get("zero_point", True):
            raise ValueError("AWQ without zero points is not supported")
        return Int4Scheme("awq", group, False, False)
    fmt = quant_config.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (supported: gptq, gptq_v2)")
    return Int4Scheme("gptq", group, bool(quant_config.get("desc_act", False)), fmt == "gptq")


def _compressed_tensors_scheme(quant_config: dict) -> Int4Scheme:
    """compressed-tensors: one weight scheme, 4-bit integers packed, no activation quantization (W4A16)."""
    supported = "supported: the pack-quantized format, 4-bit int weights (W4A16), group or channel strategy"
    fmt = quant_config.get("format")
    groups = list((quant_config.get("config_groups") or {}).values())
    if fmt != "pack-quantized" or not groups:
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported ({supported})")
    if any(g.get("weights") != groups[0].get("weights") for g in groups[1:]):
        raise ValueError("compressed-tensors config_groups with different weight schemes are not supported "
                         "(one scheme for every linear layer)")
    weights = groups[0].get("weights") or {}
    if any(g.get("input_activations") for g in groups):
        raise ValueError(f"compressed-tensors with quantized activations is not supported ({supported})")
    if weights.get("num_bits") != 4 or weights.get("type", "int") != "int":
        raise ValueError(f"compressed-tensors {weights.get('num_bits')}-bit {weights.get('type')} weights are "
                         f"not supported ({supported})")
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel"):
        raise ValueError(f"compressed-tensors strategy {strategy!r} is not supported ({supported})")
    group = int(weights.get("group_size") or 0) if strategy == "group" else 0
    return Int4Scheme("compressed-tensors", group, weights.get("actorder") == "group", False)


def check_scheme(scheme: Int4Scheme, name: str, in_features: int) -> None:
    """ValueError when a linear layer of in_features inputs cannot run in the kernel's layout."""
    why = check_group_size(in_features, scheme.group_of(in_features))
    if why is not None:
        raise ValueError(f"{scheme.method} layer {name}: {why}")


def _nibbles(words: np.ndarray) -> np.ndarray:
    """i32[..., W] -> u8[..., W, 8]: each word's eight 4-bit values, lowest bits first."""
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    return ((words.astype(np.uint32)[..., None] >> shifts) & 15).astype(np.uint8)


def _unpack_columns(words: np.ndarray, order=None) -> np.ndarray:
    """i32[R, N/8] packed along the columns -> u8[R, N]; order[i]: the column within 8 of nibble i."""
    nib = _nibbles(words)                                    # [R, N/8, 8], nibble i
    if order is not None:
        nib = nib[..., np.argsort(order)]                    # -> column j of each 8 in place j
    return nib.reshape(words.shape[0], -1)


def from_awq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, scheme: Int4Scheme) -> Int4Weight:
    q = _unpack_columns(qweight, AWQ_ORDER)                  # [K, N]
    zeros = _unpack_columns(qzeros, AWQ_ORDER).astype(np.float32)
    k = q.shape[0]
    return Int4Weight(q, scales.astype(np.float32), zeros,
                      (np.arange(k) // scheme.group_of(k)).astype(np.int32))


def from_gptq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray | None,
              scheme: Int4Scheme) -> Int4Weight:
    q = _nibbles(qweight.T).reshape(qweight.shape[1], -1).T  # [K/8, N] -> [N, K/8, 8] -> [K, N]
    zeros = _unpack_columns(qzeros).astype(np.float32) + (1.0 if scheme.zeros_minus_one else 0.0)
    # Old GPTQ writers (zero - 1 with an unsigned wrap) store 0 - 1 as 15: a zero of 16 means 0.
    zeros = np.where(zeros > 15, zeros - 16, zeros)
    k = q.shape[0]
    if g_idx is None:
        g_idx = np.arange(k) // scheme.group_of(k)
    return Int4Weight(q, scales.astype(np.float32), zeros, np.asarray(g_idx, np.int32))


def from_compressed_tensors(weight_packed: np.ndarray, weight_scale: np.ndarray,
                            weight_zero_point: np.ndarray | None, g_idx: np.ndarray | None,
                            scheme: Int4Scheme) -> Int4Weight:
    n = weight_packed.shape[0]
    q = _nibbles(weight_packed).reshape(n, -1).T                            # [N, K/8] -> [K, N]
    scales = weight_scale.astype(np.float32).T                              # [K/G, N]
    if weight_zero_point is None:
        zeros = np.full(scales.shape, 8.0, np.float32)                      # symmetric: 0, offset by 8
    else:
        zeros = _nibbles(weight_zero_point.T).reshape(scales.shape[0], -1)[:, :n].astype(np.float32)
    k = q.shape[0]
    if g_idx is None:
        g_idx = np.arange(k) // scheme.group_of(k)
    return Int4Weight(q, scales, zeros, np.asarray(g_idx, np.int32))


def from_checkpoint(t: dict[str, np.ndarray], scheme: Int4Scheme) -> Int4Weight:
    """One linear layer's tensors (TENSORS[scheme.method] by name) -> Int4Weight."""
    if scheme.method == "awq":
        return from_awq(t["qweight"], t["qzeros"], t["scales"], scheme)
    if scheme.method == "gptq":
        return from_gptq(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), scheme)
    return from_compressed_tensors(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"),
                                   t.get("weight_g_idx"), scheme)


def concat_outputs(parts: list[Int4Weight], name: str) -> Int4Weight:
    """Parts of one fused layer (q, k, v; gate, up) joined on the output dim: they share the input, so
    they must share its grouping."""
    if any(not np.array_equal(p.g_idx, parts[0].g_idx) for p in parts[1:]):
        raise ValueError(f"{name}: the fused parts group the input rows differently (g_idx); jaxpaged fuses "
                         "them into one matmul and needs one grouping")
    join = lambda field: np.concatenate([getattr(p, field) for p in parts], axis=1)
    return Int4Weight(join("q"), join("scales"), join("zeros"), parts[0].g_idx)


def device_layout(w: Int4Weight, act_order: bool) -> dict[str, np.ndarray]:
    """The Int4Linear params of one layer: qweight i32[K/8, N], scales and zeros f32[K/G, N] (the loader holds the
    zeros, whole numbers, as uint8: models/quant_loader.py's _PARAM_DTYPES), and with act order perm i32[K], the
    input rows sorted by group (the model multiplies x[:, perm] by the sorted rows).
    """
    k, n = w.q.shape
    num_groups = w.scales.shape[0]
    out = {"scales": w.scales, "zeros": w.zeros}
    if act_order:
        perm = np.argsort(w.g_idx, kind="stable").astype(np.int32)
        if not np.array_equal(np.bincount(w.g_idx, minlength=num_groups), np.full(num_groups, k // num_groups)):
            raise ValueError("act-order groups of unequal size are not supported")
        out.update(qweight=pack_int4(w.q[perm]), perm=perm)
        return out
    if not np.array_equal(w.g_idx, np.arange(k) // (k // num_groups)):
        raise ValueError("g_idx is not arange(K) // group_size, but desc_act is off in quantization_config")
    out["qweight"] = pack_int4(w.q)
    return out
