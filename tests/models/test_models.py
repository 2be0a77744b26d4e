"""Tiny random Llama / Qwen2 / Qwen3 models: jaxpaged's logits through the paged KV cache equal HF
transformers' (PyTorch, float32) for a prefill and several decode steps."""
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import TINY_MODELS, save_tiny_chatglm, save_tiny_model
from paged_runner import PagedRunner
from jaxpaged.models import load_model


def split_layer_params(params) -> tuple[dict, list[dict]]:
    """(params without "layers", one params tree per layer) from DecoderModel's stacked params."""
    rest = {k: v for k, v in params.items() if k != "layers"}
    stacked = params["layers"]
    return rest, [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(jax.tree.leaves(stacked)[0].shape[0])]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "phi3", "phi3-partial", "gemma2", "gemma3",
                                    "gemma3-all-sliding", "glm", "glm4", "chatglm"])
def test_logits_match_hf(family, tmp_path):
    """gemma3-all-sliding: every layer windowed (no layer_types kept), so every layer takes the local rope;
    phi3-partial: rotary on the first 3/4 of each head (Phi-4-mini's partial_rotary_factor); chatglm: GLM's
    weights under ChatGLM's names and config (conftest.save_tiny_chatglm), HF's reference the Glm."""
    overrides = {"layer_types": ["sliding_attention"] * 3} if family == "gemma3-all-sliding" else \
        {"partial_rotary_factor": 0.75, "rope_scaling": None} if family == "phi3-partial" else {}
    family = family.split("-")[0]
    hf = save_tiny_chatglm(tmp_path) if family == "chatglm" else save_tiny_model(family, tmp_path, **overrides)
    loaded = load_model(tmp_path, dtype="float32")
    assert loaded.config.family == family
    _assert_hfs_logits(loaded, hf)


def _assert_hfs_logits(loaded, hf):
    """A 13-token prompt and 5 greedy steps through the paged cache: logits within 1e-4 (relative to the
    largest) of HF's one forward over the same tokens."""
    runner = PagedRunner(loaded)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 320, 13).tolist()          # 13: not a multiple of the block size
    ids = list(prompt)
    ours = [runner.step(prompt)]
    for _ in range(5):
        nxt = int(np.argmax(ours[-1][-1]))
        ids.append(nxt)
        ours.append(runner.step([nxt]))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    got = np.concatenate(ours, axis=0)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, rel


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_gemma3_multimodal_checkpoint_serves_its_language_model(prefix, tmp_path):
    """Gemma3ForConditionalGeneration, as every Gemma 3 from 4B up is published: jaxpaged serves its language
    model, text in and out. Its config is config.json's text_config, which published files keep to what differs
    from transformers' defaults (as here); its weights sit under either prefix transformers has written
    (language_model.model. as published and by transformers 5, model.language_model. by 4.5x); the vision
    tower and projector are not loaded. Logits: HF's Gemma3ForConditionalGeneration on the same text."""
    import json

    import transformers
    from safetensors.torch import load_file, save_file

    _, text = TINY_MODELS["gemma3"]
    text = {k: v for k, v in text.items() if k != "architectures"}
    config = transformers.Gemma3Config(
        text_config=text, vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=16),
        mm_tokens_per_image=4, image_token_index=300, boi_token_index=301, eoi_token_index=302)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "language_model" in name and "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    defaults = transformers.Gemma3TextConfig().to_dict()
    saved["text_config"] = {k: v for k, v in saved["text_config"].items() if k == "model_type" or defaults.get(k) != v}
    assert not {"rms_norm_eps", "hidden_activation", "attention_bias"} & saved["text_config"].keys()
    path.write_text(json.dumps(saved))
    tensors = load_file(tmp_path / "model.safetensors")
    assert any(k.startswith("language_model.model.") for k in tensors)
    if prefix != "language_model.model.":
        tensors = {k.replace("language_model.model.", prefix): v for k, v in tensors.items()}
        save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = load_model(tmp_path, dtype="float32")
    assert (loaded.config.architecture, loaded.config.family) == ("Gemma3ForConditionalGeneration", "gemma3")
    assert loaded.config.layer_types == tuple(text["layer_types"]) and loaded.config.tie_word_embeddings
    _assert_hfs_logits(loaded, hf)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])     # tied embeddings and a separate lm_head
