"""The tokenizer of a model folder: AutoTokenizer's, except where the folder's tokenizer_config.json names a class
that ships only as remote code and is a plain SentencePiece model underneath (Baichuan's BaichuanTokenizer).
Those load as SentencePieceTokenizer, which encodes with the folder's tokenizer.model as that class does, so
the model runs without executing code from the folder."""
from __future__ import annotations

import json
import os

# tokenizer_config.json's tokenizer_class -> read as SentencePieceTokenizer
SENTENCEPIECE_REMOTE_CLASSES = ("BaichuanTokenizer",)


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer
    config_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(config_file):
        with open(config_file) as f:
            tokenizer_class = json.load(f).get("tokenizer_class")
        if tokenizer_class in SENTENCEPIECE_REMOTE_CLASSES:
            return _sentencepiece_tokenizer_class().from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


def _sentencepiece_tokenizer_class():
    """Defined on first use: transformers' SentencePieceBackend (transformers 5) is imported only for such
    folders."""
    from transformers import SentencePieceBackend

    class SentencePieceTokenizer(SentencePieceBackend):
        """tokenizer.model through SentencePiece: ids as sp.encode gives them (BOS / EOS added as the config's
        add_bos_token / add_eos_token say), text as sp.decode gives it between special tokens."""
        vocab_files_names = {"vocab_file": "tokenizer.model"}
        model_input_names = ["input_ids", "attention_mask"]

        def __init__(self, *args, add_bos_token: bool = False, add_eos_token: bool = False, **kwargs):
            self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
            super().__init__(*args, add_bos_token=add_bos_token, add_eos_token=add_eos_token, **kwargs)

        def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
            bos = [self.bos_token_id] if self.add_bos_token else []
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
