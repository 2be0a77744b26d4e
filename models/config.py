"""The model facts the Flax decoder needs, read from an HF config.json. Explicit sizes, no engine config."""
from __future__ import annotations

import dataclasses

from .rope import rope_scaling_of

# architectures (config.json) -> family; every family runs through models/decoder.py with its flags.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
}


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
    # type (("down_proj", "Q4_1"), ...: GGUF blocks, models/loader.py gguf_weight_quant) or a checkpoint's
    # (models/quant_loader.py weight_quant_of): "int4-g<group>[-actorder]" (AWQ, GPTQ, compressed-tensors
    # W4A16; group 0: one group per output channel), "int8..." (jaxpaged/quantization/int8.py's names) or
    # "fp8..." (fp8.py's); () for dense weights.
    weight_quant: tuple[tuple[str, str], ...] = ()
    # The KV pool's dtype: "auto" (the model's) or "fp8" (e4m3, with a k_scale and v_scale per layer, the
    # checkpoint's or 1.0; vLLM's --kv-cache-dtype).
    kv_cache_dtype: str = "auto"

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

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


def _sliding_window(cfg: dict, arch: str) -> int | None:
    """The attention window, as HF transformers applies it: Mistral's and Phi-3's `sliding_window` on every layer;
    Qwen2/3's only with `use_sliding_window`, on the layers from `max_window_layers` on (or as
    `layer_types` lists them). The decoder takes one window for all layers or none: a mix is refused."""
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        return window
    if cfg.get("layer_types"):
        kinds = set(cfg["layer_types"])
    elif cfg.get("use_sliding_window", False):
        first = cfg.get("max_window_layers", 28)            # HF's Qwen2Config / Qwen3Config default
        kinds = {"sliding_attention" if i >= first else "full_attention" for i in range(cfg["num_hidden_layers"])}
    else:
        return None
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return window
    raise UnsupportedArchitectureError(
        f"layers of both sliding-window and full attention ({sorted(kinds)}) are not supported")


def decoder_config_from_hf(cfg: dict) -> DecoderConfig:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedArchitectureError(
            f"Model architectures {archs} are not supported by jaxpaged. "
            f"Supported architectures: {sorted(SUPPORTED_ARCHITECTURES)}")
    family = SUPPORTED_ARCHITECTURES[arch]
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedArchitectureError(f"{arch} with hidden_act {cfg['hidden_act']!r} is not supported "
                                           "(supported: silu)")
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    sliding = _sliding_window(cfg, arch)
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
        rope_theta=float(_get(cfg, "rope_theta", 10000.0)),
        rope_scaling=rope_scaling_of(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        sliding_window=sliding,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )
