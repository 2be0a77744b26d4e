"""Which unrolled-dispatch program fails on the GPU, with its traceback (session 11: a ShareGPT run with
JAXPAGED_LAYER_DISPATCH=unrolled stopped on "Input buffer 2 is not 256-byte aligned [jit_whole_step]").

    JAXPAGED_EXEC_CACHE=0 python3 bench/adhoc/unrolled_probe.py [--steps 1,16] [--backend mosaic]
"""
import argparse
import traceback

ap = argparse.ArgumentParser()
ap.add_argument("--steps", default="1,16")
ap.add_argument("--backend", default=None)
args = ap.parse_args()

from bench.models import ensure_model_dir  # noqa: E402
from jaxpaged import LLM, SamplingParams  # noqa: E402

for steps in [int(s) for s in args.steps.split(",")]:
    try:
        llm = LLM(model=ensure_model_dir("qwen2-0.5b"), load_format="dummy", dtype="bfloat16", max_model_len=1024,
                  layer_dispatch="unrolled", num_scheduler_steps=steps, compile_buckets=False,
                  attention_backend=args.backend, gpu_memory_utilization=0.3)
        outs = llm.generate([[5, 6, 7, 8] * 30, [9] * 70], SamplingParams(max_tokens=40, ignore_eos=True),
                            use_tqdm=False)
        print(f"steps={steps} backend={llm.llm_engine.runner.attn_backend}: OK", [len(o.outputs[0].token_ids) for o in outs])
        del llm
    except Exception:  # noqa: BLE001
        print(f"steps={steps}: FAILED")
        traceback.print_exc()
