"""The OpenAI-compatible server as a real `python -m jaxpaged.server` process, driven by the `openai` client.

One server for the whole module (loading SmolLM2 on the CPU takes a while); every test leaves it idle and
healthy. Greedy outputs are compared with `jaxpaged.LLM` in this process, built with the same engine flags.
"""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from conftest import ServerProcess, metrics, wait_metrics

pytestmark = [pytest.mark.slow, pytest.mark.cost(90)]

API_KEY = "test-key"
MODEL = "smol"
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 32
MAX_BODY_MIB = 1
MAX_LOGPROBS = 24           # --max-logprobs: past OpenAI's 20 (vLLM's default), which the flag may raise
PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):",
           "The three primary colors are"]
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server_process():
    with ServerProcess(["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
                        "--served-model-name", MODEL, "--api-key", API_KEY,
                        "--max-request-body-mib", str(MAX_BODY_MIB), "--max-logprobs", str(MAX_LOGPROBS)]) as srv:
        yield srv


@pytest.fixture(scope="module")
def server(server_process):
    return server_process.base


@pytest.fixture(scope="module")
def llm(server):
    # built after the server is up, so the two model loads don't fight over the two cores
    from jaxpaged import LLM
    return LLM(max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300) as c:
        yield c


def greedy(llm, prompts, max_tokens, **kw):
    from jaxpaged import SamplingParams
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


# ---- basic endpoints -----------------------------------------------------------------------------
def test_only_the_engine_core_loads_jax(server_process):
    """The API process parses, tokenizes and streams; JAX is the core process's alone. An API process that
    imported it (through the engine's or the models' modules) would start seconds later on every server start,
    before it even spawns the core."""
    def loads_jax(pid: int) -> bool:
        with open(f"/proc/{pid}/maps") as f:
            return "/jaxlib/" in f.read()
    assert loads_jax(server_process.core_pid())
    assert not loads_jax(server_process.proc.pid)


def test_models_version_health_docs(server, client, http):
    assert [m.id for m in client.models.list().data] == [MODEL]
    # probes, metrics and the docs need no key (as vLLM); every other route does
    for path in ("/health", "/ping", "/version", "/metrics", "/docs", "/openapi.json"):
        assert httpx.get(server + path).status_code == 200, path
    assert httpx.post(server + "/ping").status_code == 200
    assert httpx.get(server + "/version").json()["version"]
    spec = httpx.get(server + "/openapi.json").json()
    assert spec["components"]["securitySchemes"]["APIKey"] == {"type": "http", "scheme": "bearer"}
    assert spec["paths"]["/v1/chat/completions"]["post"]["security"] == [{"APIKey": []}]
    assert "security" not in spec["paths"]["/health"]["get"]


def test_tokenize_detokenize(http, llm):
    tok = llm.get_tokenizer()
    r = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN and len(r["token_strs"]) == r["count"]
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False)
    bad = http.post("/detokenize", json={"tokens": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"


# ---- completions ---------------------------------------------------------------------------------
def test_completions_greedy_equal_llm(client, llm):
    ref = greedy(llm, PROMPTS, 12)
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == ref
    assert all(c.finish_reason == "length" for c in r.choices)
    tok = llm.get_tokenizer()
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS)
    assert r.usage.completion_tokens == 4 * 12 and r.usage.total_tokens == r.usage.prompt_tokens + 48
    # token-id prompts (one and several) give the same text
    ids = [tok.encode(p) for p in PROMPTS[:2]]
    assert client.completions.create(model=MODEL, prompt=ids[0], max_tokens=12, temperature=0).choices[0].text == ref[0]
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert [c.text for c in r2.choices] == ref[:2]


def test_completions_stream_equal_llm(client, llm):
    ref = greedy(llm, PROMPTS[:2], 12)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    texts, finish, usage = ["", ""], [None, None], None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == ref and finish == ["length", "length"]
    assert usage.completion_tokens == 24 and usage.total_tokens == usage.prompt_tokens + 24


def test_completions_echo_with_logprobs(client, llm):
    """echo + logprobs scores the prompt too: the first prompt token has null logprobs (as OpenAI)."""
    tok = llm.get_tokenizer()
    n_prompt = len(tok.encode(PROMPTS[1]))
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0, echo=True,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    from jaxpaged import SamplingParams
    ref = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2),
                       use_tqdm=False)[0]
    for p in range(1, n_prompt):
        tid = ref.prompt_token_ids[p]
        assert abs(lp.token_logprobs[p] - ref.prompt_logprobs[p][tid].logprob) < 1e-4


