"""Baichuan, from checkpoints laid out as Baichuan's own (W_pack, its config.json; transformers has no class):
Baichuan-7B's rope and the 13B models' ALiBi, Baichuan2's normalized LM head. Logits through the paged cache
equal HF transformers' Llama on the same weights (for ALiBi, computing Baichuan's attention: conftest's
AlibiLlama); ALiBi's slopes are Baichuan's."""
import numpy as np
import pytest
import torch

from conftest import save_tiny_baichuan
from jaxpaged.models import load_model
from jaxpaged.models.config import BAICHUAN2_VOCAB
from paged_runner import PagedRunner


@pytest.mark.parametrize("alibi,vocab", [(False, 320), (True, 320), (True, BAICHUAN2_VOCAB)],
                         ids=["baichuan-7b-rope", "baichuan-13b-alibi", "baichuan2-13b-normhead"])
def test_baichuan_logits_match_hf(alibi, vocab, tmp_path):
    hf = save_tiny_baichuan(tmp_path, alibi, vocab)
    loaded = load_model(tmp_path, dtype="float32")
    cfg = loaded.config
    assert (cfg.family, cfg.alibi, cfg.norm_head) == ("baichuan", alibi, vocab == BAICHUAN2_VOCAB)
    runner = PagedRunner(loaded)
    ids = np.random.default_rng(0).integers(0, 320, 13).tolist()
    ours = [runner.step(ids)]
    for _ in range(6):
        ids.append(int(np.argmax(ours[-1][-1])))
        ours.append(runner.step([ids[-1]]))
    with torch.no_grad():
        ref = hf(torch.tensor([ids[:-1] + [ids[-1]]])).logits[0].numpy()
    got = np.concatenate(ours)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, rel


def test_alibi_slopes_are_baichuans():
    """Baichuan's _get_interleave: 2^(-8/n) powers for n a power of two; 40 heads (the 13B models): the 32
    of 32 heads, then every other one of 64's."""
    from jaxpaged.models.config import DecoderConfig

    def slopes(n):
        cfg = DecoderConfig("BaichuanForCausalLM", 8, 8, 8, 1, n, n, 8, 1e-6, 1e4, None, 64, False, False, False,
                            None, None, (), None, alibi=True)
        return cfg.alibi_slopes()
    np.testing.assert_allclose(slopes(8), [2.0 ** -(i + 1) for i in range(8)], rtol=1e-6)
    s32, s64 = slopes(32), slopes(64)
    np.testing.assert_allclose(slopes(40), np.concatenate([s32, s64[0::2][:8]]), rtol=1e-6)
    np.testing.assert_allclose(s32[0], 2 ** -0.25, rtol=1e-6)
