"""The one helper that picks padded shapes. Every jitted step is compiled once per bucket."""
from __future__ import annotations

from typing import NamedTuple


def _pow2_then_linear(n: int, start: int, gap: int) -> int:
    """Powers of two from `start` up to `gap`, then multiples of `gap`.

    # start 16, gap 512: 1 -> 16, 17 -> 32, 300 -> 512, 513 -> 1024, 1100 -> 1536
    """
    b = start
    while b < n and b < gap:
        b *= 2
    if n <= b:
        return b
    return -(-n // gap) * gap


class Bucket(NamedTuple):
    padded_num_tokens: int
    padded_num_reqs: int
    decode_only: bool


class BucketPolicy:
    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int, min_tokens: int = 16,
                 token_gap: int = 512):
        self.max_tokens = max_num_batched_tokens
        self.max_reqs = max_num_seqs
        self.min_tokens = min_tokens
        self.token_gap = token_gap

    def padded_reqs(self, num_reqs: int, decode_only: bool) -> int:
        # Decode steps: powers of two (T == R, and decode cost scales with R). Mixed steps: powers of 4,
        # since R there only sizes block tables and the logits rows.
        b, step = (1, 2) if decode_only else (4, 4)
        while b < num_reqs:
            b *= step
        return min(b, _round_up_pow2(self.max_reqs)) if b >= num_reqs else num_reqs

    def padded_tokens(self, num_tokens: int) -> int:
        return min(_pow2_then_linear(num_tokens, self.min_tokens, self.token_gap),
                   max(self.max_tokens, num_tokens))

    def pick(self, num_tokens: int, num_reqs: int, decode_only: bool) -> Bucket:
        r = self.padded_reqs(num_reqs, decode_only)
        if decode_only:
            return Bucket(r, r, True)
        t = max(self.padded_tokens(num_tokens), 0)
        return Bucket(t, min(r, t) if r > t else r, False)

    def all_buckets(self) -> list[Bucket]:
        """Every bucket the engine can hit, for compiling at start-up."""
        out, seen = [], set()
        r = 1
        while True:
            out.append(Bucket(r, r, True))
            if r >= self.max_reqs:
                break
            r *= 2
        t = self.min_tokens
        while True:
            r = 4
            while True:
                b = self.pick(t, min(r, t), False)
                if b not in seen:
                    seen.add(b)
                    out.append(b)
                if r >= min(self.max_reqs, t):
                    break
                r *= 4
            if t >= self.max_tokens:
                break
            t = self.padded_tokens(t + 1)
        return out


def _round_up_pow2(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b
