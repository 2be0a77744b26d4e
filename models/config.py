"""The model facts the Flax decoder needs, read from an HF config.json. Explicit sizes, no engine config."""
from __future__ import annotations

import dataclasses
import math

from .rope import UnsupportedRopeError, rope_scaling_of

# architectures (config.json) -> family; every family runs through models/decoder.py with its flags.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",   # Gemma 3 from 4B up: its language model (text in and out)
    "BaiChuanForCausalLM": "baichuan",       # Baichuan-7B
    "BaichuanForCausalLM": "baichuan",       # Baichuan-13B, Baichuan2-7B / -13B
    "GlmForCausalLM": "glm",                 # GLM-4 in transformers' layout
    "Glm4ForCausalLM": "glm4",               # GLM-4-0414: four norms a layer
    "ChatGLMModel": "chatglm",               # ChatGLM2, ChatGLM3, GLM-4 as THUDM published them
    "ChatGLMForConditionalGeneration": "chatglm",
}
BAICHUAN2_VOCAB = 125696     # Baichuan2's vocabulary: its LM head is normalized (vLLM's test)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}    # HF's name -> the decoder's
FULL, SLIDING = "full_attention", "sliding_attention"              # HF's layer types
PARTIAL_ROTARY_FAMILIES = ("phi3", "glm", "glm4", "chatglm")        # rotary on a head's first dims only
# Multimodal checkpoints whose language model jaxpaged serves, text in and text out (the vision tower is not
# loaded): architecture -> transformers' config class of config.json's text_config
MULTIMODAL_TEXT = {"Gemma3ForConditionalGeneration": "Gemma3TextConfig"}


class UnsupportedArchitectureError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple | None          # sorted (key, value) pairs of HF's rope scaling, hashable (models/rope.py)
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool                      # Qwen2
    qk_norm: bool                       # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    # Linear layers whose weights stay quantized on the device: sorted (name, scheme) pairs, the scheme a GGUF
    # type for the embedding (("embed_tokens", "Q8_0"): its blocks, models/loader.py gguf_weight_quant),
    # "gguf-int4" or "gguf-int8-g16" / "-g32" (GGUF's blocks repacked for the W4A16 kernel as 4- or 8-bit
    # values: gguf_blocks.GGUF_INT4, GGUF_INT8), or a checkpoint's
    # (models/quant_loader.py weight_quant_of): "int4-g<group>[-actorder]" (AWQ, GPTQ, compressed-tensors
    # W4A16; group 0: one group per output channel), "int8..." (jaxpaged/quantization/int8.py's names) or
    # "fp8..." (fp8.py's); () for dense weights.
    weight_quant: tuple[tuple[str, str], ...] = ()
    # The dtype the dense matmul weights (linear kernels, embedding, LM head) are held in when it is not the
    # model's: "float32" for bf16 on the CPU (models/loader.py held_weight_dtype), each value a bf16 one. XLA:CPU
    # computes a bf16 dot by converting both operands to f32, and under the layer scan it converted every
    # layer's weights at every step; held in f32, they are converted once, at load. None: the model's dtype.
    weight_dtype: str | None = None
    # The KV pool's dtype: "auto" (the model's) or "fp8" (e4m3, with a k_scale and v_scale per layer, the
    # checkpoint's or 1.0; vLLM's --kv-cache-dtype).
    kv_cache_dtype: str = "auto"
    # Gemma 2 / 3
    hidden_act: str = "silu"                  # silu | gelu_tanh (HF's gelu_pytorch_tanh)
    norm_plus_one: bool = False               # RMSNorm scales by (1 + w), in float32
    sandwich_norms: bool = False              # four norms a layer: attention's and the MLP's outputs normed too
    embed_scale: float | None = None          # embeddings times this (sqrt(hidden), rounded to the dtype)
    query_scale: float | None = None          # attention's scale (None: head_dim ** -0.5)
    attn_soft_cap: float | None = None        # scores -> cap * tanh(scores / cap)
    final_soft_cap: float | None = None       # logits -> cap * tanh(logits / cap)
    # Per-layer attention kinds when layers differ (FULL or SLIDING each; None: every layer alike, windowed
    # when sliding_window is set), and then the sliding layers' own rope (theta, scaling) where it differs
    # (Gemma 3; with every layer alike, rope_theta / rope_scaling are the one they take)
    layer_types: tuple[str, ...] | None = None
    local_rope: tuple[float, tuple | None] | None = None
    # Rotary over the first rotary_dim dims of each head only (HF's partial_rotary_factor; None: all), and on
    # adjacent pairs (GLM, ChatGLM) rather than rotate_half's two halves
    rotary_dim: int | None = None
    rope_interleaved: bool = False
    # Baichuan: ALiBi instead of rope (the 13B models), and Baichuan2's LM head rows L2-normalized at load
    alibi: bool = False
    norm_head: bool = False

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def rope_dim(self) -> int:
        """The head dims the rotary embedding turns."""
        return self.rotary_dim or self.head_dim

    def layer_kinds(self) -> tuple[int, ...]:
        """Per layer: 0 full attention, 1 sliding window (indexes attention_windows and the rope tables)."""
        return tuple(int(t == SLIDING) for t in self.layer_types or ())

    def alibi_slopes(self):
        """ALiBi's per-head slopes f32[N] (Baichuan's: geometric from 2^(-8/n) for a power-of-two head count,
        else that of the power of two below it and every other slope of the one above), or None."""
        import numpy as np
        if not self.alibi:
            return None

        def slopes(n: int) -> list[float]:
            if math.log2(n).is_integer():
                start = 2 ** (-(2 ** -(math.log2(n) - 3)))
                return [start * start ** i for i in range(n)]
            below = 2 ** math.floor(math.log2(n))
            return slopes(below) + slopes(2 * below)[0::2][:n - below]
        return np.asarray(slopes(self.num_heads), np.float32)

    def attention_windows(self) -> tuple[int | None, ...]:
        """The window of each layer kind: (None, sliding_window) when layers differ, else (sliding_window,)."""
        return (None, self.sliding_window) if self.layer_types else (self.sliding_window,)

    def quant_of(self, linear: str) -> str | None:
        """The scheme a linear layer's weight is stored in, or None (dense)."""
        return dict(self.weight_quant).get(linear)


