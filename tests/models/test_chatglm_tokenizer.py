"""ChatGLM2 / ChatGLM3 folders as published name `ChatGLMTokenizer`, a class that ships as remote code; jaxpaged
reads its SentencePiece model itself (jaxpaged/engine/tokenizer.py). What that class does, checked here against
sentencepiece's own encode: ids are the model's, every prompt starts [gMASK] <sop>, the special tokens take the
ids after the vocabulary in the class's order, and the chat formats give the ids the class's builders give
(ChatGLM3's build_chat_input, ChatGLM2's build_prompt)."""
import json

import pytest

from conftest import save_tiny_chatglm, train_sentencepiece
from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.tokenizer import CHATGLM3_ROLES, CHATGLM_SPECIALS, load_tokenizer

VOCAB = 300                 # SentencePiece pieces (byte fallback's 256 among them); the tiny model has 320 rows
TEXTS = ["Hello world", "sop is a word, not a token", "numbers 12345", "tabs\tand  two spaces"]
MESSAGES = [{"role": "user", "content": "Hello world"}, {"role": "assistant", "content": "The quick fox."},
            {"role": "user", "content": "Numbers 12345"}]


def write_chatglm_tokenizer(folder, chatglm3: bool, template: str | None = None) -> None:
    """tokenizer.model and tokenizer_config.json as ChatGLM's (ChatGLM3's names its role tokens)."""
    train_sentencepiece(folder, VOCAB, byte_fallback=True)
    config = {"tokenizer_class": "ChatGLMTokenizer", "padding_side": "left", "remove_space": False,
              "auto_map": {"AutoTokenizer": ["tokenization_chatglm.ChatGLMTokenizer", None]}}
    if chatglm3:
        config["additional_special_tokens"] = ["<|user|>", "<|observation|>"]
    if template:
        config["chat_template"] = template
    for f in ("tokenizer.json", "chat_template.jinja"):
        (folder / f).unlink(missing_ok=True)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def chat_reference(sp, tok, chatglm3: bool, messages) -> list[int]:
    """The ids the remote class builds for messages (then the assistant's turn)."""
    ids = tok.convert_tokens_to_ids
    prefix = [ids("[gMASK]"), ids("<sop>")]
    if chatglm3:                   # build_chat_input: role token, encode(metadata + "\n"), encode(content)
        body = [t for m in messages for t in [ids(f"<|{m['role']}|>")] + sp.encode("\n") + sp.encode(m["content"])]
        return prefix + body + [ids("<|assistant|>")]
    prompt, n = "", 0              # build_prompt: "[Round n]\n\n问：...\n\n答：..." as one text
    for m in messages:
        if m["role"] == "user":
            n += 1
            prompt += f"[Round {n}]\n\n问：{m['content']}\n\n答："
        else:
            prompt += m["content"] + "\n\n"
    return prefix + sp.encode(prompt)


@pytest.mark.parametrize("chatglm3", [False, True], ids=["chatglm2", "chatglm3"])
def test_chatglm_tokenizer_is_its_sentencepiece_model(tmp_path, chatglm3):
    import sentencepiece as spm
    write_chatglm_tokenizer(tmp_path, chatglm3)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    tok = load_tokenizer(tmp_path)
    specials = CHATGLM_SPECIALS + (CHATGLM3_ROLES if chatglm3 else ())
    assert tok.convert_tokens_to_ids(list(specials)) == list(range(VOCAB, VOCAB + len(specials)))
    assert len(tok) == VOCAB + len(specials)
    prefix = [VOCAB + 1, VOCAB + 3]                     # [gMASK] <sop>
    for text in TEXTS:
        assert tok.encode(text) == prefix + sp.encode(text)
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == sp.decode(sp.encode(text))
    assert (tok.eos_token_id, tok.pad_token_id) == (2, 0)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tok.encode(text, add_special_tokens=False) == chat_reference(sp, tok, chatglm3, MESSAGES)