def test_prompt_head_runs_in_chunks(family, tmp_path, monkeypatch):
    """The prompt-logprob head sees every token's logits, a few tokens at a time (here 8 of 21, padded),
    and its outputs equal the head applied to the whole [T, V] logits at once."""
    from jaxpaged.models import decoder

    save_tiny_model(family, tmp_path)
    loaded = load_model(tmp_path, dtype="float32")
    runner = PagedRunner(loaded)
    n = 21
    rng = np.random.default_rng(2)
    token_ids = jnp.asarray(rng.integers(0, 320, n), jnp.int32)
    targets = jnp.asarray(rng.integers(-1, 320, n), jnp.int32)
    meta = runner.meta(n)
    head = lambda logits, t: (jax.nn.log_softmax(logits)[jnp.arange(t.shape[0]), jnp.maximum(t, 0)], logits)
    full, _, _, _ = runner.model.apply({"params": runner.params}, token_ids, runner.kv, meta, jnp.arange(n))
    monkeypatch.setattr(decoder, "PROMPT_HEAD_CHUNK", 8)
    _, _, (lp, logits), _ = runner.model.apply({"params": runner.params}, token_ids, runner.kv, meta,
                                            jnp.arange(n), targets, head)
    assert logits.shape == full.shape
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full), rtol=1e-5, atol=1e-5)
    ref = jax.nn.log_softmax(full)[jnp.arange(n), jnp.maximum(targets, 0)]
    np.testing.assert_allclose(np.asarray(lp), np.asarray(ref), rtol=1e-5, atol=1e-5)


def _ordered_primitives(jaxpr):
    """(primitive name, output shapes) of every equation, nested jaxprs (pjit, custom calls) walked in place; a
    loop's body (scan, while) is not entered, so its own dots do not count."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        inner = eqn.params.get("jaxpr") if name not in ("scan", "while") else None
        if inner is not None:
            yield from _ordered_primitives(getattr(inner, "jaxpr", inner))
        else:
            yield name, [tuple(v.aval.shape) for v in eqn.outvars]


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])     # tied embeddings and a separate lm_head
def test_the_sampled_rows_logits_come_after_the_prompt_head(family, tmp_path):
    """With a prompt head, the sampled rows' [R, V] logits are computed after its chunked loop, through an
    optimization barrier on both (decoder.rows_after_prompt_head): XLA:GPU otherwise computed them first and held them
    beside the loop's working set (gemma-2-9b's largest step under every sampler variant: 4.26 GiB against 2.55 with
    the barrier, on the H100). Both the scanned model and the per-layer head phase."""
    from jaxpaged.models import decoder

    save_tiny_model(family, tmp_path)
    loaded = load_model(tmp_path, dtype="float32")
    runner = PagedRunner(loaded)
    n, vocab = 21, loaded.config.vocab_size
    token_ids, targets, idx = jnp.zeros(n, jnp.int32), jnp.zeros(n, jnp.int32), jnp.asarray([3, 7, n - 1], jnp.int32)
    head = lambda logits, t: (jax.nn.log_softmax(logits)[jnp.arange(t.shape[0]), jnp.maximum(t, 0)],)
    meta = runner.meta(n)
    rest, _ = split_layer_params(runner.params)
    h = jnp.zeros((n, loaded.config.hidden_size), jnp.float32)
    for fn in (lambda: runner.model.apply({"params": runner.params}, token_ids, runner.kv, meta, idx, targets, head),
               lambda: decoder.head_phase(loaded.config, jnp.float32, rest, h, idx, targets, head)):
        order = list(_ordered_primitives(jax.make_jaxpr(fn)().jaxpr))
        names = [name for name, _ in order]
        barrier = names.index("optimization_barrier")
        assert "scan" in names[:barrier]                          # the prompt head's chunks
        rows_logits = [i for i, (name, shapes) in enumerate(order) if name == "dot_general" and (3, vocab) in shapes]
        assert rows_logits and min(rows_logits) > barrier, (barrier, rows_logits)


def _dots(jaxpr):
    """(operand dtypes, precision) of every dot_general, the jaxprs nested in any equation (loops' bodies,
    pjit, conditionals' branches) walked too."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield tuple(v.aval.dtype.name for v in eqn.invars), eqn.params["precision"]
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from _dots(inner)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])       # the LM head tied and not; soft caps
def test_a_float32_model_computes_every_dot_in_float32(family, tmp_path):
    """Every float32 dot of a step (the layers' linears, attention, the LM head) asks HIGHEST precision, which
    XLA:GPU computes in float32: at JAX's default it runs them as TF32 on Ampere and later GPUs, and a float32
    run's logprobs then stray from HF float32's far past 1e-4 (bench/f32_gpu_check.py on the GPU). The CPU
    computes both alike, so this reads the traced program."""
    save_tiny_model(family, tmp_path)
    loaded = load_model(tmp_path, dtype="float32")
    runner = PagedRunner(loaded)
    n = 5
    jaxpr = jax.make_jaxpr(lambda: runner.model.apply({"params": runner.params}, jnp.zeros(n, jnp.int32), runner.kv,
                                                      runner.meta(n), jnp.arange(n)))().jaxpr
    dots = list(_dots(jaxpr))
    assert len(dots) >= 7                   # q/k/v, o, gate/up, down, attention's two, the LM head
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    assert all(dtypes == ("float32", "float32") and precision == highest for dtypes, precision in dots), dots


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2"])
def test_per_layer_phases_equal_the_scanned_model(family, tmp_path):
    """embed -> layer x L (each on its own weights) -> head gives the scanned model's logits and cache.
    Gemma 2's layers differ (windowed and full): each layer program is given its kind and compiles that
    layer's attention alone, no switch on the layer index (the scan's)."""
    from jaxpaged.models import decoder

    save_tiny_model(family, tmp_path)
    loaded = load_model(tmp_path, dtype="float32")
    cfg = loaded.config
    runner = PagedRunner(loaded)
    n = 11
    rng = np.random.default_rng(4)
    token_ids = jnp.asarray(rng.integers(0, 320, n), jnp.int32)
    meta = runner.meta(n)
    idx = jnp.asarray([3, n - 1], jnp.int32)
    want, want_kv, _, _ = runner.model.apply({"params": runner.params}, token_ids, runner.kv, meta, idx)

    rest, layers = split_layer_params(runner.params)
    assert len(layers) == cfg.num_layers
    h, cos, sin = decoder.embed_phase(cfg, jnp.float32, rest, token_ids, meta)
    kv = runner.kv
    kinds = cfg.layer_kinds() or (None,) * cfg.num_layers
    assert (family == "gemma2") == (kinds[0] is not None)
    for i, lp in enumerate(layers):
        phase = jax.jit(lambda *a, kind=kinds[i]: decoder.layer_phase(cfg, jnp.float32, decoder.RuntimeOptions(),
                                                                      *a, kind=kind))
        args = (lp, h, kv, jnp.int32(i), meta, cos, sin)
        lowered = phase.lower(*args)
        assert "stablehlo.case" not in lowered.as_text()
        h, kv = lowered.compile()(*args)
    got, _ = decoder.head_phase(cfg, jnp.float32, rest, h, idx)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(kv), np.asarray(want_kv), rtol=1e-5, atol=1e-6)


