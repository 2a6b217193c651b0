"""Hostile input against a real `kiln serve` configured with small HTTP limits and CORS for one
origin: each refusal is a clear 4xx and nothing else is affected; a request that asks for as much
as it may (n sequences up to the context) cannot make a later one wait for it; GET /debug/kv shows
no block leaked afterwards. (The default limits are checked in tests/server/test_server.py.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server import API_KEY, NAMES, POEM, Server, _serve

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
GOOD = "http://good.example"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> Iterator[Server]:
    yield from _serve(tmp_path_factory.mktemp("serve-hostile"), gguf_path,
                      "--max-request-body-bytes", "64KiB", "--max-header-bytes", "8KiB",
                      "--allowed-origins", GOOD, "--allowed-methods", "GET,POST",
                      "--max-num-seqs", "4")


def _kv(server: Server) -> dict[str, Any]:
    return httpx.get(f"{server.base_url}/debug/kv", headers=AUTH, timeout=30).json()


def _wait_idle_kv(server: Server, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        kv = _kv(server)
        if kv["idle"] and not server.health().get("num_inflight"):
            return kv
        assert time.monotonic() < deadline, kv
        time.sleep(0.2)


def test_a_chunked_body_over_the_limit_is_413_and_one_under_it_passes(server: Server) -> None:
    def chunks(total: int) -> Iterator[bytes]:  # no Content-Length: read as it comes
        yield b'{"model": "smol", "messages": [{"role": "user", "content": "'
        for _ in range(total // 1000):
            yield b"a" * 1000
        yield b'"}]}'

    url = f"{server.base_url}/v1/chat/completions"
    big = httpx.post(url, content=chunks(100_000), headers=AUTH, timeout=30)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large", big.text
    assert "--max-request-body-bytes" in big.json()["error"]["message"]
    # 60 kB passes the limit; the prompt is then too long for the context (a 400, not a 413)
    ok = httpx.post(url, content=chunks(60_000), headers=AUTH, timeout=60)
    assert ok.status_code == 400 and ok.json()["error"]["param"] == "messages", ok.text


def test_headers_over_the_configured_limit_are_431(server: Server) -> None:
    r = httpx.get(f"{server.base_url}/health", headers={"X-Big": "a" * 9000}, timeout=10)
    err = r.json()["error"]
    assert r.status_code == 431 and err["code"] == "request_header_fields_too_large"
    assert "8192 bytes" in err["message"]  # the limit configured
    assert httpx.get(f"{server.base_url}/health", headers={"X-Ok": "a" * 4000}).status_code == 200


def test_cors_answers_only_the_configured_origin(server: Server) -> None:
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(f"{server.base_url}/v1/chat/completions", timeout=10, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})

    good = preflight(GOOD)
    assert good.status_code == 200 and good.headers["access-control-allow-origin"] == GOOD
    assert "POST" in good.headers["access-control-allow-methods"]
    evil = preflight("http://evil.example")
    assert evil.status_code == 400 and "access-control-allow-origin" not in evil.headers
    r = httpx.get(f"{server.base_url}/v1/models", headers={**AUTH, "Origin": GOOD})
    assert r.headers["access-control-allow-origin"] == GOOD


def test_a_request_holding_every_slot_does_not_make_the_next_one_wait(server: Server) -> None:
    """n=16 sequences up to the context (~1000 tokens each) on a server with 4 sequence slots:
    a short request sent once they fill every slot finishes while the big one is still far from
    done (first come, first served would have it wait for 12 of the 16). Then the big one's
    client leaves: every block comes back."""

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH,
                                     timeout=300) as http:
            big_body = {"model": NAMES[0], "messages": POEM, "n": 16, "ignore_eos": True,
                        "temperature": 0.8, "stream": True}
            big = asyncio.create_task(http.post("/v1/chat/completions", json=big_body))
            deadline = time.monotonic() + 60
            while (await http.get("/debug/kv")).json()["num_running"] < 4:
                assert time.monotonic() < deadline and not big.done()
                await asyncio.sleep(0.1)
            small = await http.post("/v1/chat/completions", json={
                "model": NAMES[0], "messages": POEM, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True})
            assert small.status_code == 200, small.text
            assert small.json()["usage"]["completion_tokens"] == 8
            kv = (await http.get("/debug/kv")).json()
            assert not big.done() and kv["num_running"] + kv["num_waiting"] >= 8, kv
            assert kv["integrity"] == "ok", kv
            big.cancel()  # the client hangs up: its 16 engine requests are aborted
            with pytest.raises(asyncio.CancelledError):
                await big

    asyncio.run(scenario())
    kv = _wait_idle_kv(server)
    assert kv["integrity"] == "ok" and kv["leaked_blocks"] == 0, kv


def test_debug_kv_needs_the_key(server: Server) -> None:
    assert httpx.get(f"{server.base_url}/debug/kv").status_code == 401
    kv = _kv(server)
    assert kv["blocks_total"] > 0 and kv["blocks_used"] <= kv["blocks_total"]
