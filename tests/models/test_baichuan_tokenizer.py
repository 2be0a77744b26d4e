"""A Baichuan folder as published names `BaichuanTokenizer`, a class that ships as remote code; jaxpaged reads its
SentencePiece model itself (jaxpaged/engine/tokenizer.py): ids as sentencepiece's own encode gives them, text as
its decode gives it, BOS as the config says, and the model serves from the folder without running its code."""
import json

import numpy as np
import pytest

from conftest import save_tiny_baichuan, train_sentencepiece
from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.tokenizer import load_tokenizer

TEXTS = ["Hello world", " leading space", "The quick brown fox jumps.", "tabs\tand  two spaces", "numbers 12345"]


def write_baichuan_tokenizer(folder, add_bos: bool) -> None:
    """A SentencePiece BPE model of 120 pieces trained here (the tiny model's vocabulary) and
    tokenizer_config.json as Baichuan2's (its auto_map points at code the folder does not have)."""
    train_sentencepiece(folder, 120, add_dummy_prefix=False, normalization_rule_name="identity",
                        remove_extra_whitespaces=False)
    for f in ("tokenizer.json", "chat_template.jinja"):
        (folder / f).unlink(missing_ok=True)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BaichuanTokenizer", "add_bos_token": add_bos, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>",
        "auto_map": {"AutoTokenizer": ["tokenization_baichuan.BaichuanTokenizer", None]}}))


@pytest.mark.parametrize("add_bos", [False, True])
def test_baichuan_tokenizer_is_its_sentencepiece_model(tmp_path, add_bos):
    import sentencepiece as spm
    save_tiny_baichuan(tmp_path, alibi=True, vocab_size=120)        # the tokenizer's vocabulary
    write_baichuan_tokenizer(tmp_path, add_bos)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    tok = load_tokenizer(tmp_path)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ([1] if add_bos else []) + sp.encode(text)
        assert tok.decode(ids, skip_special_tokens=True) == text == sp.decode(sp.encode(text))
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    # the engine loads it too, and its prompt ids are the tokenizer's
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=64, block_size=8)
    out = llm.generate(TEXTS[2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode(TEXTS[2])
    assert len(out.outputs[0].token_ids) == 4 and np.all(np.asarray(out.outputs[0].token_ids) < 120)
