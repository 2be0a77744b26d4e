"""The one helper that picks padded shapes. Every jitted step is compiled once per bucket, at start-up on
GPUs, so the bucket count is start-up time: the ladders are coarse where a step is cheap to pad.

Decode-only steps (T == R): one row, else R padded to a power of two from 8 up to 256, then to a multiple
of 128; the last rung is max_num_seqs rounded up so (600 -> 640). Padded rows cost no attention (the
kernel exits at once on a zero-length row), and up to 8 rows the matmuls read the weights once as they do
for one row, so 2 and 4 rows get no programs of their own. Past a few hundred rows a decode step is
compute-bound: on llama3-8b (H100, ShareGPT) 116 steps of 512-1023 requests took 4.05 s padded to 1024
rows and 3.18 s padded to the next multiple of 128 (two runs, two machines).

Mixed steps (prefill chunks beside decodes): T padded to a power of two from 16 up to
max_num_batched_tokens; R (which only sizes the block tables and the rows the LM head and sampler see)
to one of two rungs, T // 8 (at least 128) or T, capped at max_num_seqs. Up to 128 rows the LM head
costs what its weights' read costs (llama3-8b: 0.13 TFLOP at 128 rows beside a 1 GB read), so token
buckets of 128 and fewer have the one rung R = T. With vLLM's H100 defaults (16384 tokens, 1024
sequences) that is 13 decode + 16 mixed buckets.
"""
from __future__ import annotations

from typing import NamedTuple


class Bucket(NamedTuple):
    padded_num_tokens: int
    padded_num_reqs: int
    decode_only: bool


class BucketPolicy:
    MIXED_REQS_FRACTION = 8      # a mixed step's request rows: T // 8 (at least MIXED_MIN_REQS) or T, capped
    MIXED_MIN_REQS = 128
    DECODE_MIN_ROWS = 8          # decode rows past one: powers of two from this up to DECODE_POW2_UP_TO,
    DECODE_POW2_UP_TO = 256      # then multiples of DECODE_STEP
    DECODE_STEP = 128

    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int, min_tokens: int = 16):
        self.max_tokens = max_num_batched_tokens
        self.max_reqs = max_num_seqs
        self.min_tokens = min_tokens
        self.max_rows = _round_up_pow2(max_num_seqs)     # the most request rows any bucket has

    def padded_reqs(self, num_reqs: int, decode_only: bool, padded_tokens: int = 0) -> int:
        """Request rows of a step; mixed steps (decode_only False) name their padded token count."""
        if decode_only:
            return max(num_reqs, min(self._decode_rung(num_reqs), self.max_rows))
        # Mixed steps: two rungs per token bucket. Request rows only size the block tables and the
        # rows the LM head and sampler see, which cost little beside T tokens through the model.
        t = padded_tokens
        small = min(max(self.MIXED_MIN_REQS, _round_up_pow2(t) // self.MIXED_REQS_FRACTION), t, self.max_rows)
        r = small if num_reqs <= small else min(t, self.max_rows)
        return max(num_reqs, r)

    def _decode_rung(self, n: int) -> int:
        if n == 1:
            return 1
        if n <= self.DECODE_POW2_UP_TO:
            return max(self.DECODE_MIN_ROWS, _round_up_pow2(n))
        return -(-n // self.DECODE_STEP) * self.DECODE_STEP

    def padded_tokens(self, num_tokens: int) -> int:
        """16, 32, 64, ... and max_num_batched_tokens as the last rung (a request never exceeds it)."""
        return max(num_tokens, min(_round_up_pow2(max(num_tokens, self.min_tokens)), self.max_tokens))

    def pick(self, num_tokens: int, num_reqs: int, decode_only: bool) -> Bucket:
        if decode_only:
            r = self.padded_reqs(num_reqs, True)
            return Bucket(r, r, True)
        t = self.padded_tokens(num_tokens)
        return Bucket(t, self.padded_reqs(num_reqs, False, t), False)

    def all_buckets(self) -> list[Bucket]:
        """Every bucket the engine can hit, for compiling at start-up."""
        out: list[Bucket] = []
        r = 1
        while True:
            r = self.padded_reqs(r, True)
            out.append(Bucket(r, r, True))
            if r >= self.max_reqs:
                break
            r += 1
        seen = set()
        t = self.padded_tokens(1)
        while True:
            for n in (1, min(t, self.max_reqs)):          # the small rung and the full one
                b = self.pick(t, n, False)
                if b not in seen:
                    seen.add(b)
                    out.append(b)
            if t >= self.max_tokens:
                break
            t = self.padded_tokens(t + 1)
        return out


def _round_up_pow2(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b
