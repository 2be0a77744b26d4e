"""Incremental detokenization and stop strings.

Decoding token by token is wrong for byte-level BPE: a multi-byte character (an emoji, CJK) can span
tokens, and decoding a prefix yields U+FFFD. As HF's TextStreamer and vLLM do, we decode a short window
twice — up to the last emitted point and up to now — and emit the difference only once it no longer ends
in an incomplete character.
"""
from __future__ import annotations

import codecs
import functools
from typing import NamedTuple

_REPLACEMENT = "\ufffd"


class StopMatch(NamedTuple):
    stop: str
    text_end: int       # where the output text is cut


def bytes_to_unicode() -> dict[str, int]:
    """GPT-2's printable stand-ins for the 256 byte values, inverted: character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@functools.lru_cache(maxsize=8)
def _byte_table(tokenizer, skip_special_tokens: bool) -> list[bytes] | None:
    """id -> raw bytes, for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM2); None otherwise.

    With it, detokenizing a token is a table lookup plus an incremental UTF-8 decode, instead of two
    tokenizer.decode calls: the engine's per-token host cost drops by an order of magnitude.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":   # normalizers act on encode only
        return None
    inv = bytes_to_unicode()
    added_tokens = getattr(tokenizer, "added_tokens_decoder", {})
    added = {t.content: i for i, t in added_tokens.items()}
    # what decode(skip_special_tokens=True) skips: the named special tokens, and every added token marked
    # special (SmolLM2's <repo_name>, <file_sep>, ... are in no special-token attribute)
    special = set(tokenizer.all_special_ids) | {i for i, t in added_tokens.items() if t.special}
    table: list[bytes] = []
    for i, tok in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if tok is None or (skip_special_tokens and i in special):
            table.append(b"")
        elif tok in added and added[tok] == i:
            table.append(tok.encode())          # added tokens are stored as plain text
        else:
            try:
                table.append(bytes(inv[c] for c in tok))
            except KeyError:
                table.append(tok.encode())
    return table


def prepare(tokenizer) -> None:
    """Build the tokenizer's byte table now (0.1-1 s for a 128k vocabulary), at engine start-up, instead of
    on the first request's arrival, where a benchmark's clock (and the first request's TTFT) would pay it."""
    _byte_table(tokenizer, True)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self._table = _byte_table(tokenizer, skip_special_tokens)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.output_text = ""
        self.token_ids: list[int] = []
        # Start the window a few prompt tokens back so the first output token decodes in context
        # (SentencePiece drops a leading space when decoded alone).
        self._context = list(prompt_token_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self._context)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add_tokens(self, new_token_ids: list[int]) -> StopMatch | None:
        """Append tokens, extend output_text; returns the stop string match if one completed."""
        stop_match = None
        if self._table is not None:
            return self._add_tokens_bytes(new_token_ids)
        for tid in new_token_ids:
            self.token_ids.append(tid)
            self._context.append(tid)
            prefix_text = self._decode(self._context[self.prefix_offset:self.read_offset])
            full_text = self._decode(self._context[self.prefix_offset:])
            if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
                before = len(self.output_text)
                self.output_text += full_text[len(prefix_text):]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self._context)
                if self.stop:
                    stop_match = self._check_stop(before)
                    if stop_match is not None:
                        self.output_text = self.output_text[:stop_match.text_end]
                        return stop_match
        return stop_match

    def _add_tokens_bytes(self, new_token_ids: list[int]) -> StopMatch | None:
        table = self._table
        if not self.stop:       # no stop strings to find: one join and one decode for all the tokens
            n = len(table)
            self.token_ids.extend(new_token_ids)
            self.output_text += self._utf8.decode(b"".join([table[t] if 0 <= t < n else b""
                                                            for t in new_token_ids]))
            return None
        for tid in new_token_ids:
            self.token_ids.append(tid)
            piece = table[tid] if 0 <= tid < len(table) else b""
            text = self._utf8.decode(piece)      # holds back an incomplete multi-byte character
            if text:
                before = len(self.output_text)
                self.output_text += text
                if self.stop:
                    match = self._check_stop(before)
                    if match is not None:
                        self.output_text = self.output_text[:match.text_end]
                        return match
        return None

    def _check_stop(self, new_from: int) -> StopMatch | None:
        # a stop string may straddle the old text and the new: look back max_stop_len - 1 characters
        start = max(0, new_from - self.max_stop_len + 1)
        best = None
        for s in self.stop:
            i = self.output_text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        return StopMatch(s, i + len(s) if self.include_stop else i)

    def releasable_len(self, finished: bool) -> int:
        """How much text may be streamed: hold back a tail that could still become a stop string."""
        if finished or not self.stop or self.include_stop:
            return len(self.output_text)
        return max(0, len(self.output_text) - self.max_stop_len + 1)
