"""vLLM's own options through `spark-edge serve -- ...` and $SPARK_EDGE_VLLM_ARGS, against one real server:
HTTPS with a certificate made here, a served model name, tool calling through a parser vLLM ships, and
JSON-schema-constrained output."""

from __future__ import annotations

import datetime
import ipaddress
import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import requests

from conftest import Server, running_server

pytestmark = pytest.mark.engine

SERVED_NAME = "edge-chat"
# strict: OpenAI's flag for arguments that follow the schema; vLLM then constrains them too (without it only
# the <tool_call> envelope is constrained, and the default model wrote the arguments "Paris")
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, as an operator would make with openssl."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "spark-edge test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_path.chmod(0o600)
    return cert_path, key_path


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="session")
def options_server(
    bf16_server: Server, tls_files: tuple[Path, Path], spark_edge_home: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """bf16 (its compile cache is bf16_server's), with options through both ways: the variable and `--`."""
    cert, key = tls_files
    args = [
        "--weight-path",
        "bf16",
        "--",
        "--served-model-name",
        SERVED_NAME,
        "--ssl-certfile",
        str(cert),
        "--ssl-keyfile",
        str(key),
    ]
    env = {"SPARK_EDGE_VLLM_ARGS": "--enable-auto-tool-choice --tool-call-parser hermes"}
    yield from running_server("options_server", args, spark_edge_home, tmp_path_factory, env=env, tls_ca=cert)


def _chat(server: Server, **body) -> dict:
    reply = server.post("/v1/chat/completions", {"model": SERVED_NAME, "temperature": 0, "max_tokens": 48, **body})
    assert reply.status_code == 200, reply.text[:500]
    return reply.json()["choices"][0]["message"]


def test_a_completion_over_https_verified_against_the_certificate(options_server: Server) -> None:
    assert options_server.url.startswith("https://")
    reply = options_server.post(
        "/v1/completions",
        {"model": SERVED_NAME, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    with pytest.raises(requests.exceptions.SSLError):  # the system's CAs do not know it
        requests.get(f"{options_server.url}/health", timeout=10)
    with pytest.raises(requests.exceptions.ConnectionError):  # no plain HTTP beside it
        requests.get(options_server.url.replace("https://", "http://") + "/health", timeout=10)


def test_the_served_name_shows_in_models_and_in_metric_labels(options_server: Server) -> None:
    models = options_server.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [SERVED_NAME]
    metrics = options_server.get("/metrics").text
    assert f'model_name="{SERVED_NAME}"' in metrics


def test_the_start_log_lists_what_was_passed_through(options_server: Server) -> None:
    log = options_server.log_path.read_text(errors="replace")
    line = next(li for li in log.splitlines() if "vLLM options passed through:" in li)
    # the variable's words first, then what followed `--`
    assert line.index("--enable-auto-tool-choice") < line.index("--served-model-name edge-chat")
    assert "--ssl-keyfile" in line


def test_a_named_tool_choice_returns_a_parsed_tool_call(options_server: Server) -> None:
    message = _chat(
        options_server,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    call = message["tool_calls"][0]["function"]
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER_TOOL["function"]["parameters"])


def test_auto_tool_choice_through_the_hermes_parser_returns_a_well_formed_message(options_server: Server) -> None:
    message = _chat(
        options_server,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tool_choice="auto",
    )
    assert message["role"] == "assistant"
    calls = message.get("tool_calls") or []
    # a 135M model rarely writes hermes' <tool_call> tags: either a parsed call or plain text, never both broken
    assert calls or (isinstance(message["content"], str) and "<tool_call>" not in message["content"])
    for call in calls:
        assert call["function"]["name"] == "get_weather"
        json.loads(call["function"]["arguments"])


def test_a_json_schema_constrained_completion_is_valid_json(options_server: Server) -> None:
    message = _chat(
        options_server,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=96,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}},
    )
    jsonschema.validate(json.loads(message["content"]), PERSON_SCHEMA)
