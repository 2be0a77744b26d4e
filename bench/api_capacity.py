"""The API process alone: how many streamed tokens per second the server's HTTP side can deliver.

The real server (FastAPI app, AsyncLLM, OutputProcessor, SSE) runs in its own process over a stand-in
engine core that has no model: every step it hands each running request `--tokens-per-step` random tokens
(as a multi-step program does) until its max_tokens, after `--step-ms` of pretend device time. So the
figure is the API side's ceiling, whatever the GPU: if it is not well above the engine's offline tok/s,
the server cannot reach the engine's speed. Runs on the CPU. It also prints the server process's CPU time
for the run, which, unlike the throughput, hardly depends on what else the machine is running.

  python bench/api_capacity.py --num-prompts 1000 --tokens-per-step 16 [--api-server-count 2] [--profile api.prof]

--no-op-server serves the same streams from a bare ASGI app instead (uvicorn, no FastAPI, no engine: each
request's chunks sent as soon as its body is read): what the client alone can take, so a run whose figures
match it is bound by the client, not the server.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):   # run as a file: see bench/common.py add_repo_to_path
    _bench = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _bench]
    sys.path.append(str(_bench.parent))

VOCAB = 1 << 18        # token ids the checks accept (qwen2-0.5b's workload; SmolLM2's table detokenizes)


def run_stand_in_core(args, channels, parent_pid: int, tokens_per_step: int = 16, step_s: float = 0.0) -> None:
    """An engine core without a model: CoreInfo, then per step every running request's next tokens."""
    import random
    import signal

    import zmq

    from jaxpaged.engine.core_client import CoreOutputs
    from jaxpaged.engine.messages import (Command, CoreInfo, CoreStats, EngineCoreOutput, FinishReason,
                                          abort_decoder, add_decoder)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    for ch in channels:
        inp.connect(ch.input_addr)
    out = CoreOutputs(ctx, channels)
    # the folder the API processes load the tokenizer from, also where they read generation_config.json: a name
    # that is no folder would send transformers to the model hub, which it retries with back-off without a network
    from jaxpaged.engine.model_path import resolve_model_path
    out.broadcast(CoreInfo(resolve_model_path(args.model), "none", "bfloat16", VOCAB, (2,), 1 << 20, 1 << 16, 20, 16,
                           1 << 20, 1, "stand-in core", 0.0))
    running: dict[str, int] = {}        # request id -> tokens left
    rng = random.Random(0)
    decode_add, decode_abort = add_decoder().decode, abort_decoder().decode
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    while os.getppid() == parent_pid:
        while poller.poll(0 if running else 500):
            cmd, payload = inp.recv_multipart()
            if cmd[0] == Command.SHUTDOWN:
                return
            if cmd[0] == Command.ADD:
                requests = decode_add(payload)
                out.add(requests)
                for r in requests:
                    running[r.request_id] = r.sampling_params.max_tokens or 16
            else:
                request_ids = decode_abort(payload)
                out.forget(request_ids)
                for rid in request_ids:
                    running.pop(rid, None)
        if not running:
            continue
        if step_s:
            time.sleep(step_s)
        outputs = []
        for rid, left in list(running.items()):
            k = min(left, tokens_per_step)
            o = EngineCoreOutput(rid, [rng.randrange(100, 40000) for _ in range(k)])
            if k == left:
                o.finish_reason = FinishReason.LENGTH
                del running[rid]
            else:
                running[rid] = left - k
            outputs.append(o)
        out.send(outputs, CoreStats(num_requests_running=len(running)))


