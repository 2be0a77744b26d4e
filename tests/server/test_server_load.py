"""Load and faults on a real server process, which must lose nothing: a tiny random-weight Llama (SmolLM2's
tokenizer) over a KV cache of 24 blocks of 16 tokens, 384 tokens under max_model_len 512, so requests wait,
preempt each other, and are refused when they could never fit.

- vLLM's counters on /metrics after a known sequence of requests, exact.
- A storm of concurrent streams whose clients leave at seeded random points: the server ends idle with every
  block free, the counters account for every request once, the streams that stayed got every token (the
  tokens of the same request alone), and nothing reaches the log as an error.
- A request that could never fit in the KV cache is a 400 at once; requests that fit alone but not together
  preempt each other and all finish with the tokens of a large pool.

One server for the module; every test leaves it idle.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from conftest import ServerProcess, save_tiny_llama, wait_metrics

pytestmark = pytest.mark.slow

MODEL = "tiny"
BLOCK_SIZE, NUM_BLOCKS = 16, 24                 # the KV cache: 384 tokens
MAX_MODEL_LEN, MAX_NUM_SEQS = 512, 32
FLAGS = ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
         "--max-num-seqs", str(MAX_NUM_SEQS), "--block-size", str(BLOCK_SIZE),
         "--num-gpu-blocks-override", str(NUM_BLOCKS + 1)]        # (+ the null block)
GREEDY = {"model": MODEL, "temperature": 0, "ignore_eos": True}
LENGTH, ABORT = "request_success_total{finished_reason=length}", "request_success_total{finished_reason=abort}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_load")
    save_tiny_llama(d, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, initializer_range=0.2, max_position_embeddings=MAX_MODEL_LEN)
    return str(d)


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(["--model", model_dir, *FLAGS]) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, timeout=300) as c:
        yield c


def tokens(seed: int, n: int) -> list[int]:
    """n token ids from a generator of this seed: prompts no other test's prefix cache holds."""
    return np.random.default_rng(seed).integers(100, 40000, n).tolist()


def idle(m) -> bool:
    return (m["jaxpaged:num_requests_running"] == 0 and m["jaxpaged:num_requests_waiting"] == 0
            and m["jaxpaged:num_free_blocks"] == m["jaxpaged:num_blocks"] == NUM_BLOCKS)


def wait_idle(http) -> dict[str, float]:
    """/metrics once nothing runs or waits and every block is free (polled: the core reports between steps)."""
    m = wait_metrics(http, idle)
    assert idle(m) and m["jaxpaged:kv_cache_usage_perc"] == 0, m
    return m


def moved(before: dict, after: dict, *names: str) -> list[float]:
    """How far each jaxpaged: metric moved."""
    return [after["jaxpaged:" + n] - before["jaxpaged:" + n] for n in names]


