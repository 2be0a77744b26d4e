"""GPU check (seventh session): greedy tokens of qwen2-0.5b (dummy weights, float32) are the same with the
inputs in pinned host buffers (default), with fresh host arrays (JAXPAGED_PINNED_INPUTS=0, set by the
caller), and with 8 decode steps per program."""
import json
import sys
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))
from bench.models import ensure_model_dir  # noqa: E402
from jaxpaged import LLM, SamplingParams  # noqa: E402

steps = int(sys.argv[1])
rng = np.random.default_rng(0)
prompts = [rng.integers(100, 30000, int(n)).tolist() for n in rng.integers(5, 300, 16)]
llm = LLM(model=ensure_model_dir("qwen2-0.5b"), load_format="dummy", dtype="float32", max_model_len=1024,
          num_scheduler_steps=steps, num_gpu_blocks_override=4096, compile_buckets=False)
# dummy weights are uniform(-1e-3, 1e-3): near-equal logits, greedy picks token 0 throughout. Scale the
# matrices up (norms stay 1) so that greedy tokens depend on the inputs.
import jax  # noqa: E402
runner = llm.llm_engine.runner
runner.params = jax.tree.map(lambda x: x * 100 if x.ndim >= 2 else x, runner.params)
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]))
