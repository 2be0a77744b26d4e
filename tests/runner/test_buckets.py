"""Every shape the engine can ask for is one of the buckets compiled at start-up, and holds the step."""
import numpy as np
import pytest

from jaxpaged.runner.buckets import BucketPolicy


@pytest.mark.parametrize("max_tokens,max_seqs", [(16384, 1024), (8192, 1024), (2048, 256), (1000, 100),
                                                 (64, 8), (32, 256)])
def test_every_step_lands_in_a_precompiled_bucket(max_tokens, max_seqs):
    policy = BucketPolicy(max_tokens, max_seqs)
    buckets = set(policy.all_buckets())
    assert len(buckets) == len(policy.all_buckets())          # no duplicates
    rng = np.random.default_rng(0)
    cases = [(1, 1), (max_tokens, min(max_seqs, max_tokens)), (min(max_seqs, max_tokens),) * 2]
    cases += [(int(t), int(rng.integers(1, min(t, max_seqs) + 1)))
              for t in rng.integers(1, max_tokens + 1, 2000)]
    for num_tokens, num_reqs in cases:
        b = policy.pick(num_tokens, num_reqs, decode_only=False)
        assert b in buckets, (num_tokens, num_reqs, b)
        assert b.padded_num_tokens >= num_tokens and b.padded_num_reqs >= num_reqs
        assert b.padded_num_reqs <= b.padded_num_tokens
        if num_tokens == num_reqs:
            d = policy.pick(num_reqs, num_reqs, decode_only=True)
            assert d in buckets and d.padded_num_reqs >= num_reqs


def test_h100_defaults_keep_start_up_small():
    # vLLM's H100 defaults for the LLM class (tests/test_config.py): 16384 tokens, 1024 sequences -> 15
    # 13 decode + 16 mixed shapes
    policy = BucketPolicy(16384, 1024)
    assert len(policy.all_buckets()) == 29
    decode = [b.padded_num_reqs for b in policy.all_buckets() if b.decode_only]
    assert decode == [1, 8, 16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024]
    mixed = [(b.padded_num_tokens, b.padded_num_reqs) for b in policy.all_buckets() if not b.decode_only]
    assert mixed == [(16, 16), (32, 32), (64, 64), (128, 128), (256, 128), (256, 256), (512, 128), (512, 512),
                     (1024, 128), (1024, 1024), (2048, 256), (2048, 1024), (4096, 512), (4096, 1024),
                     (8192, 1024), (16384, 1024)]


@pytest.mark.parametrize("max_seqs", [100, 257, 300, 600, 1000])
def test_every_decode_batch_size_lands_in_a_decode_bucket(max_seqs):
    """max_num_seqs not a power of two nor a multiple of 128: the last decode rung is it rounded up to the
    ladder (600 -> 640), within the rows the runner allocates (max_rows)."""
    policy = BucketPolicy(16384, max_seqs)
    decode = {b for b in policy.all_buckets() if b.decode_only}
    for n in range(1, max_seqs + 1):
        b = policy.pick(n, n, decode_only=True)
        assert b in decode and n <= b.padded_num_reqs <= policy.max_rows, (n, b)
    assert max(b.padded_num_reqs for b in decode) == {100: 128, 257: 384, 300: 384, 600: 640, 1000: 1024}[max_seqs]