def completion(http, **body) -> dict:
    r = http.post("/v1/completions", json={**GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


# ---- vLLM's counters, exact --------------------------------------------------------------------
def test_metrics_mean_what_vllms_mean(http):
    """An 18-token prompt with block size 16, twice, then with n = 2: prompt_tokens counts every request's whole
    prompt (its cached tokens too); prefix_cache_queries / hits count tokens (the first block's 16 hit);
    the n samples are requests of their own; the histograms take one sample per request (TTFT, e2e) and
    per output after the first (inter-token latency)."""
    prompt = tokens(18, 18)
    before = wait_idle(http)
    first = completion(http, prompt=prompt, max_tokens=4)
    again = completion(http, prompt=prompt, max_tokens=4)
    both = completion(http, prompt=prompt, max_tokens=4, n=2, stream=False)
    after = wait_idle(http)
    assert [first["usage"]["completion_tokens"], again["usage"]["completion_tokens"],
            both["usage"]["completion_tokens"]] == [4, 4, 8]
    assert moved(before, after, "prompt_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "generation_tokens_total", "num_preemptions_total") == [18 + 18 + 36, 18 + 18 + 36, 16 + 32, 16, 0]
    assert moved(before, after, LENGTH, ABORT) == [4, 0]
    assert moved(before, after, "time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
                 "inter_token_latency_seconds_count") == [4, 4, 4 * 3]


# ---- a disconnect storm ------------------------------------------------------------------------
NUM_STREAMS = 240
STORM_PROMPTS = [tokens(100 + i, n) for i, n in enumerate((5, 9, 14, 20))]
STAY_MAX_TOKENS = (8, 16, 24)


def _storm_plan(seed: int = 25) -> list[dict]:
    """Per client: its prompt, max_tokens and how it behaves. `early` sends the request and closes the socket
    before reading a byte; `leave` reads `k` data chunks (0: the headers only) of a long request, then
    closes; `stay` reads its stream to the end."""
    rng = np.random.default_rng(seed)
    plan = []
    for i in range(NUM_STREAMS):
        prompt = STORM_PROMPTS[i % len(STORM_PROMPTS)]
        kind = rng.choice(["early", "leave", "stay"], p=[0.15, 0.5, 0.35])
        if kind == "stay":
            plan.append(dict(kind=kind, prompt=prompt, max_tokens=int(rng.choice(STAY_MAX_TOKENS))))
        else:
            plan.append(dict(kind=kind, prompt=prompt, max_tokens=int(rng.integers(64, 160)),
                             k=int(rng.integers(0, 8))))
    return plan


async def _early(port: int, body: dict) -> dict:
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    return dict(chunks=0, finish=None, text="", done=False)


async def _stream(client: httpx.AsyncClient, body: dict, k: int | None) -> dict:
    """Read the stream to its [DONE], or leave after k data chunks (closing a response not read to its end
    closes the connection)."""
    seen = dict(chunks=0, finish=None, text="", done=False)
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        if k == 0:
            return seen
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                seen["done"] = True
                break
            (choice,) = json.loads(line[len("data: "):])["choices"]
            seen["chunks"] += 1
            seen["text"] += choice["text"]
            seen["finish"] = choice["finish_reason"] or seen["finish"]
            if seen["chunks"] == k:
                break
    return seen


def test_disconnect_storm_loses_nothing(server, http):
    """240 concurrent streams over the small KV cache (most wait; the running ones preempt each other), a
    third of which stay while the rest leave at their planned points. Afterwards nothing runs or waits and
    every block is free; the streams that stayed got what the same request gets alone; the counters take
    every request once; the log holds no error."""
    plan = _storm_plan()
    # what each staying stream must receive: the same request alone
    ref = {(tuple(p), m): completion(http, prompt=p, max_tokens=m)["choices"][0]["text"]
           for p in STORM_PROMPTS for m in STAY_MAX_TOKENS}
    before = wait_idle(http)

    async def storm():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.base, limits=limits, timeout=300) as client:
            jobs = []
            for c in plan:
                body = {**GREEDY, "prompt": c["prompt"], "max_tokens": c["max_tokens"], "stream": True}
                jobs.append(_early(server.port, body) if c["kind"] == "early"
                            else _stream(client, body, c["k"] if c["kind"] == "leave" else None))
            return await asyncio.gather(*jobs)

    seen = asyncio.run(asyncio.wait_for(storm(), timeout=600))
    after = wait_idle(http)                 # every block back, nothing running or waiting

    for c, s in zip(plan, seen):
        if c["kind"] == "stay":             # every token, the tokens of the request alone
            assert s["done"] and s["finish"] == "length", (c, s)
            assert s["text"] == ref[(tuple(c["prompt"]), c["max_tokens"])], (c, s)
        else:
            assert not s["done"] and s["chunks"] <= c.get("k", 0)
    # A client that left before it saw the finish may find its request finished anyway (the last tokens were
    # on their way): it counts as "length" or as "abort", once. Every request that reached the engine counts
    # once: at least those that sent data, at most all of them.
    finished = [c for c, s in zip(plan, seen) if s["finish"] is not None]
    sent_data = [c for c, s in zip(plan, seen) if s["chunks"] > 0]
    length, aborted = moved(before, after, LENGTH, ABORT)
    assert len(sent_data) <= length + aborted <= NUM_STREAMS
    assert length >= len(finished)
    assert moved(before, after, "e2e_request_latency_seconds_count") == [length + aborted]
    assert moved(before, after, "time_to_first_token_seconds_count")[0] >= len(sent_data)
    # the engine counted the prompt of every request that produced a token, and the tokens every stayer got
    prompt_tokens, queried, generated = moved(before, after, "prompt_tokens_total", "prefix_cache_queries_total",
                                              "generation_tokens_total")
    assert sum(len(c["prompt"]) for c in sent_data) <= prompt_tokens <= queried <= sum(len(c["prompt"]) for c in plan)
    assert generated >= sum(c["max_tokens"] for c in plan if c["kind"] == "stay")
    log = server.read_log()
    for word in ("Traceback", "Exception", "ERROR"):
        assert word not in log, log[-4000:]


# ---- a small KV cache ----------------------------------------------------------------------------
def _assert_error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err["message"]


def test_request_that_could_never_fit_is_refused_at_once(http):
    """prompt + max_tokens - 1 slots over the 384 the KV cache holds: a 400 naming both, streamed or not, and
    the engine never sees it. At the limit it runs; without max_tokens it may generate what the cache holds."""
    before = wait_idle(http)
    prompt = tokens(300, 300)
    for stream in (False, True):
        message = _assert_error(http.post("/v1/completions", json={**GREEDY, "prompt": prompt, "max_tokens": 100,
                                                                    "stream": stream}), 400)
        assert message.startswith("This request needs up to 399 tokens of KV cache (300 in the prompt, "
                                  "max_tokens=100), more than the whole KV cache holds: 384 tokens (24 blocks of "
                                  "16)"), message
    at_limit = completion(http, prompt=prompt, max_tokens=85)              # 300 + 85 - 1 = 384 slots
    assert at_limit["usage"]["completion_tokens"] == 85
    unbounded = completion(http, prompt=prompt[:20], max_tokens=None)      # up to 384 - 20 + 1 tokens
    assert unbounded["usage"]["completion_tokens"] == 365
    assert unbounded["choices"][0]["finish_reason"] == "length"
    after = wait_idle(http)
    assert moved(before, after, LENGTH, ABORT, "num_preemptions_total") == [2, 0, 0]
    assert moved(before, after, "prompt_tokens_total") == [300 + 20]      # the refused ones never reached it


def test_requests_that_preempt_each_other_finish_as_on_a_large_pool(model_dir, http):
    """Six requests of up to 10 blocks each over 24 blocks: all admitted at once (one completion request
    with six prompts), they preempt each other as they grow, and each ends with the greedy tokens of an LLM
    whose pool holds them all at once. The counters still take each prompt once, whatever was recomputed."""
    from jaxpaged import LLM, SamplingParams
    prompts = [tokens(200 + i, n) for i, n in enumerate((40, 25, 33, 47, 20, 36))]
    before = wait_idle(http)
    got = completion(http, prompt=prompts, max_tokens=100)
    after = wait_idle(http)
    llm = LLM(model=model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
              block_size=BLOCK_SIZE, num_gpu_blocks_override=6 * 10 + 1)
    want = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
    assert [c["text"] for c in sorted(got["choices"], key=lambda c: c["index"])] == [o.outputs[0].text for o in want]
    assert llm.llm_engine.scheduler.num_preemptions == 0
    preemptions, prompt_tokens, queried = moved(before, after, "num_preemptions_total", "prompt_tokens_total",
                                                "prefix_cache_queries_total")
    assert preemptions > 0
    assert prompt_tokens == queried == sum(map(len, prompts))
    assert moved(before, after, LENGTH, ABORT) == [6, 0]