def test_completions_echo_stop_and_extras(client, llm):
    ref = greedy(llm, [PROMPTS[1]], 16)[0]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, echo=True)
    assert r.choices[0].text == PROMPTS[1] + ref
    # stop at a word in the middle of the greedy text: the text ends just before it
    words = ref.split()
    stop = " " + words[len(words) // 2]
    cut = ref[:ref.index(stop)]
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=[stop],
                                      stream=stream)
        chunks = list(r) if stream else [r]
        text = "".join(c.text for ch in chunks for c in ch.choices)
        assert text == cut
        last = [c for ch in chunks for c in ch.choices][-1]
        assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop
    # vLLM's extras pass through: ignore_eos, min_tokens, top_k, repetition_penalty
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True, "min_tokens": 5, "top_k": 5,
                                              "repetition_penalty": 1.1})
    assert r.usage.completion_tokens == 5
    # logit_bias reaches the sampler: a +100 bias makes one token the greedy choice every time
    bang = llm.get_tokenizer().encode("!", add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                  logit_bias={str(bang): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == "!!!!"


def test_completions_n_and_seed(client):
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=3, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]        # same seed, same samples
    assert len({c.text for c in a.choices}) > 1                              # the n samples differ
    assert a.usage.completion_tokens == 24
    # streamed n > 1: chunks carry their choice index; the same seed gives the same texts
    texts = ["", "", ""]
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in a.choices]
    other = client.completions.create(**{**kw, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]


def test_completions_logprobs(client, llm):
    ref = greedy(llm, [PROMPTS[0]], 8)[0]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3)
    c = r.choices[0]
    lp = c.logprobs
    assert c.text == ref and len(lp.tokens) == 8 and "".join(lp.tokens) == ref
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token_lp <= 0 and 3 <= len(top) <= 4
        assert top[token] == token_lp == max(top.values())                   # greedy picks the top token
    # streamed logprobs have the same values
    toks, lps = [], []
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                           logprobs=3, stream=True):
        for ch in chunk.choices:
            if ch.logprobs:
                toks += ch.logprobs.tokens
                lps += ch.logprobs.token_logprobs
    assert toks == lp.tokens and lps == pytest.approx(lp.token_logprobs, abs=1e-5)


# ---- chat ----------------------------------------------------------------------------------------
def test_chat_greedy_equal_llm(client, llm):
    from jaxpaged import SamplingParams
    ref_out = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    ref = ref_out.text
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref
    assert r.choices[0].finish_reason == ref_out.finish_reason
    assert r.usage.completion_tokens == len(ref_out.token_ids)          # the EOS token counts, as in vLLM
    # content given as a list of text parts is the same message
    parts = [CHAT[0], {"role": "user", "content": [{"type": "text", "text": CHAT[1]["content"]}]}]
    assert client.chat.completions.create(model=MODEL, messages=parts, max_tokens=16,
                                          temperature=0).choices[0].message.content == ref
    # streaming: the first delta carries the role; include_usage adds a final usage-only chunk
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == r.usage.total_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason


def test_chat_n_logprobs_seed(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=1.0, n=2, seed=7, logprobs=True,
              top_logprobs=2)
    a = client.chat.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    for c in a.choices:
        content = c.logprobs.content
        assert "".join(t.token for t in content) == c.message.content
        for t in content:
            assert t.logprob <= 0 and len(t.top_logprobs) == 2 and bytes(t.bytes).decode() == t.token
            assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= -9999
    texts = ["", ""]
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in a.choices]