def no_op_app(output_len: int, tokens_per_step: int):
    """An ASGI app that answers /health, /metrics and /v1/models at once, and any other request with a stream
    of ceil(output_len / tokens_per_step) completion chunks, then the usage chunk and [DONE]."""
    import json
    chunk = ("data: " + json.dumps({"id": "cmpl-0", "object": "text_completion", "model": "stand-in", "choices": [
        {"index": 0, "text": "x" * (4 * tokens_per_step), "logprobs": None, "finish_reason": None}]}) + "\n\n").encode()
    tail = ("data: " + json.dumps({"id": "cmpl-0", "object": "text_completion", "model": "stand-in", "choices": [],
                                   "usage": {"prompt_tokens": 32, "completion_tokens": output_len,
                                             "total_tokens": 32 + output_len}}) + "\n\ndata: [DONE]\n\n").encode()
    models = json.dumps({"object": "list", "data": [{"id": "stand-in", "object": "model"}]}).encode()
    num_chunks = -(-output_len // tokens_per_step)

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        if scope["method"] == "GET":
            body = models if scope["path"] == "/v1/models" else b""
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(num_chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": tail})
    return app


def serve_no_op(port: int, output_len: int, tokens_per_step: int) -> None:
    import uvicorn
    uvicorn.run(no_op_app(output_len, tokens_per_step), host="127.0.0.1", port=port, log_level="warning",
                http="httptools", loop="asyncio", backlog=4096)


def serve(port: int, tokens_per_step: int, step_ms: float, api_server_count: int, profile: str | None,
          model: str | None = None) -> None:
    """The server process: the real server (run_server, so also its extra API processes) over the stand-in
    core; model: the folder whose tokenizer it loads (default: the server's default model's)."""
    import functools

    from jaxpaged.server.api_workers import multiprocess_metrics_dir
    from jaxpaged.server.cli import make_parser
    args = make_parser().parse_args(["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "stand-in",
                                     "--disable-log-requests", "--uvicorn-log-level", "warning",
                                     "--api-server-count", str(api_server_count)]
                                    + (["--model", model] if model else []))
    target = functools.partial(run_stand_in_core, tokens_per_step=tokens_per_step, step_s=step_ms / 1000)
    with multiprocess_metrics_dir(api_server_count):
        from jaxpaged.server.api_server import run_server
        if not profile:
            run_server(args, core_target=target)
            return
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
        try:
            run_server(args, core_target=target)
        finally:
            prof.disable()
            prof.dump_stats(profile)


def api_process_pids(server_pid: int) -> list[int]:
    """The server's API processes: it, and its children but the first started (the stand-in core)."""
    children = [int(p) for p in Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()]
    children.sort(key=lambda pid: int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]))
    return [server_pid, *children[1:]]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of the process's own threads (not its children: the stand-in core)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--tokens-per-step", type=int, default=16)
    p.add_argument("--step-ms", type=float, default=0.0, help="pretend device time per step")
    p.add_argument("--port", type=int, default=8019)
    p.add_argument("--api-server-count", type=int, default=1, help="the server's API processes")
    p.add_argument("--client-flags", default="", help="more flags for bench/serve.py, e.g. '--event-loop uvloop'")
    p.add_argument("--profile", default=None, help="write the (first) API process's cProfile here")
    p.add_argument("--model", default=None, help="a bench model (bench/models.py) whose tokenizer the server loads "
                   "(default: the server's default model's)")
    p.add_argument("--no-op-server", action="store_true", help="a bare ASGI app instead of the server: the client's "
                   "ceiling")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)    # (the server process)
    args = p.parse_args()
    if args.serve:
        if args.no_op_server:
            serve_no_op(args.port, args.output_len, args.tokens_per_step)
        else:
            model = None
            if args.model:
                from bench.models import ensure_model_dir
                model = ensure_model_dir(args.model)
            serve(args.port, args.tokens_per_step, args.step_ms, args.api_server_count, args.profile, model)
        return
    import urllib.error
    import urllib.request
    cmd = [sys.executable, __file__, "--serve", "--port", str(args.port), "--tokens-per-step",
           str(args.tokens_per_step), "--step-ms", str(args.step_ms), "--api-server-count",
           str(args.api_server_count), "--output-len", str(args.output_len)] + (
               ["--model", args.model] if args.model else []) + (
               ["--profile", args.profile] if args.profile else []) + (["--no-op-server"] if args.no_op_server else [])
    srv = subprocess.Popen(cmd)
    try:
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if srv.poll() is not None or time.time() > deadline:
                sys.exit("the server did not start")
            time.sleep(0.2)
        api_pids = api_process_pids(srv.pid)
        cpu0 = sum(map(process_cpu_s, api_pids))
        client0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, str(Path(__file__).parent / "serve.py"), "--base-url",
                        f"http://127.0.0.1:{args.port}", "--model", "qwen2-0.5b", "--dataset", "random",
                        "--num-prompts", str(args.num_prompts), "--input-len", "32", "--output-len",
                        str(args.output_len), "--no-warmup", "--served-model-name", "stand-in",
                        "--result-name", f"api-capacity{'-no-op' if args.no_op_server else ''}-{args.num_prompts}x"
                        f"{args.output_len}-k{args.tokens_per_step}", *args.client_flags.split()], check=True)
        # CPU time barely depends on what else the machine runs, unlike the wall-clock figures above
        cpu = sum(map(process_cpu_s, api_pids)) - cpu0
        print(f"API process{'es' if len(api_pids) > 1 else ''} CPU time: {cpu:.2f} s, "
              f"{cpu / args.num_prompts * 1e3:.3f} ms per request")
        client1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        client = client1.ru_utime + client1.ru_stime - client0.ru_utime - client0.ru_stime
        print(f"client (bench/serve.py) CPU time: {client:.2f} s, {client / args.num_prompts * 1e3:.3f} ms per request")
    finally:
        srv.terminate()
        srv.wait(60)


if __name__ == "__main__":
    main()
