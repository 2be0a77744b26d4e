"""Incremental detokenization and stop strings.

Decoding token by token is wrong for byte-level BPE: a multi-byte character (an emoji, CJK) can span
tokens, and decoding a prefix yields U+FFFD. As HF's TextStreamer and vLLM do, we decode a short window
twice — up to the last emitted point and up to now — and emit the difference only once it no longer ends
in an incomplete character.
"""
from __future__ import annotations

from typing import NamedTuple

_REPLACEMENT = "\ufffd"


class StopMatch(NamedTuple):
    stop: str
    text_end: int       # where the output text is cut


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
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