# ---- vLLM's extra fields --------------------------------------------------------------------------
def test_vllm_extras_do_what_vllms_do(client, http, llm):
    """Each of vLLM's extra fields the engine can serve does what vLLM's does (checked against LLM); the ones
    it cannot are refused by name (the rest of that list: test_server_unit)."""
    from jaxpaged import SamplingParams
    tok = llm.get_tokenizer()
    # prompt_logprobs: the prompt's own token and its top k at each position, the LLM's values
    ref = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                       use_tqdm=False)[0]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 2, "temperature": 0,
                                          "prompt_logprobs": 2}).json()
    plps = r["choices"][0]["prompt_logprobs"]
    assert len(plps) == len(ref.prompt_token_ids) and plps[0] is None
    for p in range(1, len(plps)):
        tid, want = ref.prompt_token_ids[p], ref.prompt_logprobs[p]
        top = {t for t, lp in want.items() if lp.rank <= 2}
        assert set(plps[p]) == {str(t) for t in top | {tid}}
        for t in top | {tid}:
            got = plps[p][str(t)]
            assert got["rank"] == want[t].rank and got["decoded_token"] == tok.decode([t])
            assert got["logprob"] == pytest.approx(want[t].logprob, abs=1e-4)
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0}
    r = http.post("/v1/chat/completions", json=chat).json()
    assert len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"] and r["prompt_logprobs"][0] is None
    err = _assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "prompt_logprobs": 1,
                                                           "stream": True}), 400)
    assert err["param"] == "prompt_logprobs" and "stream=True" in err["message"]
    # continue_final_message: the reply goes on from inside the last message, as LLM does from that prompt;
    # echo puts the message's text before it
    start = [CHAT[1], {"role": "assistant", "content": "The capital of France is"}]
    text = tok.apply_chat_template(start, tokenize=False, continue_final_message=True)
    assert text.endswith("The capital of France is")
    want = greedy(llm, [{"prompt_token_ids": tok.encode(text, add_special_tokens=False)}], 6)[0]
    for echo, prefix in ((False, ""), (True, start[1]["content"])):
        r = client.chat.completions.create(model=MODEL, messages=start, max_tokens=6, temperature=0,
                                           extra_body={"continue_final_message": True, "echo": echo})
        assert r.choices[0].message.content == prefix + want and r.choices[0].message.role == "assistant"
        chunks = list(client.chat.completions.create(model=MODEL, messages=start, max_tokens=6, temperature=0,
                                                     stream=True, extra_body={"continue_final_message": True,
                                                                              "echo": echo}))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == prefix + want
    err = _assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": start,
                                                                "continue_final_message": True,
                                                                "add_generation_prompt": True}), 400)
    assert err["param"] == "continue_final_message"
    # truncate_prompt_tokens: only the prompt's last k tokens run
    ids = tok.encode(PROMPTS[2])
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=4, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3 and r.choices[0].text == greedy(llm, [ids[-3:]], 4)[0]
    # return_tokens_as_token_ids: logprobs name their tokens by id
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=1,
                                  extra_body={"return_tokens_as_token_ids": True})
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert r.choices[0].logprobs.tokens == [f"token_id:{t}" for t in out.token_ids]
    # request_id names the response; add_special_tokens and spaces_between_special_tokens are taken
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1,
                                                "request_id": "abc-1", "spaces_between_special_tokens": False})
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-abc-1"
    import concurrent.futures               # one request_id twice at once: two requests, as vLLM (not one)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "request_id": "dup"}
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        both = list(ex.map(lambda _: http.post("/v1/chat/completions", json=body).json(), range(2)))
    assert [b["id"] for b in both] == ["chatcmpl-dup"] * 2 and [b["usage"]["completion_tokens"] for b in both] == [8, 8]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1,
                                           "add_special_tokens": False})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tok.encode(PROMPTS[0],
                                                                                            add_special_tokens=False))
    # fields the server cannot serve: refused by name, unless the value asks for nothing
    for field, value, code in (("use_beam_search", True, 400), ("use_beam_search", False, 200),
                               ("allowed_token_ids", [1, 2], 400), ("cache_salt", "s", 400), ("tools", [], 200)):
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1, field: value})
        assert r.status_code == code, (field, value, r.text)
        if code == 400:
            assert r.json()["error"]["param"] == field


