"""The model end to end on the Pallas kernels gives the same greedy tokens as the XLA attention path:
decode steps, chunked prefills beside decodes, and KV writes through the kernel. Interpret mode on the
CPU, the compiled kernels on the GPU."""
import jax
import numpy as np
import pytest

from conftest import save_tiny_llama
from jaxpaged import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_d64")   # head dim 64: a size the kernels support
    save_tiny_llama(d, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, initializer_range=0.2)
    return str(d)


@pytest.fixture
def full_precision_matmuls():
    """f32 matmuls at full precision in every thread: on the GPU XLA's default runs them in TF32, so the XLA
    attention path would differ from the kernels' IEEE dots by ~1e-3 and could flip a greedy token. The
    CPU computes f32 matmuls in full precision anyway."""
    before = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    yield
    jax.config.update("jax_default_matmul_precision", before)


def test_pallas_backend_matches_xla_end_to_end(model_dir, full_precision_matmuls):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, n).tolist() for n in (5, 23, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = {}
    for backend in ("xla", "pallas"):
        # a 32-token budget splits the 40-token prompt into chunks that run beside the others' decodes
        llm = LLM(model=model_dir, dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
                  attention_backend=backend, max_num_batched_tokens=32)
        got[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        pool = llm.llm_engine.kv_manager.pool
        assert pool.num_free_blocks == pool.num_blocks - 1
    assert got["pallas"] == got["xla"]
    assert all(len(t) == 8 for t in got["xla"])
