"""The one helper that picks padded shapes. Every jitted step is compiled once per bucket, at start-up on
GPUs, so the bucket count is start-up time: the ladders are coarse where a step is cheap to pad.

Decode-only steps (T == R): R padded to a power of two, 1 .. max_num_seqs. Decode cost grows with R,
and padded rows cost little (the attention kernel exits at once on a zero-length row).

Mixed steps (prefill chunks beside decodes): T padded to a power of two from 16 up to
max_num_batched_tokens; R (which only sizes the block tables and the rows sampled) to 8, 64, 512, ...,
capped at T and at max_num_seqs. With vLLM's H100 defaults (16384 tokens, 1024 sequences) that is
11 decode + 35 mixed buckets.
"""
from __future__ import annotations

from typing import NamedTuple


class Bucket(NamedTuple):
    padded_num_tokens: int
    padded_num_reqs: int
    decode_only: bool


class BucketPolicy:
    MIXED_REQS_STEP = 8

    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int, min_tokens: int = 16):
        self.max_tokens = max_num_batched_tokens
        self.max_reqs = max_num_seqs
        self.min_tokens = min_tokens

    def padded_reqs(self, num_reqs: int, decode_only: bool) -> int:
        b, step = (1, 2) if decode_only else (self.MIXED_REQS_STEP, self.MIXED_REQS_STEP)
        while b < num_reqs:
            b *= step
        return max(num_reqs, min(b, _round_up_pow2(self.max_reqs)))

    def padded_tokens(self, num_tokens: int) -> int:
        """16, 32, 64, ... and max_num_batched_tokens as the last rung (a request never exceeds it)."""
        return max(num_tokens, min(_round_up_pow2(max(num_tokens, self.min_tokens)), self.max_tokens))

    def pick(self, num_tokens: int, num_reqs: int, decode_only: bool) -> Bucket:
        r = self.padded_reqs(num_reqs, decode_only)
        if decode_only:
            return Bucket(r, r, True)
        t = self.padded_tokens(num_tokens)
        return Bucket(t, max(num_reqs, min(r, t)), False)

    def all_buckets(self) -> list[Bucket]:
        """Every bucket the engine can hit, for compiling at start-up."""
        out: list[Bucket] = []
        r = 1
        while True:
            out.append(Bucket(r, r, True))
            if r >= self.max_reqs:
                break
            r *= 2
        seen = set()
        t = self.padded_tokens(1)
        while True:
            r = 1
            while True:
                b = self.pick(t, min(r, t, self.max_reqs), False)
                if b not in seen:
                    seen.add(b)
                    out.append(b)
                if r >= min(self.max_reqs, t):
                    break
                r = min(r * self.MIXED_REQS_STEP, t, self.max_reqs)
            if t >= self.max_tokens:
                break
            t = self.padded_tokens(t + 1)
        return out


def _round_up_pow2(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b
