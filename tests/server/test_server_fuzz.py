"""schemathesis over the real server's `/openapi.json`: every route, schema-valid and schema-breaking
requests. Nothing may answer 5xx, hang (a request timeout fails the example) or kill the server; every
refusal is a 4xx in OpenAI's error schema; every answer conforms to the schema; and every guarded route
refuses a request without the API key.

Bounded and deterministic: a fixed number of examples per route, drawn with a derandomized Hypothesis (the
same requests on every run, no example database). A tiny random-weight Llama with SmolLM2's tokenizer and a
short context keeps each generated request cheap.
"""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import CheckContext
from schemathesis.specs.openapi.checks import positive_data_acceptance

from conftest import ServerProcess, save_tiny_llama

pytestmark = pytest.mark.slow

API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Per request: far above any answer of this server on a busy 2-core machine, so that only a hang hits it.
REQUEST_TIMEOUT_S = 120
EXAMPLES = 25            # per route and kind (the schema's examples, schema-valid, schema-breaking)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz_model")
    save_tiny_llama(d, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1)
    # a context of 64 tokens bounds the costliest valid request (n=128 samples of up to 64 tokens)
    with ServerProcess(["--model", str(d), "--served-model-name", "tiny", "--max-model-len", "64",
                        "--dtype", "float32", "--api-key", API_KEY]) as srv:
        yield srv
        # whatever the fuzzing sent, the server is still up, healthy and generating
        assert srv.proc.poll() is None, srv.read_log()[-3000:]
        assert httpx.get(srv.base + "/health", timeout=REQUEST_TIMEOUT_S).status_code == 200
        r = httpx.post(srv.base + "/v1/completions", headers=AUTH, timeout=REQUEST_TIMEOUT_S,
                       json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def openai_error_body(ctx: CheckContext, response, case) -> None:
    """Every refusal (any status from 400) is {"error": {"message", "type", "param", "code"}}."""
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == response.status_code
        assert "Traceback" not in error["message"]


def _run(strategy, base: str) -> None:
    @given(case=strategy)
    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        # positive_data_acceptance is off: the schema cannot say what depends on the model (a prompt's
        # length against the context, token ids against the vocabulary), so a valid body may be refused
        case.call_and_validate(base_url=base, headers=AUTH, timeout=REQUEST_TIMEOUT_S,
                               additional_checks=[openai_error_body], excluded_checks=[positive_data_acceptance])

    run()


def test_fuzz_every_route(server):
    schema = schemathesis.openapi.from_url(server.base + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions",
                                               "POST /tokenize", "POST /detokenize", "GET /health"}
    for operation in operations:
        for explicit in schema.get_strategies_from_examples(operation):     # the schema's own examples
            _run(explicit, server.base)
        _run(operation.as_strategy(GenerationMode.POSITIVE), server.base)
        if len(operation.body):                 # (the routes that take no body have nothing to break)
            _run(operation.as_strategy(GenerationMode.NEGATIVE), server.base)