def test_dummy_weights(tmp_path):
    """load_format="dummy": every weight of the checkpoint's shapes, norms 1, the rest small and random,
    the same for the same seed; in bf16 (the CPU holds the matmul weights' bf16 values in float32)."""
    import ml_dtypes

    save_tiny_model("qwen2", tmp_path)
    real = load_model(tmp_path, dtype="float32")
    a = load_model(tmp_path, dtype="bfloat16", load_format="dummy", seed=3)
    b = load_model(tmp_path, dtype="bfloat16", load_format="dummy", seed=3)
    flat = lambda p: {"/".join(str(getattr(k, "key", k)) for k in path): x
                      for path, x in jax.tree_util.tree_flatten_with_path(p)[0]}
    ra, fa, fb = flat(real.params), flat(a.params), flat(b.params)
    assert ra.keys() == fa.keys()
    for name, x in fa.items():
        held = name.endswith(("kernel", "embedding"))
        assert x.shape == ra[name].shape and x.dtype == (jnp.float32 if held else jnp.bfloat16)
        x32 = np.asarray(x, np.float32)
        np.testing.assert_array_equal(x32, x32.astype(ml_dtypes.bfloat16).astype(np.float32))
        if name.endswith("scale"):
            assert (x32 == 1).all()
        else:
            assert np.abs(x32).max() <= 1e-3 and np.unique(x32).size > 10
        np.testing.assert_array_equal(x32, np.asarray(fb[name], np.float32))


