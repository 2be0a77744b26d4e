"""Which unrolled-dispatch program fails on the GPU, with its traceback (session 11: a ShareGPT run with
JAXPAGED_LAYER_DISPATCH=unrolled stopped on "Input buffer 2 is not 256-byte aligned [jit_whole_step]";
the same model generated fine with no bucket warm-up, no executable cache and 0.3 of memory).

    python3 bench/adhoc/unrolled_probe.py [--steps 1,16] [--compile-buckets] [--mem 0.9] [--small]
    (JAXPAGED_EXEC_CACHE=0 / 1 switches the executable cache; JAXPAGED_PINNED_INPUTS=0 / 1 the pinned inputs)
"""
import argparse
import traceback

ap = argparse.ArgumentParser()
ap.add_argument("--steps", default="1,16")
ap.add_argument("--backend", default=None)
ap.add_argument("--compile-buckets", action="store_true")
ap.add_argument("--mem", type=float, default=0.3)
ap.add_argument("--small", action="store_true", help="max_num_seqs 16, max_num_batched_tokens 512: few buckets")
args = ap.parse_args()

from bench.models import ensure_model_dir  # noqa: E402
from jaxpaged import LLM, SamplingParams  # noqa: E402

small = dict(max_num_seqs=16, max_num_batched_tokens=512) if args.small else {}
for steps in [int(s) for s in args.steps.split(",")]:
    try:
        llm = LLM(model=ensure_model_dir("qwen2-0.5b"), load_format="dummy", dtype="bfloat16", max_model_len=1024,
                  layer_dispatch="unrolled", num_scheduler_steps=steps, compile_buckets=args.compile_buckets,
                  attention_backend=args.backend, gpu_memory_utilization=args.mem, **small)
        outs = llm.generate([[5, 6, 7, 8] * 30, [9] * 70], SamplingParams(max_tokens=40, ignore_eos=True),
                            use_tqdm=False)
        print(f"steps={steps} {vars(args)}: OK", [len(o.outputs[0].token_ids) for o in outs], flush=True)
        del llm
    except Exception:  # noqa: BLE001
        print(f"steps={steps} {vars(args)}: FAILED", flush=True)
        traceback.print_exc()
