"""One Flax decoder for every family jaxpaged loads (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3, Baichuan, GLM),
reading and writing the paged KV cache; a family is a set of DecoderConfig flags.

Legend: T tokens, R requests, H hidden, N heads, K kv heads, D head dim, F MLP width, V vocab, L layers.
Layers run under `nn.scan` over stacked weights, so compile time does not grow with depth; the whole KV
pool `kv_cache: dtype[L, 2, B, K, S, D]` rides in the scan carry with the layer index, and each layer
writes its new K/V into it in place before attending (the kernels index the layer themselves).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpaged import pallas_kernels
from jaxpaged.pallas_kernels import dot_precision
from jaxpaged.pallas_kernels.int4_matmul import (GEMV_MAX_ROWS, PACK_ROWS, dequantize_int4, int4_matmul, slab_rows,
                                                 use_f16x2)
from jaxpaged.pallas_kernels.int4_operands import norm_gemv_x_supported, rms_norm_gemv_x, rope_qkv, silu_mul_gemv_x
from jaxpaged.quantization import fp8, int8
from jaxpaged.quantization.gguf_blocks import BLOCK_SIZES, dequantize, repacked_form

from . import rope
from .config import DecoderConfig
from .row_chunks import map_row_chunks, rows_within


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    """Device arrays describing one flat batch (see pallas_kernels/ragged_paged_attention.py)."""
    positions: jax.Array         # i32[T]     absolute position of each token
    slot_mapping: jax.Array      # i32[T]     cache slot each token's K/V is written to
    block_tables: jax.Array      # i32[R, M]  physical block ids of each request
    seq_lens: jax.Array          # i32[R]     context length including this step's tokens
    query_start_loc: jax.Array   # i32[R+1]   prefix sums of per-request query lengths


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
    """Static (hashable) choices that pick compiled variants."""
    attn_backend: str = "xla"
    decode_only: bool = False
    num_steps: int = 1            # decode steps per program (the runner's multi-step loop; the model ignores it)
    # The layers run inside a loop XLA executes as a while loop (the layer scan, or the multi-step loop):
    # attention there keeps to kernels XLA's CUDA graphs capture (pallas_kernels.attention's in_loop).
    in_loop: bool = True
    # The device the program is for, named rather than asked of JAX: a program may be lowered in a
    # process without that device (runner/lowering_workers.py). interpret: the Pallas kernels run in
    # interpret mode (a CPU platform); num_sms: the GPU's SM count the kernels size their grids by.
    # None: JAX's default backend and device decide (tests, benchmarks).
    interpret: bool | None = None
    num_sms: int | None = None

    @property
    def pallas(self) -> bool:
        """Whether the Pallas GPU kernels run (attention, and the W4A16 matmul at decode sizes)."""
        return self.attn_backend in ("pallas", "mosaic")


# Rows (tokens) up to which an int4 linear layer runs the W4A16 kernel (decode batches); more rows expand the
# weights in XLA and take cuBLAS's dot, where a prefill's matmul outweighs the expansion. A first choice, not
# yet measured shape by shape (bench/bench_matmul.py's table is to set it).
INT4_KERNEL_MAX_ROWS = 64
# Whether a one-row bf16/fp16 W4A16 projection takes its input's float16 operands made before the kernel
# (int4_matmul's x_amax): from the bound the norm before it gives (q/k/v, gate/up), and for the down projection
# from its input's maximum (INT4_PREPARE_DOWN: an XLA reduction beside the SiLU's fusion), rather than in each of
# the kernel's programs. On the H100 (llama3-8b AWQ, one request) the GEMVs took 10-16% less (gate_up 25.4 against
# 28.2 us) and the step 1.2-1.9% less: the reductions and pairs XLA adds around them take the rest
# (bench/results/NOTES.md). The output projection keeps the kernel's own: its input comes from attention, with
# no reduction to share.
INT4_PREPARED_X = True
INT4_PREPARE_DOWN = True
# Whether, where both projections after a norm take those operands (4-bit, zero points, no act order), the norm
# and the operands are one Pallas kernel (rms_norm_gemv_x) instead of XLA's three (the norm's reductions, the
# bound's scalar, the pairs). On the H100 (llama3-8b AWQ, one request) the step took 3.0% less: 2,654 against
# 2,737 us, the kernel 2.46 us a norm (bench/results/NOTES.md).
INT4_NORM_KERNEL = True
# Whether a one-row SwiGLU MLP whose gate/up and down projections are both 4-bit (down with zero points, no act
# order, in float16 pairs) makes the down GEMV's operands in one Pallas kernel (silu_mul_gemv_x) from the gate/up
# GEMV's partial sums, instead of XLA's three (the sum with the SiLU and product, the maximum, the pairs). On the
# H100 (llama3-8b AWQ, one request) 1.6 us against 4.4, and the step 2,588 against 2,662 us (bench/results/NOTES.md).
INT4_SILU_KERNEL = True
# Whether a one-row 4-bit q/k/v projection (RoPE over whole heads, HF's rotate_half; its bias, if any, added in
# the kernel) hands its partial sums to one Pallas kernel (rope_qkv) for q, k and v with RoPE, instead of XLA's
# three (the sum fused into q's and k's rotations and v's slice). On the H100 (llama3-8b AWQ, one request) 1.4 us
# against 3.7, and the step 2,535 against 2,595 us (bench/results/NOTES.md).
INT4_ROPE_KERNEL = True
# Whether rope_qkv also takes Qwen3's q/k norms (RMSNorm over each head before RoPE), where XLA makes its own
# kernels of them. On the H100 (qwen3-8b AWQ, one request) the step 2,819 against 2,975-2,980 us.
ROPE_QK_NORM = True
# Whether a one-row dense (bf16/fp16) q/k/v projection's output goes through rope_qkv too (as one part), where XLA
# makes three kernels of q's and k's rotations and v's slice. On the H100 (llama3-8b bf16, one request, with
# ROPE_WRITES_KV) the step 5,945 against 6,020-6,026 us.
DENSE_ROPE_KERNEL = True
# Whether rope_qkv also stores the row's k and v into the pool (its kv_write), where write_kv is a kernel of its
# own. On the H100 (llama3-8b AWQ, one request) write_kv's 45.8 us a step go, rope_qkv takes 10.8 more, and the
# step is 2,553 against 2,577 us.
ROPE_WRITES_KV = True
# Whether a quantized linear layer's weights are expanded for XLA's dot (4-bit and GGUF layers at prefill rows,
# block-scaled fp8 and W8A16 at every size) only once the layer's input is computed (_in_turn), so a step holds
# one layer's expanded weights at a time. Measured for 4-bit on the H100: a llama3-8b AWQ step's temporaries
# 10.51 GiB without, 1.46 with (as bf16's), its one-request decode unchanged (bench/results/NOTES.md).
EXPAND_IN_TURN = True


class RMSNorm(nn.Module):
    """HF's RMSNorm: Llama's scales the normed x after rounding it to x's dtype; Gemma's (plus_one) scales by
    (1 + w) in float32 and rounds after.
    With bound=True it also returns a bound of each row's |output| (f32[T]): rsqrt(mean(x^2) + eps) times
    max |x w|, a second reduction over the same x beside the mean's, which XLA computes in the mean's kernel. The
    W4A16 GEMV scales its float16 operands by it (int4_matmul's x_amax) instead of reducing the output again.
    With pairs=True (one row) the output and those operands come from one Pallas kernel (rms_norm_gemv_x):
    (y, (pairs, max |y|)), int4_matmul's x_pairs; interpret as RuntimeOptions'."""
    eps: float
    dtype: Any
    plus_one: bool = False

    @nn.compact
    def __call__(self, x, bound: bool = False, pairs: bool = False, interpret: bool | None = None,
                 weight_only: bool = False):
        """weight_only: the scale parameter itself (x gives its size), for a kernel that norms in itself."""
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],), self.dtype)
        if weight_only:
            return scale
        if pairs:
            y, x_pairs, amax = rms_norm_gemv_x(x, scale, eps=self.eps, plus_one=self.plus_one, interpret=interpret)
            return y, (x_pairs, amax)
        x32 = x.astype(jnp.float32)
        inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        w = 1.0 + scale.astype(jnp.float32) if self.plus_one else scale.astype(jnp.float32)
        normed = x32 * inv_rms
        y = (normed * w).astype(x.dtype) if self.plus_one else scale * normed.astype(x.dtype)
        if not bound:
            return y
        return y, inv_rms[..., 0] * jnp.max(jnp.abs(x32 * w), axis=-1)


def _norm(cfg: DecoderConfig, dtype, name: str | None) -> RMSNorm:
    return RMSNorm(cfg.rms_norm_eps, dtype, cfg.norm_plus_one, name=name)


def soft_cap(x, cap: float | None):
    return x if cap is None else cap * jnp.tanh(x / cap)


def _rotate(x, cos, sin, interleaved: bool = False):
    """RoPE on the first 2 * P dims of each head, the rest passed through. x: [T, N, D]; cos, sin: [T, P].
    Pair i is (i, i + P), HF's rotate_half, or (2i, 2i + 1), GLM's interleaved."""
    rot = 2 * cos.shape[-1]
    x, rest = x[..., :rot], x[..., rot:]
    cos = cos[:, None, :].astype(x.dtype)
    sin = sin[:, None, :].astype(x.dtype)
    if interleaved:
        pairs = x.reshape(*x.shape[:-1], rot // 2, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
    else:
        x1, x2 = jnp.split(x, 2, axis=-1)
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out if rest.shape[-1] == 0 else jnp.concatenate([out, rest], axis=-1)


def _blocks_shape(rows: int, row_len: int, qtype: str) -> tuple[int, int]:
    """uint8 shape of `rows` rows of `row_len` weights in GGUF blocks of qtype."""
    block_size, type_size = BLOCK_SIZES[qtype]
    return rows, row_len // block_size * type_size


def held_dtype(cfg: DecoderConfig, dtype):
    """The dtype the dense matmul weights are held in (DecoderConfig.weight_dtype), else the model's."""
    return jnp.dtype(cfg.weight_dtype) if cfg.weight_dtype else dtype


def matmul(x, w, dtype):
    """x @ w in dtype with w as held (held_dtype: bf16 values held in f32 on the CPU): x widened to w's dtype,
    the product rounded to dtype, which is what XLA:CPU computes for a bf16 dot; the model's dtype elsewhere."""
    return jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (0,)), ((), ())),
                               precision=dot_precision(w.dtype)).astype(dtype)