def _get(cfg: dict, key: str, default=None):
    # transformers 5 nests rope settings in rope_parameters; 4.x keeps them flat.
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    rope = cfg.get("rope_parameters") or {}
    if key == "rope_theta" and "rope_theta" in rope:
        return rope["rope_theta"]
    return default


def _layer_types(cfg: dict, arch: str) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) as HF transformers applies them: Mistral's and Phi-3's window on every
    layer; Gemma 2's on alternate layers (the even ones), Gemma 3's on all but every sliding_window_pattern-th
    (or as `layer_types` lists them); Qwen2/3's only with `use_sliding_window`, on the layers from
    `max_window_layers` on. layer_types is None when every layer is alike."""
    window = cfg.get("sliding_window")
    n = cfg["num_hidden_layers"]
    if window is None:
        return None, None
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        return window, None
    if cfg.get("layer_types"):
        types = tuple(cfg["layer_types"])
    elif arch == "Gemma2ForCausalLM":
        types = tuple(SLIDING if (i + 1) % 2 else FULL for i in range(n))
    elif arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
        pattern = cfg.get("sliding_window_pattern", 6)
        types = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n))
    elif cfg.get("use_sliding_window", False):
        first = cfg.get("max_window_layers", 28)            # HF's Qwen2Config / Qwen3Config default
        types = tuple(SLIDING if i >= first else FULL for i in range(n))
    else:
        return None, None
    if set(types) - {FULL, SLIDING}:
        raise UnsupportedArchitectureError(f"layer types {sorted(set(types) - {FULL, SLIDING})} are not supported")
    if set(types) == {FULL}:
        return None, None
    return window, (None if set(types) == {SLIDING} else types)


def _partial_rotary_factor(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return float(params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)


def _rope(cfg: dict) -> tuple[float, tuple | None, tuple[float, tuple | None] | None]:
    """(rope_theta, scaling) of the (full-attention) layers, and the sliding layers' own (theta, scaling) when
    they have one: Gemma 3's rope_parameters per layer type (transformers 5), or rope_local_base_freq (4.x)."""
    params = cfg.get("rope_parameters") or {}
    if FULL in params:                                         # one set of rope parameters per layer type
        def one(p: dict):
            return float(p.get("rope_theta", 10000.0)), rope_scaling_of({"rope_parameters": p})
        full = one(params[FULL])
        local = one(params[SLIDING]) if SLIDING in params else None
        return full[0], full[1], (local if local != full else None)
    local = (float(cfg["rope_local_base_freq"]), None) if cfg.get("rope_local_base_freq") else None
    return float(_get(cfg, "rope_theta", 10000.0)), rope_scaling_of(cfg), local


