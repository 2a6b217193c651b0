"""API fuzzing: schemathesis generates requests from kiln's own OpenAPI schema for every
endpoint and checks each answer against it (no 5xx, status codes and bodies as documented, the
right content types), then a normal request still gets its answer. A real `kiln serve` of the
shipped SmolLM2 on 127.0.0.1, with a short context and small caps so generated requests stay
fast (max_tokens, n and stop lists are bounded by --max-model-len and --max-n)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> Iterator[str]:
    port = _free_port()
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    cmd = [sys.executable, "-m", "kiln", "serve", str(gguf_path), "--host", "127.0.0.1",
           "--port", str(port), "--device", "cpu", "--dtype", "float32", "--no-compile",
           "--max-model-len", "64", "--max-n", "2", "--max-num-seqs", "8",
           "--kv-cache-memory", "32MiB"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kiln serve did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# What the issue asks of every answer. Not schemathesis's positive_data_acceptance: kiln
# refuses, with a documented 400, values the JSON schema cannot express (a prompt plus
# max_tokens over the context, a stop list over --max-stop-sequences, top_logprobs without
# logprobs).
CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
          checks.content_type_conformance, checks.response_schema_conformance]


def test_every_endpoint_answers_as_its_schema_says(fuzz_server: str) -> None:
    """Each operation of /openapi.json gets up to 25 generated requests (derandomized, so CI
    sees the same ones); call_and_validate checks each answer: no 5xx, a documented status, a
    body matching its schema, the documented content type. (Hypothesis drives schemathesis
    directly: its pytest plugin does not run under this pytest.)"""
    schema = schemathesis.openapi.from_url(f"{fuzz_server}/openapi.json")
    cases: dict[str, int] = {}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {
        "POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /health",
        "GET /version", "GET /metrics", "POST /v1/responses", "GET /v1/responses/{response_id}",
        "GET /v1/models/{model_id}", "POST /tokenize", "POST /detokenize"}
    for op in operations:
        _fuzz(op, cases)
    print(f"schemathesis cases per operation: {cases}")
    assert sum(cases.values()) >= 50


def _fuzz(op: Any, cases: dict[str, int]) -> None:
    @given(case=op.as_strategy())
    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        cases[op.label] = cases.get(op.label, 0) + 1
        case.call_and_validate(timeout=60, checks=CHECKS)

    run()


def test_server_still_answers_after_the_fuzzing(fuzz_server: str) -> None:
    body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}
    r = httpx.post(f"{fuzz_server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


def test_embeddings_on_a_generating_model_say_how(fuzz_server: str) -> None:
    """/v1/embeddings on a chat model: a 400 that says to serve it with --kind embed."""
    import openai

    client = openai.OpenAI(base_url=f"{fuzz_server}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=client.models.list().data[0].id, input="hello")
    assert e.value.code == "wrong_model_kind" and "--kind embed" in e.value.message  # the way out
