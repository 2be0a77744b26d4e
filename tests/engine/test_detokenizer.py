"""Incremental detokenization with the SmolLM2 tokenizer (byte-level BPE): multi-byte characters split
across tokens, stop strings across token boundaries, what streaming may release."""
import pytest
from transformers import AutoTokenizer

from jaxpaged.engine import detokenizer as detok_mod
from jaxpaged.engine.detokenizer import IncrementalDetokenizer
from jaxpaged.engine.llm_engine import resolve_model_path


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_model_path(None))


@pytest.fixture(params=["bytes", "decode"])
def make(request, tok, monkeypatch):
    """Both paths: the byte table (byte-level BPE) and the generic decode-window fallback."""
    if request.param == "decode":
        monkeypatch.setattr(detok_mod, "_byte_table", lambda *a: None)
    else:      # the byte-level decoder is recognised, so this path really is the table's
        assert IncrementalDetokenizer(tok, [])._table is not None
    return lambda prompt=(), **kw: IncrementalDetokenizer(tok, list(prompt), **kw)


def feed(d, ids):
    """One token at a time, as the engine does; returns the texts seen after each token."""
    seen = []
    for t in ids:
        m = d.add_tokens([t])
        seen.append(d.output_text)
        if m is not None:
            return seen, m
    return seen, None


def test_multibyte_characters_split_across_tokens(tok, make):
    text = "héllo 世界 🎉 ok"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)      # the tokenizer really splits characters
    d = make(tok.encode("Say:"))
    seen, _ = feed(d, ids)
    assert d.output_text == text
    assert all("\ufffd" not in s for s in seen)                 # never a half character on the way
    assert all(text.startswith(s) for s in seen)


def test_stop_string_across_token_boundaries(tok, make):
    ids = tok.encode("Hello world. STOP here and more")
    assert tok.decode(ids[3:5]) == " STOP"                       # " ST" + "OP"
    d = make(stop=["STOP"])
    _, m = feed(d, ids)
    assert m.stop == "STOP" and d.output_text == "Hello world. "
    d = make(stop=["STOP"], include_stop_str_in_output=True)
    _, m = feed(d, ids)
    assert d.output_text == "Hello world. STOP"
    # the earliest of several stop strings wins, also when it ends inside a token
    d = make(stop=["here", "d. S"])
    _, m = feed(d, ids)
    assert m.stop == "d. S" and d.output_text == "Hello worl"


def test_streaming_holds_back_a_possible_stop_prefix(tok, make):
    d = make(stop=["STOP"])
    d.add_tokens(tok.encode("Hello world. ST"))
    assert d.output_text == "Hello world. ST"
    assert d.releasable_len(False) == len("Hello world. ST") - 3
    assert d.releasable_len(True) == len(d.output_text)


def test_skip_special_tokens(tok, make):
    ids = tok.encode("ab<|endoftext|>c")
    d = make(skip_special_tokens=True)
    feed(d, ids)
    assert d.output_text == "abc"
    d = make(skip_special_tokens=False)
    feed(d, ids)
    assert d.output_text == "ab<|endoftext|>c"


def test_skips_what_hf_decode_skips(tok, make):
    """Every special token HF's decode drops: the named ones and the added tokens marked special that no
    attribute names (SmolLM2's <repo_name>, <file_sep>, ...: ids 3-16)."""
    ids = [*tok.encode("ab"), *range(20), *tok.encode(" cd")]
    for skip in (True, False):
        d = make(skip_special_tokens=skip)
        feed(d, ids)
        assert d.output_text == tok.decode(ids, skip_special_tokens=skip)