def _chatglm_as_glm(cfg: dict) -> dict:
    """ChatGLM2 / ChatGLM3 / GLM-4's own config.json (model_type "chatglm", read by their remote code) in
    transformers' GlmConfig terms: the same model (RMSNorm, multi-query attention over multi_query_group_num
    kv heads, q/k/v bias, gate and up fused, rotary on the first half of each head with base 10000 *
    rope_ratio). ChatGLM-6B (the first one: LayerNorm, 2D positions) is refused."""
    if (not cfg.get("rmsnorm") or cfg.get("apply_residual_connection_post_layernorm")
            or not cfg.get("post_layer_norm", True) or cfg.get("add_bias_linear")):
        raise UnsupportedArchitectureError(
            "ChatGLM checkpoints are supported in ChatGLM2 / ChatGLM3 / GLM-4's layout only (rmsnorm, no bias on "
            "the dense layers, a final norm, the residual before the norm); this config.json is not")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    return {
        **{k: cfg[k] for k in ("architectures", "eos_token_id", "bos_token_id", "torch_dtype", "dtype") if k in cfg},
        "vocab_size": cfg["padded_vocab_size"], "hidden_size": hidden, "intermediate_size": cfg["ffn_hidden_size"],
        "num_hidden_layers": cfg["num_layers"], "num_attention_heads": heads,
        "num_key_value_heads": cfg["multi_query_group_num"] if cfg.get("multi_query_attention") else heads,
        "head_dim": cfg.get("kv_channels") or hidden // heads, "rms_norm_eps": cfg.get("layernorm_epsilon", 1e-5),
        "rope_theta": 10000.0 * cfg.get("rope_ratio", 1.0), "partial_rotary_factor": 0.5,
        "max_position_embeddings": cfg.get("seq_length", 2048), "attention_bias": bool(cfg.get("add_qkv_bias")),
        "tie_word_embeddings": False,
        # original_rope: false turns the halves (NeoX style) rather than adjacent pairs (vLLM's reading)
        "rope_interleaved": cfg.get("original_rope", True),
    }


def _text_config(cfg: dict, arch: str) -> dict:
    """A multimodal checkpoint's language model config: its text_config with transformers' defaults filled in
    (published config.json files keep only what differs from them), and the top level's dtype, token ids and
    tied embeddings where it states them."""
    import transformers
    text = getattr(transformers, MULTIMODAL_TEXT[arch])(**(cfg.get("text_config") or {})).to_dict()
    text.update({k: cfg[k] for k in ("torch_dtype", "dtype", "bos_token_id", "eos_token_id", "tie_word_embeddings")
                 if cfg.get(k) is not None})
    return {**text, "architectures": [arch]}


def decoder_config_from_hf(cfg: dict) -> DecoderConfig:
    archs = cfg.get("architectures") or []
    if set(archs) & {a for a, f in SUPPORTED_ARCHITECTURES.items() if f == "chatglm"}:
        cfg = _chatglm_as_glm(cfg)
    multimodal = next((a for a in archs if a in MULTIMODAL_TEXT), None)
    if multimodal is not None:
        cfg = _text_config(cfg, multimodal)
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedArchitectureError(
            f"Model architectures {archs} are not supported by jaxpaged. "
            f"Supported architectures: {sorted(SUPPORTED_ARCHITECTURES)}")
    family = SUPPORTED_ARCHITECTURES[arch]
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise UnsupportedArchitectureError(f"{arch} with activation {act!r} is not supported "
                                           f"(supported: {', '.join(ACTIVATIONS)})")
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    sliding, layer_types = _layer_types(cfg, arch)
    theta, scaling, local_rope = _rope(cfg)
    if local_rope is not None and layer_types is None:     # every layer alike: the one rope they all take
        theta, scaling = local_rope if sliding is not None else (theta, scaling)
        local_rope = None
    gemma = family in ("gemma2", "gemma3")
    glm = family in ("glm", "glm4", "chatglm")
    rotary = int(head_dim * _partial_rotary_factor(cfg))
    if rotary != head_dim and family not in PARTIAL_ROTARY_FAMILIES:
        raise UnsupportedRopeError(f"partial_rotary_factor below 1 is supported for "
                                   f"{', '.join(PARTIAL_ROTARY_FAMILIES)} only, as transformers applies it")
    return DecoderConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings") or cfg.get("model_max_length") or 2048,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=family in ("qwen3", "gemma3"),
        sliding_window=sliding,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        hidden_act=ACTIVATIONS[act],
        norm_plus_one=gemma,
        sandwich_norms=gemma or family == "glm4",
        embed_scale=cfg["hidden_size"] ** 0.5 if gemma else None,
        query_scale=cfg["query_pre_attn_scalar"] ** -0.5 if gemma and cfg.get("query_pre_attn_scalar") else None,
        attn_soft_cap=cfg.get("attn_logit_softcapping") if gemma else None,
        final_soft_cap=cfg.get("final_logit_softcapping") if gemma else None,
        layer_types=layer_types,
        local_rope=local_rope,
        rotary_dim=rotary if rotary != head_dim else None,
        rope_interleaved=bool(cfg.get("rope_interleaved", True)) if glm else False,
        # vLLM's rules: Baichuan-7B's class uses rope, BaichuanForCausalLM does at hidden size 4096 (the 7B
        # models) and ALiBi otherwise (the 13B ones)
        alibi=arch == "BaichuanForCausalLM" and cfg["hidden_size"] != 4096,
        norm_head=family == "baichuan" and cfg["vocab_size"] == BAICHUAN2_VOCAB,
    )