def test_chatglm3_published_template_places_sop(tmp_path):
    """ChatGLM3's own template writes the prefix "[gMASK]sop"; it is read as the <sop> token."""
    template = ("{% for message in messages %}{% if loop.first %}[gMASK]sop<|{{ message['role'] }}|>\n "
                "{{ message['content'] }}{% else %}<|{{ message['role'] }}|>\n {{ message['content'] }}{% endif %}"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    import sentencepiece as spm
    write_chatglm_tokenizer(tmp_path, True, template)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    tok = load_tokenizer(tmp_path)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tok.encode(text, add_special_tokens=False) == chat_reference(sp, tok, True, MESSAGES)


def test_chatglm_serves_from_its_folder(tmp_path):
    """The tiny ChatGLM in THUDM's layout with ChatGLM3's tokenizer: LLM.chat's prompt is the chat format's ids,
    and a completion's prompt starts [gMASK] <sop>."""
    import sentencepiece as spm
    save_tiny_chatglm(tmp_path)
    write_chatglm_tokenizer(tmp_path, True)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=64, block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.chat(MESSAGES, params, use_tqdm=False)[0]
    assert out.prompt_token_ids == chat_reference(sp, llm.get_tokenizer(), True, MESSAGES)
    assert len(out.outputs[0].token_ids) == 4
    out = llm.generate(TEXTS[0], params, use_tqdm=False)[0]
    assert out.prompt_token_ids == [VOCAB + 1, VOCAB + 3] + sp.encode(TEXTS[0])


GLM4_SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                 "<|assistant|>", "<|observation|>"]
GLM4_TEMPLATE = ("[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_glm4_tokenizer(folder) -> dict[bytes, int]:
    """GLM-4's tokenizer.model as published: a tiktoken BPE file (base64 token, rank); here the 256 bytes and a
    few merges, the special tokens after them in tokenizer_config.json's added_tokens_decoder. Returns the
    ranks."""
    import base64
    ranks = {bytes([b]): b for b in range(256)}
    for merge in (b"th", b"he", b"the", b" t", b" the", b"ll", b"llo", b"He", b"Hello", b"or", b"ld", b" w",
                  b" wor", b" world", b"12", b"123"):
        ranks[merge] = len(ranks)
    (folder / "tokenizer.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    added = {str(len(ranks) + i): {"content": t, "special": True} for i, t in enumerate(GLM4_SPECIALS)}
    for f in ("tokenizer.json", "chat_template.jinja"):
        (folder / f).unlink(missing_ok=True)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "ChatGLM4Tokenizer", "added_tokens_decoder": added, "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "chat_template": GLM4_TEMPLATE, "padding_side": "left",
        "auto_map": {"AutoTokenizer": ["tokenization_chatglm.ChatGLM4Tokenizer", None]}}))
    return ranks


def test_glm4_tokenizer_is_its_tiktoken_file(tmp_path):
    """GLM-4's ChatGLM4Tokenizer: ids as tiktoken encodes with GLM-4's pattern, [gMASK] <sop> before every
    prompt, its chat template's role tokens at their ids."""
    import tiktoken

    from jaxpaged.engine.tokenizer import GLM4_PATTERN
    ranks = write_glm4_tokenizer(tmp_path)
    enc = tiktoken.Encoding("glm4-test", pat_str=GLM4_PATTERN, mergeable_ranks=ranks, special_tokens={})
    tok = load_tokenizer(tmp_path)
    ids = {t: len(ranks) + i for i, t in enumerate(GLM4_SPECIALS)}
    assert tok.convert_tokens_to_ids(GLM4_SPECIALS) == list(ids.values())
    assert (tok.eos_token_id, tok.pad_token_id) == (ids["<|endoftext|>"],) * 2
    for text in TEXTS + ["Hello world, the 12345th"]:
        assert tok.encode(text) == [ids["[gMASK]"], ids["<sop>"]] + enc.encode(text)
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    want = [ids["[gMASK]"], ids["<sop>"]]
    for m in MESSAGES:
        want += [ids[f"<|{m['role']}|>"]] + enc.encode("\n" + m["content"])
    assert tok.encode(text, add_special_tokens=False) == want + [ids["<|assistant|>"]]