def test_float32_checkpoint_loads_as_bfloat16(tmp_path):
    """A float32 checkpoint (as transformers saves the tiny models, and as the default model's GGUF is
    converted) loaded with dtype bfloat16 for a GPU: every parameter bf16, rounded to nearest as torch rounds,
    and nothing but the bf16 parameters stays in memory (no float32 copy of the weights). For the CPU the
    matmul weights (kernels, embedding) hold the same bf16 values in float32 (DecoderConfig.weight_dtype)."""
    import ml_dtypes

    hf = save_tiny_model("qwen3", tmp_path)
    want = load_model(tmp_path, dtype="float32").params
    def live():
        # Collect first: arrays an earlier test left in reference cycles would otherwise be freed by whichever
        # automatic collection falls inside the load and count against it.
        gc.collect()
        return sum(x.nbytes for x in jax.live_arrays())

    before = live()
    got = load_model(tmp_path, dtype="bfloat16", platform="gpu").params
    leaves = jax.tree_util.tree_leaves(got)
    assert live() - before == sum(x.nbytes for x in leaves)
    assert {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}
    for w, g in zip(jax.tree_util.tree_leaves(want), leaves):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w).astype(ml_dtypes.bfloat16))
    torch_bf16 = hf.model.embed_tokens.weight.detach().to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(np.asarray(got["embed_tokens"]["embedding"], np.float32), torch_bf16)
    cpu = load_model(tmp_path, dtype="bfloat16")
    assert cpu.config.weight_dtype == "float32"
    for (path, c), g in zip(jax.tree_util.tree_flatten_with_path(cpu.params)[0], leaves):
        held = getattr(path[-1], "key", None) in ("kernel", "embedding")
        assert c.dtype == (jnp.float32 if held else jnp.bfloat16), path
        np.testing.assert_array_equal(np.asarray(c, np.float32), np.asarray(g, np.float32))


def test_sliding_window_as_hf_applies_it():
    """Mistral's and Phi-3's window on every layer; Qwen's only with use_sliding_window and only from layer
    max_window_layers on; Gemma 2's on alternate layers, Gemma 3's on five of six (all layers windowed: one
    window; none: full attention; a mix: the window and each layer's kind); Llama has none."""
    import transformers

    from jaxpaged.models.config import decoder_config_from_hf

    def window(config_class, legacy=False, layers=4, **kw):
        cfg = getattr(transformers, config_class)(num_hidden_layers=layers, **kw).to_dict()
        cfg["architectures"] = [config_class.replace("TextConfig", "ForCausalLM").replace("Config", "ForCausalLM")]
        if legacy:      # as transformers 4 wrote config.json: no layer_types, the window kept as given
            del cfg["layer_types"]
            cfg["sliding_window"] = kw["sliding_window"]
        dc = decoder_config_from_hf(cfg)
        return dc.sliding_window, dc.layer_kinds()

    assert window("MistralConfig", sliding_window=40) == (40, ())
    assert window("MistralConfig", sliding_window=None) == (None, ())
    assert window("Phi3Config", sliding_window=40) == (40, ())
    assert window("LlamaConfig") == (None, ())
    for qwen in ("Qwen2Config", "Qwen3Config"):
        for legacy in (False, True):
            kw = dict(legacy=legacy, sliding_window=64)
            assert window(qwen, **kw) == (None, ())
            assert window(qwen, **kw, use_sliding_window=True, max_window_layers=0) == (64, ())
            assert window(qwen, **kw, use_sliding_window=True, max_window_layers=4) == (None, ())
            assert window(qwen, **kw, use_sliding_window=True, max_window_layers=2) == (64, (0, 0, 1, 1))
    for legacy in (False, True):
        assert window("Gemma2Config", legacy, sliding_window=16) == (16, (1, 0, 1, 0))
        assert window("Gemma3TextConfig", legacy, layers=7, sliding_window=16) == (16, (1, 1, 1, 1, 1, 0, 1))


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
def test_per_layer_loading_equals_the_stacked_layers(load_format, tmp_path):
    """load_model(per_layer=True) loads each layer's weights as their own arrays, never stacked: equal to
    the stacked load's slices (the dummy draw too, for the same seed)."""

    save_tiny_model("qwen2", tmp_path)
    stacked = load_model(tmp_path, dtype="float32", load_format=load_format, seed=5)
    per_layer = load_model(tmp_path, dtype="float32", load_format=load_format, seed=5, per_layer=True)
    rest, layers = split_layer_params(stacked.params)
    assert isinstance(per_layer.params["layers"], list) and len(per_layer.params["layers"]) == len(layers)
    jax.tree.map(np.testing.assert_array_equal, {**rest, "layers": layers}, per_layer.params)
