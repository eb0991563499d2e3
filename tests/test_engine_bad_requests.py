"""Bad requests get a clear 4xx, and the server keeps serving the next request."""

from __future__ import annotations

import pytest
import requests

from spark_edge.checkpoints.default_model import DEFAULT_MODEL_ID

from conftest import Server

pytestmark = pytest.mark.engine

GOOD = {
    "model": DEFAULT_MODEL_ID,
    "prompt": "The capital of France is",
    "max_tokens": 4,
    "temperature": 0,
    "ignore_eos": True,
}

CASES = {
    "malformed-json": b'{"model": "x", "prompt": ',
    "invalid-utf8": b'{"model": "' + DEFAULT_MODEL_ID.encode() + b'", "prompt": "\xff\xfe\xfa", "max_tokens": 2}',
    "max-tokens-wrong-type": {**GOOD, "max_tokens": "many"},
    "max-tokens-negative": {**GOOD, "max_tokens": -5},
    "max-tokens-huge": {**GOOD, "max_tokens": 10**9},
    "prompt-longer-than-context": {**GOOD, "prompt": "hello " * 5000},
    "unknown-model": {**GOOD, "model": "no-such-model"},
    "temperature-negative": {**GOOD, "temperature": -3},
    "top-p-out-of-range": {**GOOD, "top_p": 7.5},
    "prompt-wrong-type": {**GOOD, "prompt": {"text": "hi"}},
    "n-absurd": {**GOOD, "n": 10**6},
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_gets_4xx_then_a_good_request_is_served(bf16_server: Server, case: str) -> None:
    payload = CASES[case]
    url = f"{bf16_server.url}/v1/completions"
    if isinstance(payload, bytes):
        headers = {**bf16_server.headers, "Content-Type": "application/json"}
        reply = requests.post(url, data=payload, headers=headers, timeout=120)
    else:
        reply = bf16_server.post("/v1/completions", payload)
    assert 400 <= reply.status_code < 500, f"{case}: {reply.status_code} {reply.text[:300]}"
    assert reply.text.strip(), "the error says what was wrong"
    good = bf16_server.post("/v1/completions", GOOD)
    assert good.status_code == 200 and good.json()["choices"][0]["text"]