# ---- concurrency ---------------------------------------------------------------------------------
def test_64_concurrent_streams(server, llm):
    from jaxpaged import SamplingParams
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(8)]
    # the non-concurrent result: one prompt at a time
    ref = [(o.outputs[0].text, o.outputs[0].finish_reason)
           for p in prompts for o in llm.generate([p], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)]

    async def one(aclient, i):
        text, finish = "", None
        stream = await aclient.completions.create(model=MODEL, prompt=prompts[i % 8], max_tokens=8,
                                                  temperature=0, stream=True)
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
        return text, finish

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(aclient, i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert list(results) == [ref[i % 8] for i in range(64)]


# ---- errors --------------------------------------------------------------------------------------
def _assert_error(resp: httpx.Response, status: int, err_type: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["code"] == status
    if err_type:
        assert err["type"] == err_type
    return err


def test_errors_are_openai_shaped_and_server_keeps_serving(server, client, http):
    ok = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    for field, value in [("max_tokens", -1), ("temperature", -0.5), ("n", 0), ("top_p", 0), ("logprobs", 50)]:
        for stream in (False, True):
            err = _assert_error(http.post("/v1/completions", json={**ok, field: value, "stream": stream}), 400,
                                "BadRequestError")
            assert field.split("_")[0] in err["message"]
    long_prompt = "hello " * 1200
    err = _assert_error(http.post("/v1/completions", json={**ok, "prompt": long_prompt}), 400)
    assert err["message"].startswith("This model's maximum context length is 1024 tokens. However, you requested")
    long_chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": long_prompt}]}
    err = _assert_error(http.post("/v1/chat/completions", json=long_chat), 400)
    assert "maximum context length is 1024 tokens" in err["message"]
    _assert_error(http.post("/v1/completions", content=b'{"prompt": "Hi", ',
                            headers={"content-type": "application/json"}), 400)
    _assert_error(http.post("/v1/completions", json={"model": MODEL}), 400)              # no prompt
    _assert_error(http.post("/v1/chat/completions",
                            json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}), 400)
    err = _assert_error(http.post("/v1/completions", json={**ok, "model": "no-such-model"}), 404, "NotFoundError")
    assert "no-such-model" in err["message"]
    _assert_error(httpx.post(server + "/v1/completions", json=ok), 401)                  # no key
    _assert_error(httpx.post(server + "/v1/completions", json=ok, headers={"Authorization": "Bearer wrong"}), 401)
    _assert_error(httpx.get(server + "/v1/models"), 401)
    _assert_error(httpx.post(server + "/tokenize", json={"prompt": "Hi"}), 401)           # not only /v1
    _assert_error(httpx.get(server + "/v1/models", headers={"Authorization": f"Basic {API_KEY}"}), 401)
    assert httpx.get(server + "/v1/models", headers={"Authorization": f"bearer {API_KEY}"}).status_code == 200
    _assert_error(http.get("/no-such-route"), 404)
    # inputs that once broke the server: each a 400 naming the problem, never a 5xx, a hang or a silent pass
    for prompt in ([-1], [1099511627776], [[5, -3]]):
        for echo in (False, True):
            err = _assert_error(http.post("/v1/completions", json={**ok, "prompt": prompt, "echo": echo}), 400)
            assert "out of vocabulary" in err["message"]
    err = _assert_error(http.post("/v1/completions", json={**ok, "n": 100000}), 400)
    assert err["message"] == "n: Input should be less than or equal to 128" and err["param"] == "n"
    for literal in (b"NaN", b"Infinity", b"-Infinity", b"1e999"):      # (1e999 parses as infinity)
        body = b'{"model": "%s", "prompt": "Hi", "max_tokens": 2, "temperature": %s}' % (MODEL.encode(), literal)
        err = _assert_error(http.post("/v1/completions", content=body, headers={"content-type": "application/json"}),
                            400)
        assert "temperature" in err["message"]
    err = _assert_error(http.post("/v1/completions", json={**ok, "priority": 3}), 400)
    assert "--scheduling-policy priority" in err["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    for field, value in (("tools", [tool]), ("response_format", {"type": "json_object"}), ("guided_json", {})):
        err = _assert_error(http.post("/v1/chat/completions", json={**chat, field: value}), 400)
        assert f"`{field}` is not supported" in err["message"]
    assert http.post("/v1/chat/completions", json={**chat, "response_format": {"type": "text"}}).status_code == 200
    r = http.get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["code"] == 405
    # a temperature past float32's range samples (uniformly), with no overflow
    big = http.post("/v1/completions", json={**ok, "temperature": 1e308})
    assert big.status_code == 200 and big.json()["usage"]["completion_tokens"] == 2
    # the openai client maps them to its exceptions
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()
    _hand_fuzzed_edges(http)
    # and the server keeps serving
    assert http.get("/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def _hand_fuzzed_edges(http):
    """The fuzzer's edges, by hand (and what it found): each a 4xx naming the problem, or served; never a 5xx,
    a hang or a dead engine."""
    ok = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    json_body = {"content-type": "application/json"}
    # bodies that are not JSON, or JSON nested past the parser's recursion limit
    nested = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for raw in (b"", b"\xff\xfe\x00garbage", b'{"prompt": "\xff"}', nested):
        _assert_error(http.post("/v1/completions", content=raw, headers=json_body), 400)
    # max_tokens 0, or past the context
    err = _assert_error(http.post("/v1/completions", json={**ok, "max_tokens": 0}), 400)
    assert err["param"] == "max_tokens"
    for path, body in (("/v1/completions", ok), ("/v1/chat/completions", chat)):
        err = _assert_error(http.post(path, json={**body, "max_tokens": 10**6}), 400)
        assert "maximum context length is 1024 tokens" in err["message"]
    # best_of, logprobs and top_logprobs past their limits; values of the wrong JSON type are not coerced
    for body, field in (({**ok, "best_of": 1000}, "best_of"), ({**ok, "best_of": 0}, "best_of"),
                        ({**ok, "logprobs": MAX_LOGPROBS + 1}, "logprobs"), ({**ok, "logprobs": -1}, "logprobs"),
                        ({**ok, "max_tokens": "2"}, "max_tokens"), ({**ok, "prompt": [True]}, "prompt"),
                        ({**ok, "seed": 2**64}, "seed"),
                        ({**chat, "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "logprobs")):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        assert field in _assert_error(http.post(path, json=body), 400)["message"]
    _assert_error(http.post("/detokenize", json={"tokens": [True]}), 400)
    # --max-logprobs sets the limit (above OpenAI's 20, as vLLM allows)
    r = http.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": MAX_LOGPROBS})
    assert r.status_code == 200, r.text
    assert {len(e["top_logprobs"]) for e in r.json()["choices"][0]["logprobs"]["content"]} == {MAX_LOGPROBS}
    # logit_bias: keys that are no token id or out of the vocabulary, values past OpenAI's [-100, 100]
    for bias in ({"abc": 1}, {"1.5": 1}, {"-5": 1}, {str(10**30): 1}, {"5": 101}, {"5": -1e308}):
        assert "logit_bias" in _assert_error(http.post("/v1/completions", json={**ok, "logit_bias": bias}),
                                             400)["message"]
    # a huge stop list and extreme sampler values are served (the sampler's tables clamp, nothing overflows)
    stops = [f"never-generated-{i}" for i in range(5000)]
    for extra in ({"stop": stops}, {"top_k": 2**62}, {"repetition_penalty": 1e308}, {"repetition_penalty": 1e-308}):
        r = http.post("/v1/completions", json={**ok, **extra, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, (extra, r.text)
    # echo with logprobs=0 scores the prompt with no top logprobs (its zero-width output killed the engine core)
    r = http.post("/v1/completions", json={**ok, "echo": True, "logprobs": 0, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["token_logprobs"][0] is None
    err = _assert_error(http.post("/v1/completions", json={**ok, "suffix": "x"}), 400)
    assert "`suffix` is not supported" in err["message"]
    # a request's own chat template is code: refused unless --trust-request-chat-template
    for body in ({**chat, "chat_template": "{{ 'x' * 10**9 }}"},
                 {**chat, "chat_template_kwargs": {"chat_template": "x"}}):
        err = _assert_error(http.post("/v1/chat/completions", json=body), 400)
        assert "--trust-request-chat-template" in err["message"]
    # bodies past --max-request-body-mib: a clear 413, announced (Content-Length) or not (chunked)
    big = b'{"prompt": "' + b"x" * (MAX_BODY_MIB * 2**20) + b'"}'
    for content in (big, iter([big])):
        err = _assert_error(http.post("/v1/completions", content=content, headers=json_body), 413)
        assert "--max-request-body-mib" in err["message"]


# ---- disconnect and metrics ----------------------------------------------------------------------
def _wait_idle(http) -> dict:
    return wait_metrics(http, lambda m: m["jaxpaged:num_requests_running"] == 0
                        and m["jaxpaged:kv_cache_usage_perc"] == 0)


def _running(m) -> bool:
    return m["jaxpaged:num_requests_running"] == 1 and m["jaxpaged:kv_cache_usage_perc"] > 0


def test_disconnect_mid_stream_frees_blocks(http):
    before = metrics(http)
    body = {"model": MODEL, "prompt": "Write a very long story about a dragon.", "max_tokens": 900,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line for _, line in zip(range(8), r.iter_lines())]
        assert any(line.startswith("data: {") for line in lines)
        # the HTTP side answers while the engine generates: /metrics and /v1/models are served between two
        # readings that both see the request running (the engine is mid-request, not waiting on them)
        during = wait_metrics(http, _running)
        assert _running(during)
        assert http.get("/v1/models").status_code == 200
        still = metrics(http)
        assert _running(still)
    after = _wait_idle(http)
    assert after["jaxpaged:num_requests_running"] == 0 and after["jaxpaged:num_requests_waiting"] == 0
    assert after["jaxpaged:kv_cache_usage_perc"] == 0
    assert after["jaxpaged:num_free_blocks"] == after["jaxpaged:num_blocks"]
    abort = "jaxpaged:request_success_total{finished_reason=abort}"
    assert after[abort] == before[abort] + 1
    assert after["jaxpaged:generation_tokens_total"] - before["jaxpaged:generation_tokens_total"] < 900
    # the same for a chat stream, and for a non-streaming request whose client times out
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=chat) as r:
        _ = [line for _, line in zip(range(6), r.iter_lines())]
    with pytest.raises(httpx.ReadTimeout):   # 900 tokens in 1 s would take 900 tok/s of one request on the CPU
        http.post("/v1/completions", json={**body, "stream": False}, timeout=1)
    after = _wait_idle(http)
    assert after["jaxpaged:num_requests_running"] == 0 and after["jaxpaged:kv_cache_usage_perc"] == 0
    assert after[abort] == before[abort] + 3


def test_metrics_parse_and_counters_move(client, http):
    before = metrics(http)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count"):
        assert "jaxpaged:" + name in before, name
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = metrics(http)

    def moved(name):
        return after[name] - before[name]

    assert moved("jaxpaged:generation_tokens_total") == 6
    assert moved("jaxpaged:prompt_tokens_total") == r.usage.prompt_tokens        # the whole prompt, cached or not
    assert moved("jaxpaged:request_success_total{finished_reason=length}") == 1
    assert moved("jaxpaged:time_to_first_token_seconds_count") == 1
    assert moved("jaxpaged:e2e_request_latency_seconds_count") == 1
    assert moved("jaxpaged:inter_token_latency_seconds_count") == 5
    assert moved("jaxpaged:prefix_cache_queries_total") == r.usage.prompt_tokens  # in tokens, as vLLM
    assert 0 <= moved("jaxpaged:prefix_cache_hits_total") < r.usage.prompt_tokens
    assert after["jaxpaged:num_requests_running"] == 0
