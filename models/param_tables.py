"""HF parameter names -> the Flax decoder's params: one table for every family the decoder supports, and the
GGUF tensor names of its linear layers."""
from __future__ import annotations

# Each linear layer of the decoder: its param path under a layer, and the GGUF tensors it is made of
# (concatenated on the output axis).
GGUF_LINEARS = {"qkv_proj": (("self_attn", "qkv_proj"), ("attn_q", "attn_k", "attn_v")),
                 "o_proj": (("self_attn", "o_proj"), ("attn_output",)),
                 "gate_up_proj": (("mlp", "gate_up_proj"), ("ffn_gate", "ffn_up")),
                 "down_proj": (("mlp", "down_proj"), ("ffn_down",))}
GGUF_LINEAR_OF = {n: linear for linear, (_, names) in GGUF_LINEARS.items() for n in names}
GGUF_EMBEDDING = "token_embd.weight"    # the embedding (and with it a tied LM head)
GGUF_OUTPUT = "output.weight"           # an untied LM head


# HF name inside model.layers.{i}. -> (path under params["layers"], transpose?, (part, num_parts) or None).
# Parts are concatenated on the output axis: q/k/v into one qkv_proj, gate/up into one gate_up_proj.
LAYER_TABLE = {
    "self_attn.q_proj.weight": (("self_attn", "qkv_proj", "kernel"), True, (0, 3)),
    "self_attn.k_proj.weight": (("self_attn", "qkv_proj", "kernel"), True, (1, 3)),
    "self_attn.v_proj.weight": (("self_attn", "qkv_proj", "kernel"), True, (2, 3)),
    "self_attn.o_proj.weight": (("self_attn", "o_proj", "kernel"), True, None),
    "self_attn.q_proj.bias": (("self_attn", "qkv_proj", "bias"), False, (0, 3)),
    "self_attn.k_proj.bias": (("self_attn", "qkv_proj", "bias"), False, (1, 3)),
    "self_attn.v_proj.bias": (("self_attn", "qkv_proj", "bias"), False, (2, 3)),
    "self_attn.q_norm.weight": (("self_attn", "q_norm", "scale"), False, None),
    "self_attn.k_norm.weight": (("self_attn", "k_norm", "scale"), False, None),
    "mlp.gate_proj.weight": (("mlp", "gate_up_proj", "kernel"), True, (0, 2)),
    "mlp.up_proj.weight": (("mlp", "gate_up_proj", "kernel"), True, (1, 2)),
    "mlp.down_proj.weight": (("mlp", "down_proj", "kernel"), True, None),
    # Phi-3 stores q/k/v and gate/up already fused, in the decoder's order (so do Baichuan and ChatGLM, under
    # other names: LAYER_RENAMES)
    "self_attn.qkv_proj.weight": (("self_attn", "qkv_proj", "kernel"), True, None),
    "self_attn.qkv_proj.bias": (("self_attn", "qkv_proj", "bias"), False, None),          # ChatGLM
    "mlp.gate_up_proj.weight": (("mlp", "gate_up_proj", "kernel"), True, None),
    "input_layernorm.weight": (("input_layernorm", "scale"), False, None),
    "post_attention_layernorm.weight": (("post_attention_layernorm", "scale"), False, None),
    "pre_feedforward_layernorm.weight": (("pre_feedforward_layernorm", "scale"), False, None),   # Gemma 2/3
    "post_feedforward_layernorm.weight": (("post_feedforward_layernorm", "scale"), False, None),
    # an fp8 KV cache's per-layer scales (vLLM's names; compressed-tensors writes them on k_proj / v_proj)
    "self_attn.k_scale": (("self_attn", "k_scale"), False, None),
    "self_attn.v_scale": (("self_attn", "v_scale"), False, None),
    "self_attn.k_proj.output_scale": (("self_attn", "k_scale"), False, None),
    "self_attn.v_proj.output_scale": (("self_attn", "v_scale"), False, None),
}
KV_SCALES = ("k_scale", "v_scale")
TOP_TABLE = {
    "model.embed_tokens.weight": (("embed_tokens", "embedding"), False),
    "model.norm.weight": (("norm", "scale"), False),
    "lm_head.weight": (("lm_head", "kernel"), True),
}