class Linear(nn.Module):
    """nn.Dense (y = x @ kernel [in, out], then + bias, in dtype) with the kernel held in weight_dtype. Decode
    sizes take XLA's dot too: a Mosaic kernel that streamed the weight by TMA was no faster on Hopper, and each
    Mosaic call breaks the step's CUDA graph (bench/results/NOTES.md, "a Mosaic matmul for decode-sized
    layers")."""
    features: int
    use_bias: bool
    dtype: Any
    weight_dtype: Any

    @nn.compact
    def __call__(self, x, x_bound=None):
        """x_bound: a bound of each row's |x| (Int4Linear's; unused here)."""
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features), self.weight_dtype)
        y = matmul(x.astype(self.dtype), kernel, self.dtype)
        return y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype) if self.use_bias else y


class Embed(nn.Module):
    """nn.Embed (a lookup in dtype; attend, the tied LM head) with the table held in weight_dtype."""
    num_embeddings: int
    features: int
    dtype: Any
    weight_dtype: Any

    def setup(self):
        self.embedding = self.param("embedding", nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0),
                                    (self.num_embeddings, self.features), self.weight_dtype)

    def __call__(self, ids):
        return jnp.take(self.embedding, ids, axis=0).astype(self.dtype)

    def attend(self, x):
        return matmul(x.astype(self.dtype), self.embedding.T, self.dtype)


def _dot_t(x, w, dtype):
    """x @ w.T in dtype, w [out, in] as GGUF stores it (no transposed copy)."""
    return jax.lax.dot_general(x.astype(dtype), w.astype(dtype), (((x.ndim - 1,), (1,)), ((), ())),
                               precision=dot_precision(dtype))


class GGUFEmbed(nn.Module):
    """The token embedding kept in GGUF blocks (uint8[V, blocks of H]): a lookup expands only the rows it
    gathers; attend (the tied LM head) expands the table."""
    num_embeddings: int
    features: int
    qtype: str
    dtype: Any

    def setup(self):
        self.qweight = self.param("qweight", nn.initializers.zeros,
                                  _blocks_shape(self.num_embeddings, self.features, self.qtype), jnp.uint8)

    def __call__(self, ids):
        return dequantize(self.qweight[ids], self.qtype).astype(self.dtype)

    def attend(self, x):
        x, qweight = _in_turn(x, self.qweight)
        return _dot_t(x, dequantize(qweight, self.qtype), self.dtype)


def _in_turn(x, *weights) -> tuple:
    """(x, *weights), with EXPAND_IN_TURN behind an optimization barrier: what expands the weights then waits for
    the layer's input. With the layers unrolled, XLA otherwise expands later layers' weights ahead of their turn
    and holds several layers' expanded weights at once, past what the KV pool leaves free."""
    return jax.lax.optimization_barrier((x, *weights)) if EXPAND_IN_TURN else (x, *weights)


