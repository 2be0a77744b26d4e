"""The tokenizer of a model folder: AutoTokenizer's, except where the folder's tokenizer_config.json names a class
that ships only as remote code over a tokenizer.model the well-kept libraries read: Baichuan's
BaichuanTokenizer and ChatGLM2 / ChatGLM3's ChatGLMTokenizer (SentencePiece models), and GLM-4's
ChatGLM4Tokenizer (a tiktoken BPE file). Each encodes as that class does, so the model runs without executing
code from the folder."""
from __future__ import annotations

import json
import os

# tokenizer_config.json's tokenizer_class -> read as SentencePieceTokenizer
SENTENCEPIECE_REMOTE_CLASSES = ("BaichuanTokenizer",)
CHATGLM_REMOTE_CLASS = "ChatGLMTokenizer"
CHATGLM4_REMOTE_CLASS = "ChatGLM4Tokenizer"
# GLM-4's pre-tokenizer split (its tokenization_chatglm.py's pat_str)
GLM4_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# ChatGLM2 / ChatGLM3's tokens after the SentencePiece vocabulary, in id order. sop and eop are spelled <sop> and
# <eop>, as GLM-4 spells them, so that a chat template can place them while the word "sop" in a prompt stays text.
CHATGLM_SPECIALS = ("[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>")
CHATGLM3_ROLES = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
CHATGLM_PREFIX = ("[gMASK]", "<sop>")          # before every prompt (the remote class's get_prefix_tokens)
# The chat formats of ChatGLM3 (its build_chat_input: a role token, a newline, the content) and ChatGLM2 (its
# build_prompt's rounds), for folders whose tokenizer_config.json has no chat_template; the prefix is the
# template's, so the rendered text is encoded without special tokens added, as every chat prompt is.
CHATGLM3_TEMPLATE = ("[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n {{ m['content'] }}{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CHATGLM2_TEMPLATE = (
    "[gMASK]<sop>{% set round = namespace(n=0) %}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{% set round.n = round.n + 1 %}"
    "{{ '[Round ' ~ round.n ~ ']\n\n问：' ~ m['content'] ~ '\n\n答：' }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] ~ '\n\n' }}{% endif %}{% endfor %}")


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer
    config_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(config_file):
        with open(config_file) as f:
            config = json.load(f)
        tokenizer_class = config.get("tokenizer_class")
        if tokenizer_class in SENTENCEPIECE_REMOTE_CLASSES:
            return _sentencepiece_tokenizer_class().from_pretrained(str(path))
        if tokenizer_class == CHATGLM_REMOTE_CLASS:
            return _chatglm_tokenizer(path, config)
        if tokenizer_class == CHATGLM4_REMOTE_CLASS:
            return _chatglm4_tokenizer(path, config)
    return AutoTokenizer.from_pretrained(str(path))