LAYER_PREFIX = "model.layers."

# Other layouts' names -> the tables' names, per family: whole names, the prefix of a layer's names, and the
# modules within a layer (whatever their tensors: a quantized checkpoint's qweight and scales are renamed
# with the module's weight).
TOP_RENAMES = {"chatglm": {"transformer.embedding.word_embeddings.weight": "model.embed_tokens.weight",
                           "transformer.encoder.final_layernorm.weight": "model.norm.weight",
                           "transformer.output_layer.weight": "lm_head.weight"}}
LAYER_PREFIXES = {"chatglm": "transformer.encoder.layers."}
LAYER_RENAMES = {
    # GLM-4-0414's four norms are Gemma's under other names: its post_attention_layernorm is the MLP's input norm
    "glm4": {"post_self_attn_layernorm": "post_attention_layernorm",
             "post_attention_layernorm": "pre_feedforward_layernorm",
             "post_mlp_layernorm": "post_feedforward_layernorm"},
    "baichuan": {"self_attn.W_pack": "self_attn.qkv_proj"},     # q, k, v packed
    # ChatGLM2 / ChatGLM3 / GLM-4 as THUDM published them: q, k, v fused (in that order), gate and up fused
    "chatglm": {"self_attention.query_key_value": "self_attn.qkv_proj",
                "self_attention.dense": "self_attn.o_proj",
                "mlp.dense_h_to_4h": "mlp.gate_up_proj",
                "mlp.dense_4h_to_h": "mlp.down_proj"},
}


# A multimodal checkpoint's language model (config.MULTIMODAL_TEXT): published files and transformers 5 write it
# under language_model.model., transformers 4.5x under model.language_model.; its vision tower and projector
# match no table entry and are not loaded.
LANGUAGE_MODEL_PREFIXES = ("language_model.model.", "model.language_model.")


def table_name(family: str, name: str) -> str:
    """A checkpoint tensor's name as the tables spell it ("model.layers.3.self_attn.o_proj.weight")."""
    for language_model in LANGUAGE_MODEL_PREFIXES:
        if name.startswith(language_model):
            name = "model." + name[len(language_model):]
    if name == "language_model.lm_head.weight":
        name = "lm_head.weight"
    top = TOP_RENAMES.get(family, {})
    if name in top:
        return top[name]
    prefix = LAYER_PREFIXES.get(family, LAYER_PREFIX)
    if not name.startswith(prefix):
        return name
    idx, sub = name[len(prefix):].split(".", 1)
    module, dot, leaf = sub.rpartition(".")
    return f"{LAYER_PREFIX}{idx}.{LAYER_RENAMES.get(family, {}).get(module, module)}{dot}{leaf}"


# The linear layers a checkpoint may store fused (Phi-3's, GLM's gate / up, Baichuan's and ChatGLM's after
# LAYER_RENAMES): param path -> the fused module, which a quantized checkpoint then quantizes as one.
FUSED_MODULES = {("self_attn", "qkv_proj"): "self_attn.qkv_proj", ("mlp", "gate_up_proj"): "mlp.gate_up_proj"}


def _linear_modules() -> dict[tuple, list[str]]:
    """Each linear layer's param path under a layer -> its HF modules when stored separately, in the order their
    outputs concatenate: ("self_attn", "qkv_proj") -> ["self_attn.q_proj", "self_attn.k_proj",
    "self_attn.v_proj"] (FUSED_MODULES: the one module of a checkpoint that stores them fused)."""
    parts: dict[tuple, dict[int, str]] = {}
    for name, (path, _, part) in LAYER_TABLE.items():
        if path[-1] == "kernel" and name[:-len(".weight")] not in FUSED_MODULES.values():
            parts.setdefault(path[:-1], {})[(part or (0, 1))[0]] = name[:-len(".weight")]
    return {path: [modules[i] for i in sorted(modules)] for path, modules in parts.items()}


LINEAR_MODULES = _linear_modules()