class Int4Linear(nn.Module):
    """y = x @ W with W in 4-bit groups, in the W4A16 kernel's layout (pallas_kernels/int4_matmul.py):
    qweight i32[K/8, N] with scales dtype[K/G, N] and zeros u8[K/G, N] (AWQ, GPTQ), and with act order perm
    i32[K], the input rows in the order the packed rows follow; or, offsets (GGUF's blocks), scales and mins
    f32[Kp/G, N] with K padded to Kp, a multiple of the kernel's slab, by zero weights (x is padded alike), the
    values 4-bit (GGUF's 4-bit types) or, bits=8, 8-bit (qweight i32[Kp/4, N]: GGUF's other types)."""
    features: int
    in_features: int
    group_size: int           # 0: one group over all of K
    act_order: bool
    use_bias: bool            # Qwen2's q/k/v (a dense bias beside the quantized weight)
    dtype: Any
    options: RuntimeOptions
    offsets: bool = False
    bits: int = 4

    @nn.compact
    def __call__(self, x, x_bound=None, keep_splits: bool = False):
        """x_bound f32[T]: a bound of each row's |x| (RMSNorm's, or its maximum); given, a one-row bf16/f16 x takes
        the W4A16 GEMV with its float16 operands made before the kernel (int4_matmul's x_amax). Or a tuple: those
        operands made already (RMSNorm's pairs=True, int4_matmul's x_pairs), taken by the zero-point forms
        without act order (whose input rows are permuted), x otherwise. keep_splits (the Pallas path): the
        kernel's partial sums over its splits (int4_matmul's keep_splits) and the bias or None, not added, for
        silu_mul_gemv_x and rope_qkv."""
        k, n = self.in_features, self.features
        if self.offsets:
            k += -k % slab_rows(self.bits)
        groups = k // (self.group_size or k)
        qweight = self.param("qweight", nn.initializers.zeros, (k * self.bits // 32, n), jnp.int32)
        scales = self.param("scales", nn.initializers.ones, (groups, n), jnp.float32 if self.offsets else self.dtype)
        if self.offsets:
            affine = {"mins": self.param("mins", nn.initializers.zeros, (groups, n), jnp.float32)}
        else:
            affine = {"zeros": self.param("zeros", nn.initializers.zeros, (groups, n), jnp.uint8)}
        bias = self.param("bias", nn.initializers.zeros, (n,), self.dtype) if self.use_bias else None
        x = x.astype(self.dtype)
        if self.act_order:
            x = x[:, self.param("perm", lambda _, s: jnp.arange(s[0], dtype=jnp.int32), (k,))]
        if x.shape[1] < k:
            x = jnp.pad(x, ((0, 0), (0, k - x.shape[1])))
        if self.options.pallas and x.shape[0] <= INT4_KERNEL_MAX_ROWS:
            prepared = (INT4_PREPARED_X and x_bound is not None and x.shape[0] <= GEMV_MAX_ROWS and self.bits == 4
                        and use_f16x2(self.dtype, k // groups))
            made = isinstance(x_bound, tuple)
            if made and (self.act_order or self.offsets):
                prepared = False
            y = int4_matmul(x, qweight, scales, **affine, bits=self.bits,
                            x_amax=x_bound if prepared and not made else None,
                            x_pairs=x_bound if prepared and made else None, keep_splits=keep_splits,
                            interpret=self.options.interpret)
            if keep_splits:
                return y, bias
        elif keep_splits:
            raise ValueError("keep_splits takes the Pallas kernels' rows")
        else:
            x, qweight, scales, affine = _in_turn(x, qweight, scales, affine)
            y = jnp.dot(x, dequantize_int4(qweight, scales, dtype=self.dtype, **affine, bits=self.bits),
                        precision=dot_precision(self.dtype))
        return y if bias is None else y + bias


class Fp8Linear(nn.Module):
    """y = x @ W with W in e4m3 (jaxpaged/quantization/fp8.py's device form): weight f8[N, K], weight_scale
    f32[N, K/B], and with static activation scales input_scale f32[]."""
    features: int
    in_features: int
    static_input: bool
    block_cols: int | None    # K columns per weight scale when block-scaled, else None (one per channel)
    use_bias: bool
    dtype: Any

    @nn.compact
    def __call__(self, x, x_bound=None):
        """x_bound: Int4Linear's (unused here)."""
        n, k = self.features, self.in_features
        weight = self.param("weight", nn.initializers.zeros, (n, k), fp8.F8)
        weight_scale = self.param("weight_scale", nn.initializers.ones, (n, k // (self.block_cols or k)),
                                  jnp.float32)
        input_scale = self.param("input_scale", nn.initializers.ones, (), jnp.float32) if self.static_input else None
        x = x.astype(self.dtype)
        if self.block_cols is not None:     # (block-scaled weights are expanded for the dot)
            x, weight, weight_scale = _in_turn(x, weight, weight_scale)
        y = fp8.fp8_linear(x, weight, weight_scale, input_scale, self.block_cols)
        return y + self.param("bias", nn.initializers.zeros, (n,), self.dtype) if self.use_bias else y


class Int8Linear(nn.Module):
    """y = x @ W with W in int8 (jaxpaged/quantization/int8.py's device form): weight i8[N, K], weight_scale
    f32[N, K/G], for asymmetric W8A16 weight_zero f32[N, K/G], for static W8A8 input_scale f32[]."""
    features: int
    in_features: int
    scheme: int8.Int8Scheme
    use_bias: bool
    dtype: Any

    @nn.compact
    def __call__(self, x, x_bound=None):
        """x_bound: Int4Linear's (unused here)."""
        n, k, s = self.features, self.in_features, self.scheme
        groups = k // (s.group_size or k)
        weight = self.param("weight", nn.initializers.zeros, (n, k), jnp.int8)
        weight_scale = self.param("weight_scale", nn.initializers.ones, (n, groups), jnp.float32)
        zero = None if s.symmetric else self.param("weight_zero", nn.initializers.zeros, (n, groups), jnp.float32)
        input_scale = self.param("input_scale", nn.initializers.ones, (), jnp.float32) if s.static_input else None
        x = x.astype(self.dtype)
        if not s.activations:      # (W8A16's weights are expanded for the dot)
            x, weight, weight_scale, zero = _in_turn(x, weight, weight_scale, zero)
        y = int8.int8_linear(x, weight, weight_scale, zero, input_scale, s.activations)
        return y + self.param("bias", nn.initializers.zeros, (n,), self.dtype) if self.use_bias else y


def _embed(cfg: DecoderConfig, dtype, name: str | None = "embed_tokens") -> nn.Module:
    qtype = cfg.quant_of("embed_tokens")
    if qtype is None:
        return Embed(cfg.vocab_size, cfg.hidden_size, dtype, held_dtype(cfg, dtype), name=name)
    return GGUFEmbed(cfg.vocab_size, cfg.hidden_size, qtype, dtype, name=name)


def int4_scheme(qtype: str | None) -> tuple[int, bool] | None:
    """An "int4-g<group>[-actorder]" scheme's (group size, 0: one group over all of K; act order), else None."""
    if not qtype or not qtype.startswith("int4-g"):
        return None
    group, _, order = qtype[len("int4-g"):].partition("-")
    return int(group), order == "actorder"


def _linear(cfg: DecoderConfig, dtype, features: int, in_features: int, bias: bool, name: str,
            options: RuntimeOptions) -> nn.Module:
    """A linear layer: dense (Linear, kernel [in, out]) or, when the config keeps it quantized, Int4Linear
    (an "int4-g<group>[-actorder]" scheme, or GGUF_INT4 / GGUF_INT8: GGUF's blocks repacked as 4- or 8-bit
    values), Int8Linear (an "int8..." scheme) or Fp8Linear (an "fp8..." scheme)."""
    qtype = cfg.quant_of(name)
    if qtype is None:
        return Linear(features, bias, dtype, held_dtype(cfg, dtype), name=name)
    gguf_form = repacked_form(qtype)
    if gguf_form is not None:
        bits, group = gguf_form
        return Int4Linear(features, in_features, group, False, bias, dtype, options, offsets=True, bits=bits,
                          name=name)
    int4 = int4_scheme(qtype)
    if int4 is not None:
        return Int4Linear(features, in_features, *int4, bias, dtype, options, name=name)
    if qtype.startswith("int8"):
        return Int8Linear(features, in_features, int8.parse_scheme_name(qtype), bias, dtype, name=name)
    if qtype.startswith("fp8"):
        static, block_cols = fp8.parse_scheme_name(qtype)
        return Fp8Linear(features, in_features, static, block_cols, bias, dtype, name=name)
    raise ValueError(f"{name}: unknown weight scheme {qtype!r}")


class Attention(nn.Module):
    cfg: DecoderConfig
    dtype: Any
    options: RuntimeOptions
    # The layer's kind (config.layer_kinds) when the program knows it (per-layer and unrolled dispatch), else
    # None: read at the traced layer index, the window then picked by lax.switch (the layer scan). A switch on
    # the GPU reads its index back to the host before it branches, so the host waits for the device at every
    # layer; a known kind compiles one branch.
    kind: int | None = None

    @nn.compact
    def __call__(self, x, kv_cache, layer_idx, meta: AttentionMetadata, cos, sin, x_bound=None):
        """cos, sin: f32[rope kinds, T, P] (rope_cos_sin); the layer takes its kind's. x_bound: the input norm's
        bound of |x| (RMSNorm), for the q/k/v projection."""
        c = self.cfg
        kinds = c.layer_kinds()
        kind = self.kind if self.kind is not None else jnp.asarray(kinds, jnp.int32)[layer_idx] if kinds else 0
        rope_kind = kind if c.local_rope is not None else 0      # (local_rope only when layers differ)
        cos, sin = cos[rope_kind], sin[rope_kind]
        q_size = c.num_heads * c.head_dim
        kv_scales = None
        if c.kv_cache_dtype == "fp8":    # the pool holds k / k_scale and v / v_scale in e4m3
            kv_scales = (self.param("k_scale", nn.initializers.ones, (), jnp.float32),
                         self.param("v_scale", nn.initializers.ones, (), jnp.float32))
        q, k, v, kv_cache = self._q_k_v(x, x_bound, cos, sin, kv_cache, layer_idx, meta.slot_mapping, kv_scales)
        slopes = c.alibi_slopes()
        backend = self.options.attn_backend
        opts = self.options
        if k is not None:               # (None: rope_qkv stored k and v in the pool)
            kv_cache = pallas_kernels.write_kv(kv_cache, layer_idx, k, v, meta.slot_mapping, backend=backend,
                                               interpret=opts.interpret, kv_scales=kv_scales)

        def attend(window):
            return pallas_kernels.attention(q, kv_cache, layer_idx, meta.block_tables, meta.seq_lens,
                                            meta.query_start_loc, scale=c.query_scale or c.head_dim ** -0.5,
                                            decode_only=opts.decode_only, in_loop=opts.in_loop,
                                            sliding_window=window, soft_cap=c.attn_soft_cap, backend=backend,
                                            interpret=opts.interpret, num_sms=opts.num_sms, kv_scales=kv_scales,
                                            alibi_slopes=None if slopes is None else jnp.asarray(slopes))
        windows = c.attention_windows()
        if len(windows) == 1:
            o = attend(windows[0])
        elif isinstance(kind, int):
            o = attend(windows[kind])
        else:       # layers of both kinds: the layer index (traced under the scan) picks the window
            o = jax.lax.switch(kind, [lambda w=w: attend(w) for w in windows])
        o = o.reshape(-1, c.num_heads * c.head_dim)
        return _linear(c, self.dtype, c.hidden_size, q_size, False, "o_proj", opts)(o), kv_cache

    def _q_k_v(self, x, x_bound, cos, sin, kv_cache, layer_idx, slot_mapping, kv_scales):
        """(q, k, v, the pool): the q/k/v projection (HF's three weights concatenated at load time: one matmul),
        q/k norms and RoPE, each dtype[T, heads, D]. Where _rope_kernel says so, after the projection one kernel
        (rope_qkv) makes them, and with ROPE_WRITES_KV stores k and v into the pool (k, v then None); else XLA."""
        c = self.cfg
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv_proj = _linear(c, self.dtype, q_size + 2 * kv_size, c.hidden_size, c.qkv_bias, "qkv_proj", self.options)
        if self._rope_kernel(x, cos):
            if c.quant_of("qkv_proj") is None:
                partial_sums, bias = qkv_proj(x)[None], None        # one part, its bias added
            else:
                partial_sums, bias = qkv_proj(x, x_bound, keep_splits=True)
            head = jnp.zeros((c.head_dim,), self.dtype)             # (the norms' weights only)
            qk_norm = (tuple(_norm(c, self.dtype, name)(head, weight_only=True) for name in ("q_norm", "k_norm"))
                       if c.qk_norm else None)
            rope = functools.partial(rope_qkv, partial_sums, cos, sin, bias, qk_norm, q_heads=c.num_heads,
                                     kv_heads=c.num_kv_heads, dtype=self.dtype,
                                     eps=c.rms_norm_eps if c.qk_norm else None, interpret=self.options.interpret)
            if ROPE_WRITES_KV:
                q, kv_cache = rope(kv_write=(kv_cache, layer_idx, slot_mapping, kv_scales))
                return q, None, None, kv_cache
            q, k, v = rope()
            return q, k, v, kv_cache
        qkv = qkv_proj(x, x_bound)
        q = qkv[:, :q_size].reshape(-1, c.num_heads, c.head_dim)
        k = qkv[:, q_size:q_size + kv_size].reshape(-1, c.num_kv_heads, c.head_dim)
        v = qkv[:, q_size + kv_size:].reshape(-1, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = _norm(c, self.dtype, "q_norm")(q)
            k = _norm(c, self.dtype, "k_norm")(k)
        if not c.alibi:
            q, k = _rotate(q, cos, sin, c.rope_interleaved), _rotate(k, cos, sin, c.rope_interleaved)
        return q, k, v, kv_cache

    def _rope_kernel(self, x, cos) -> bool:
        """Whether this step's q, k and v come from rope_qkv: one row through the Pallas kernels, q/k/v 4-bit
        (INT4_ROPE_KERNEL) or dense (DENSE_ROPE_KERNEL), with or without a bias, q/k norms of Llama's form only
        with ROPE_QK_NORM, RoPE (not ALiBi) as HF's rotate_half over whole heads of a power-of-two size."""
        c = self.cfg
        qtype = c.quant_of("qkv_proj")
        kind = DENSE_ROPE_KERNEL if qtype is None else INT4_ROPE_KERNEL and int4_scheme(qtype) is not None
        return (kind and self.options.pallas and x.shape[0] == 1
                and (not c.qk_norm or (ROPE_QK_NORM and not c.norm_plus_one))
                and not c.alibi and not c.rope_interleaved and cos.shape == (1, c.head_dim // 2)
                and c.head_dim & (c.head_dim - 1) == 0)


class MLP(nn.Module):
    cfg: DecoderConfig
    dtype: Any
    options: RuntimeOptions

    @nn.compact
    def __call__(self, x, x_bound=None):
        """x_bound: the norm's bound of |x| (RMSNorm), for the gate/up projection."""
        c, opts = self.cfg, self.options
        gate_up_proj = _linear(c, self.dtype, 2 * c.intermediate_size, c.hidden_size, False, "gate_up_proj", opts)
        down = _linear(c, self.dtype, c.hidden_size, c.intermediate_size, False, "down_proj", opts)
        if self._silu_kernel(x):    # the product and the down GEMV's operands in one kernel, from gate/up's sums
            x_pairs = silu_mul_gemv_x(gate_up_proj(x, x_bound, keep_splits=True)[0], dtype=self.dtype,
                                      interpret=opts.interpret)
            return down(jnp.zeros((1, c.intermediate_size), self.dtype), x_pairs)
        gate_up = gate_up_proj(x, x_bound)
        gate, up = jnp.split(gate_up, 2, axis=-1)           # one matmul for both
        act = nn.silu(gate) if c.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)
        hidden = act * up
        # its maximum, for a W4A16 down projection (one more reduction; unused by the others, which XLA drops)
        bound = jnp.max(jnp.abs(hidden.astype(jnp.float32)), axis=-1) if INT4_PREPARE_DOWN else None
        return down(hidden, bound)

    def _silu_kernel(self, x) -> bool:
        """Whether this step's MLP runs silu_mul_gemv_x (INT4_SILU_KERNEL): one row through the Pallas kernels,
        SiLU, gate/up 4-bit, down 4-bit with zero points, no act order, in float16 pairs."""
        c = self.cfg
        inter = c.intermediate_size
        if not (INT4_SILU_KERNEL and INT4_PREPARED_X and self.options.pallas and x.shape[0] == 1
                and c.hidden_act == "silu" and inter % PACK_ROWS == 0):
            return False
        gate_up, down = int4_scheme(c.quant_of("gate_up_proj")), int4_scheme(c.quant_of("down_proj"))
        return gate_up is not None and down is not None and not down[1] and use_f16x2(self.dtype, down[0] or inter)


class DecoderLayer(nn.Module):
    cfg: DecoderConfig
    dtype: Any
    options: RuntimeOptions
    kind: int | None = None         # Attention's

    @nn.compact
    def __call__(self, carry, meta: AttentionMetadata, cos, sin):
        h, kv_cache, layer_idx = carry
        c, dtype = self.cfg, self.dtype
        # Each norm that feeds a projection gives it a bound of its output, or the GEMV's operands themselves
        # (used by W4A16 projections only: the others take x, and XLA drops what they leave).
        hint = {"pairs": True, "interpret": self.options.interpret} if self._norm_kernel(h) else {"bound": True}
        x, x_hint = _norm(c, dtype, "input_layernorm")(h, **hint)
        attn_out, kv_cache = Attention(c, dtype, self.options, self.kind, name="self_attn")(
            x, kv_cache, layer_idx, meta, cos, sin, x_bound=x_hint)
        if c.sandwich_norms:        # Gemma: post_attention_layernorm norms attention's output
            h = h + _norm(c, dtype, "post_attention_layernorm")(attn_out)
            mlp_out = MLP(c, dtype, self.options, name="mlp")(*_norm(c, dtype, "pre_feedforward_layernorm")(h, **hint))
            h = h + _norm(c, dtype, "post_feedforward_layernorm")(mlp_out)
        else:
            h = h + attn_out
            h = h + MLP(c, dtype, self.options, name="mlp")(*_norm(c, dtype, "post_attention_layernorm")(h, **hint))
        return (h, kv_cache, layer_idx + 1), None

    def _norm_kernel(self, h) -> bool:
        """Whether this step's norms run as rms_norm_gemv_x (INT4_NORM_KERNEL): one row through the Pallas kernels,
        and both projections after the norms 4-bit with zero points, no act order, in float16 pairs."""
        c = self.cfg
        if not (INT4_NORM_KERNEL and INT4_PREPARED_X and self.options.pallas and h.shape[0] == 1
                and norm_gemv_x_supported(c.hidden_size)):
            return False
        for name in ("qkv_proj", "gate_up_proj"):
            int4 = int4_scheme(c.quant_of(name))
            if int4 is None or int4[1] or not use_f16x2(self.dtype, int4[0] or c.hidden_size):
                return False
        return True


PROMPT_HEAD_CHUNK = 2048     # tokens whose full-vocabulary logits exist at once (prompt logprobs), at most
# and at most this many bytes of their float32 logits (a power of two of tokens; 0: PROMPT_HEAD_CHUNK alone). The
# head holds several copies of a chunk (the logits, their log-softmax, the top-k's sort), which the KV pool leaves
# room for (engine/cache_sizing.py): with 512 MiB chunks gemma-2-9b's 16,384-token step took 4.75 GiB on the H100.
PROMPT_HEAD_BYTES = 128 << 20


def prompt_chunk_rows(vocab: int) -> int:
    """Tokens whose logits the prompt-logprob head computes at once."""
    return rows_within(PROMPT_HEAD_BYTES, vocab * 4, PROMPT_HEAD_CHUNK) if PROMPT_HEAD_BYTES else PROMPT_HEAD_CHUNK


class DecoderModel(nn.Module):
    """token_ids i32[T] -> (logits f32[R, V] at logits_indices, updated kv_cache, prompt head output, the last
    hidden states at logits_indices [R, H] before the final norm: what a sampler variant's head takes again
    without the layers, runner/step.py). Only those rows are handed out, so the step's extra output is R x H,
    not T x H (a prefill step's 16k tokens).

    prompt_head (optional, static): a function (logits f32[C, V], targets i32[C]) -> tuple of arrays with
    leading dim C, applied to the logits of every token of the batch in chunks of at most
    PROMPT_HEAD_CHUNK tokens, so that prompt logprobs never hold [T, V] logits at once (16k tokens x 152k
    vocabulary would be 10 GB); the outputs are concatenated back to leading dim T.
    """
    cfg: DecoderConfig
    dtype: Any
    options: RuntimeOptions = RuntimeOptions()

    @nn.compact
    def __call__(self, token_ids, kv_cache, meta: AttentionMetadata, logits_indices, prompt_targets=None,
                 prompt_head=None):
        c = self.cfg
        embed = _embed(c, self.dtype)
        h = _scale_embeddings(c, embed(token_ids))
        cos, sin = rope_cos_sin(c, meta)
        layers = nn.scan(DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                         in_axes=(nn.broadcast, nn.broadcast, nn.broadcast), length=c.num_layers)
        (h, kv_cache, _), _ = layers(c, self.dtype, self.options, name="layers")(
            (h, kv_cache, jnp.int32(0)), meta, cos, sin)
        norm = _norm(c, self.dtype, "norm")
        if c.quant_of("lm_head"):
            quantized = _quantized_head(c, self.dtype, self.options, name="lm_head")
            head = lambda x: quantized(x)[:, :c.vocab_size]      # noqa: E731  (the padded columns dropped)
        elif c.tie_word_embeddings:
            head = embed.attend
        else:
            head = Linear(c.vocab_size, False, self.dtype, held_dtype(c, self.dtype), name="lm_head")
        rows, prompt = rows_after_prompt_head(h, logits_indices, norm,
                                              lambda: head_weight(c, self.dtype, self.variables["params"]),
                                              prompt_targets, prompt_head, c.final_soft_cap)
        logits = soft_cap(head(norm(rows)).astype(jnp.float32), c.final_soft_cap)
        return logits, kv_cache, prompt, rows


def _scale_embeddings(cfg: DecoderConfig, h):
    """Gemma's embeddings times sqrt(hidden), the factor rounded to the dtype as HF rounds it."""
    return h if cfg.embed_scale is None else h * jnp.asarray(cfg.embed_scale, h.dtype)


def rope_cos_sin(cfg: DecoderConfig, meta: AttentionMetadata):
    """Each token's rotation -> (cos, sin) f32[rope kinds, T, P], P = rope_dim / 2: one kind, or the
    full-attention layers' and the sliding layers' (Gemma 3). models/rope.py; the dynamic scalings read the
    length of the token's request after this step."""
    ropes = [(cfg.rope_theta, cfg.rope_scaling)] + ([cfg.local_rope] if cfg.local_rope is not None else [])
    seq_lens = None
    if any(rope.rope_type_of(scaling) in rope.DYNAMIC_TYPES for _, scaling in ropes):
        t, r = meta.positions.shape[0], meta.seq_lens.shape[0]
        request = jnp.searchsorted(meta.query_start_loc[1:], jnp.arange(t), side="right")
        seq_lens = meta.seq_lens[jnp.minimum(request, r - 1)]
    tables = [rope.cos_sin(scaling, theta, cfg.rope_dim, cfg.max_position_embeddings, meta.positions, seq_lens)
              for theta, scaling in ropes]
    return jnp.stack([cos for cos, _ in tables]), jnp.stack([sin for _, sin in tables])


# A quantized LM head (GGUF's output blocks, or a tied embedding's) runs in the W4A16 kernel, whose column tiles
# need the vocabulary padded to a multiple of this, with zero weights; the padded logits are dropped.
HEAD_COLUMN_MULTIPLE = 64


def head_columns(vocab_size: int) -> int:
    """The quantized head's output columns: the vocabulary padded to HEAD_COLUMN_MULTIPLE."""
    return vocab_size + -vocab_size % HEAD_COLUMN_MULTIPLE


def _quantized_head(cfg: DecoderConfig, dtype, options: RuntimeOptions, name: str | None) -> nn.Module:
    """The LM head kept in GGUF's blocks (DecoderConfig.quant_of("lm_head"): GGUF_INT4 or GGUF_INT8), repacked
    for the W4A16 kernel as a [H, head_columns(V)] linear layer, in place of the tied embedding's expansion
    (every step) or the untied head's dense copy."""
    bits, group = repacked_form(cfg.quant_of("lm_head"))
    return Int4Linear(head_columns(cfg.vocab_size), cfg.hidden_size, group, False, False, dtype, options,
                      offsets=True, bits=bits, name=name)


def head_options(cfg: DecoderConfig, options: RuntimeOptions) -> RuntimeOptions | None:
    """What the head program needs of the step's options: only a quantized head's kernel reads any (its backend
    and device), so a dense head's program is one whatever the step's options."""
    if not cfg.quant_of("lm_head"):
        return None
    return RuntimeOptions(attn_backend=options.attn_backend, interpret=options.interpret, num_sms=options.num_sms)


def head_weight(cfg: DecoderConfig, dtype, params) -> jax.Array:
    """The LM head as [H, V], as held (held_dtype): the tied embedding transposed (expanded from its blocks
    when quantized, rounded to dtype), a quantized head expanded from the kernel's layout, or lm_head's
    kernel."""
    head = cfg.quant_of("lm_head")
    if head:
        bits, _ = repacked_form(head)
        q = params["lm_head"]
        w = dequantize_int4(q["qweight"], q["scales"], mins=q["mins"], dtype=dtype, bits=bits)
        return w[:cfg.hidden_size, :cfg.vocab_size].astype(held_dtype(cfg, dtype))
    if cfg.tie_word_embeddings:
        qtype = cfg.quant_of("embed_tokens")
        if qtype is not None:
            return dequantize(params["embed_tokens"]["qweight"], qtype).T.astype(dtype).astype(held_dtype(cfg, dtype))
        return params["embed_tokens"]["embedding"].T
    return params["lm_head"]["kernel"]


def prompt_head_in_chunks(h, w, targets, prompt_head, final_soft_cap: float | None = None):
    """prompt_head(logits f32[C, V], targets i32[C]) over every row of h [T, H] (already normed; w as
    head_weight gives it, the logits rounded to h's dtype before f32), at most prompt_chunk_rows(V) rows of
    logits at a time; outputs concatenated back to leading dim T."""
    def one(args):
        hc, tc = args
        return prompt_head(soft_cap(matmul(hc, w, hc.dtype).astype(jnp.float32), final_soft_cap), tc)

    return map_row_chunks(one, (h, targets), min(h.shape[0], prompt_chunk_rows(w.shape[-1])))      # w: [H, V]


def rows_after_prompt_head(h, logits_indices, norm, head_w, targets, prompt_head, final_soft_cap: float | None):
    """(h's sampled rows [R, H], the prompt head's output over every row of h, or () without one). head_w() gives
    the head's [H, V] weight (head_weight), asked for only with a prompt head. The rows come out of an optimization
    barrier with the prompt head's output, so that their [R, V] logits (computed from them after it) are not held
    across the head's chunks. Without it XLA:GPU computed those logits first and kept them, with the sampler's,
    beside the chunks' working set: gemma-2-9b's 16,384-token step under every sampler variant at once took 4.26
    GiB, where no variant alone took over 2.55."""
    rows = h[logits_indices]
    if prompt_head is None:
        return rows, ()
    prompt = prompt_head_in_chunks(norm(h), head_w(), targets, prompt_head, final_soft_cap)
    return jax.lax.optimization_barrier((rows, prompt))


# ---- the same model in three phases, for per-layer dispatch -------------------------------------------
# Inside nn.scan each layer's weights are a dynamic slice of the stacked [L, ...] weights, and XLA copies
# every slice that feeds a cuBLAS matmul (on llama3-8b, 4 copies per layer: over a third of a decode
# step at batch 256 on the H100). Per-layer dispatch keeps each layer's weights as their own arrays and runs
# one compiled layer program L times, so nothing is sliced: embed -> layer x L -> head.

def embed_phase(cfg: DecoderConfig, dtype, params, token_ids, meta: AttentionMetadata):
    """-> (h [T, H], cos, sin f32[rope kinds, T, P])."""
    h = _scale_embeddings(cfg, _embed(cfg, dtype, name=None).apply({"params": params["embed_tokens"]}, token_ids))
    return (h, *rope_cos_sin(cfg, meta))


def layer_phase(cfg: DecoderConfig, dtype, options: RuntimeOptions, layer_params, h, kv_cache, layer_idx,
                meta: AttentionMetadata, cos, sin, kind: int | None = None):
    """One decoder layer on its own weights -> (h, kv_cache). kind: the layer's (config.layer_kinds), when
    known where the program is traced."""
    (h, kv_cache, _), _ = DecoderLayer(cfg, dtype, options, kind).apply(
        {"params": layer_params}, (h, kv_cache, layer_idx), meta, cos, sin)
    return h, kv_cache


def head_phase(cfg: DecoderConfig, dtype, params, h, logits_indices, prompt_targets=None, prompt_head=None,
               options: RuntimeOptions | None = None):
    """Final norm and LM head -> (logits f32[R, V] at logits_indices, prompt head output or ()). options:
    head_options' (a quantized head's kernel)."""
    norm = lambda x: _norm(cfg, dtype, None).apply({"params": params["norm"]}, x)
    # (a quantized head is expanded for the prompt's chunks)
    rows, prompt = rows_after_prompt_head(h, logits_indices, norm, lambda: head_weight(cfg, dtype, params),
                                          prompt_targets, prompt_head, cfg.final_soft_cap)
    x = norm(rows)
    if cfg.quant_of("lm_head"):
        y = _quantized_head(cfg, dtype, options or RuntimeOptions(), None).apply({"params": params["lm_head"]}, x)
        y = y[:, :cfg.vocab_size]
    else:
        y = matmul(x, head_weight(cfg, dtype, params), dtype)
    return soft_cap(y.astype(jnp.float32), cfg.final_soft_cap), prompt


def kv_cache_dtype(cfg: DecoderConfig, dtype, platform: str):
    """The pool's dtype: the model's, or e4m3 with --kv-cache-dtype fp8 (held as bytes); on the CPU a bf16
    pool holds its values' bits (pallas_kernels.CPU_BF16_CACHE_DTYPE)."""
    if cfg.kv_cache_dtype == "fp8":
        return pallas_kernels.FP8_CACHE_DTYPE
    if platform == "cpu" and jnp.dtype(dtype) == jnp.bfloat16:
        return pallas_kernels.CPU_BF16_CACHE_DTYPE
    return dtype


def kv_cache_shape(cfg: DecoderConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """The one place the pool layout is declared: [L, 2, B, K, S, D]."""
    return (cfg.num_layers, 2, num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