def _chatglm4_tokenizer(path, config: dict):
    """GLM-4's ChatGLM4Tokenizer: tokenizer.model is a tiktoken BPE file (a base64 token and its rank a line),
    split by GLM4_PATTERN, read through transformers' TikTokenConverter (a byte-level BPE, as tiktoken encodes);
    the special tokens are tokenizer_config.json's added_tokens_decoder, at their ids after the ranks; every
    prompt starts [gMASK] <sop> (a pair: [gMASK] <sop> A B <eos>, as the class builds it). Converting the
    merges of GLM-4's 151k ranks takes a few seconds."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    added = {int(i): t["content"] if isinstance(t, dict) else t
             for i, t in config.get("added_tokens_decoder", {}).items()}
    specials = [added[i] for i in sorted(added)]
    backend = TikTokenConverter(vocab_file=os.path.join(path, "tokenizer.model"), pattern=GLM4_PATTERN,
                                extra_special_tokens=specials).converted()
    for i, token in added.items():
        if backend.token_to_id(token) != i:
            raise ValueError(f"{path}: special token {token!r} is id {i} in tokenizer_config.json, but follows the "
                             f"tiktoken ranks at {backend.token_to_id(token)}")
    eos = config.get("eos_token") or "<|endoftext|>"
    eos = eos["content"] if isinstance(eos, dict) else eos
    prefix = [(t, backend.token_to_id(t)) for t in CHATGLM_PREFIX]
    backend.post_processor = processors.TemplateProcessing(
        single="[gMASK] <sop> $A", pair=f"[gMASK] <sop> $A $B {eos}",
        special_tokens=prefix + [(eos, backend.token_to_id(eos))])
    pad = config.get("pad_token") or eos
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos,
                                   pad_token=pad["content"] if isinstance(pad, dict) else pad,
                                   chat_template=config.get("chat_template"), clean_up_tokenization_spaces=False,
                                   model_max_length=config.get("model_max_length", 128000))


def _sentencepiece_tokenizer_class():
    """Defined on first use: transformers' SentencePieceBackend (transformers 5) is imported only for such
    folders."""
    from transformers import SentencePieceBackend

    class SentencePieceTokenizer(SentencePieceBackend):
        """tokenizer.model through SentencePiece: ids as sp.encode gives them (BOS / EOS added as the config's
        add_bos_token / add_eos_token say), text as sp.decode gives it between special tokens."""
        vocab_files_names = {"vocab_file": "tokenizer.model"}
        model_input_names = ["input_ids", "attention_mask"]

        def __init__(self, *args, add_bos_token: bool = False, add_eos_token: bool = False,
                     prefix_tokens: tuple[str, ...] = (), **kwargs):
            self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
            self.prefix_tokens = prefix_tokens       # special tokens before every sequence (ChatGLM's)
            super().__init__(*args, add_bos_token=add_bos_token, add_eos_token=add_eos_token, **kwargs)

        def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
            bos = ([self.bos_token_id] if self.add_bos_token else []) + \
                [self.convert_tokens_to_ids(t) for t in self.prefix_tokens]
            eos = [self.eos_token_id] if self.add_eos_token else []
            out = bos + list(token_ids_0) + eos
            return out if token_ids_1 is None else out + bos + list(token_ids_1) + eos

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            special = set(self.all_special_tokens)
            out: list[str] = []
            run: list[str] = []
            for t in tokens:
                if t in special:
                    out += [self.sp_model.decode(run), t]
                    run = []
                else:
                    run.append(t)
            return "".join(out + [self.sp_model.decode(run)])

    return SentencePieceTokenizer


def _chatglm_tokenizer(path, config: dict):
    """ChatGLM2 / ChatGLM3's tokenizer: the SentencePiece model's ids, then CHATGLM_SPECIALS and (ChatGLM3, whose
    tokenizer_config.json names its role tokens) CHATGLM3_ROLES as special tokens in that order; every prompt
    starts [gMASK] <sop>; EOS is the model's </s>, padding its <unk>. The folder's chat template, else
    ChatGLM3's or ChatGLM2's format; a template that writes the prefix as the remote class spells it
    ("[gMASK]sop") is read with <sop>."""
    import sentencepiece as spm

    chatglm3 = any(role in json.dumps(config) for role in CHATGLM3_ROLES)
    specials = CHATGLM_SPECIALS + (CHATGLM3_ROLES if chatglm3 else ())
    sp = spm.SentencePieceProcessor(model_file=os.path.join(path, "tokenizer.model"))
    template = config.get("chat_template")
    template = (template.replace("[gMASK]sop", "[gMASK]<sop>") if template else
                CHATGLM3_TEMPLATE if chatglm3 else CHATGLM2_TEMPLATE)
    tok = _sentencepiece_tokenizer_class()(
        vocab_file=os.path.join(path, "tokenizer.model"), bos_token=sp.id_to_piece(sp.bos_id()),
        eos_token=sp.id_to_piece(sp.eos_id()), unk_token=sp.id_to_piece(sp.unk_id()),
        pad_token=sp.id_to_piece(sp.unk_id()), prefix_tokens=CHATGLM_PREFIX, chat_template=template)
    tok.add_special_tokens({"additional_special_tokens": list(specials)})
    assert tok.convert_tokens_to_ids(specials[0]) == sp.vocab_size(), "ChatGLM's special ids follow the vocabulary"
    return tok
