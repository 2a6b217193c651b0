"""Several models behind one endpoint (`kiln serve --models`, kiln/server/model_router.py): a real
router over SmolLM2 and a tiny random llama, with memory for one model at a time
(--max-loaded-models 1), through the openai client."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import add_word_tokenizer, make_tiny_model
from test_server import API_KEY, Server, _free_port, _run_server

from kiln.bench.workloads import WORDS

PROMPT = " ".join(WORDS[:12])  # words the tiny model's tokenizer knows too


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("router")
    tiny = make_tiny_model("llama", tmp / "tiny")
    add_word_tokenizer(tiny)
    # Each model's own settings in its [models.NAME] table; the router's flags below are
    # inherited by both (a per-model value would win over them).
    config = tmp / "models.toml"
    config.write_text(f'[models.smol]\nmodel = "{gguf_path}"\nmax_model_len = 512\n\n'
                      f'[models.tiny]\nmodel = "{tiny}"\ndtype = "float32"\n')
    port = _free_port()
    cmd = [sys.executable, "-m", "kiln", "serve", "--config", str(config),
           "--host", "127.0.0.1", "--port", str(port), "--api-key", API_KEY,
           "--max-loaded-models", "1", "--no-compile", "--kv-cache-memory", "64MiB",
           "--max-model-len", "256"]
    yield from _run_server(tmp, port, cmd)


def _pool(server: Server) -> dict:
    r = httpx.get(f"{server.base_url}/router/models", timeout=10,
                  headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    return r.json()


def _loaded(server: Server) -> list[str]:
    return [m["id"] for m in _pool(server)["models"] if m["state"] == "loaded"]


def _complete(client: openai.OpenAI, model: str, **kw) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, **kw)
    assert r.model == model
    return r.choices[0].text


@pytest.mark.heavy  # three model loads (~95 s): outside make test's time budget
def test_each_model_answers_and_one_fits_at_a_time(router: Server) -> None:
    client = router.client()
    listed = {m.id: m.model_extra["state"] for m in client.models.list().data}
    assert listed == {"smol": "unloaded", "tiny": "unloaded"}

    first = _complete(client, "smol")
    assert _loaded(router) == ["smol"]
    tiny = _complete(client, "tiny")
    assert _loaded(router) == ["tiny"]  # smol unloaded to make room
    again = _complete(client, "smol")  # reloaded from scratch: the same greedy answer
    assert _loaded(router) == ["smol"]
    assert first == again and first != tiny
    pool = _pool(router)
    assert (pool["loads"], pool["unloads"]) == (3, 2)
    (smol,) = [m for m in pool["models"] if m["id"] == "smol"]
    assert smol["memory_bytes"] > 50 << 20  # its process's RSS, as kiln ps shows it

    # Streamed through the router: the same text, chunk by chunk.
    stream = client.completions.create(model="smol", prompt=PROMPT, max_tokens=8,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == first

    # kiln ps: the router and the model it has loaded, each with its memory.
    ps = json.loads(subprocess.run([sys.executable, "-m", "kiln", "ps", "--json"],
                                   capture_output=True, text=True, check=True).stdout)
    port = int(router.base_url.rsplit(":", 1)[1])
    (row,) = [r for r in ps if r["port"] == port]
    assert row["engine"] == "router" and row["model"] == "smol,tiny"
    child = [r for r in ps if r["model"] == "smol" and r["pid"] == smol["pid"]]
    assert child and child[0]["memory_bytes"] > 50 << 20


def test_unknown_model_and_bad_keep_alive_are_client_errors(router: Server) -> None:
    client = router.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert "smol, tiny" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt="x", max_tokens=1,
                                  extra_body={"keep_alive": "soon"})
    assert "keep_alive" in str(e.value)
    r = httpx.post(f"{router.base_url}/v1/completions", json={"model": "smol", "prompt": "x"})
    assert r.status_code == 401  # the router checks the key before any model loads


@pytest.mark.heavy  # another model load: outside make test's time budget
def test_keep_alive_zero_unloads_after_the_request(router: Server) -> None:
    """Ollama's per-request keep_alive: 0 unloads the model as soon as its request ends."""
    client = router.client()
    _complete(client, "tiny", extra_body={"keep_alive": 0})
    deadline = time.monotonic() + 30
    while "tiny" in _loaded(router) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "tiny" not in _loaded(router)
    metrics = httpx.get(f"{router.base_url}/metrics", timeout=10).text
    assert "kiln_router_model_unloads_total" in metrics


@pytest.mark.heavy  # another model load: outside make test's time budget
def test_chat_page_and_dashboard_stats_over_the_router(router: Server) -> None:
    """The same pages as a single model's server; the dashboard's stats hold each loaded
    model's series (keyed by model)."""
    page = httpx.get(f"{router.base_url}/", timeout=10)
    assert page.status_code == 200 and "<html" in page.text.lower()
    _complete(router.client(), "smol")
    key = {"Authorization": f"Bearer {API_KEY}"}
    stats = httpx.get(f"{router.base_url}/v1/dashboard/stats", headers=key, timeout=10).json()
    assert [m["name"] for m in stats["models"]] == ["smol"]
    cfg = httpx.get(f"{router.base_url}/v1/dashboard/config", headers=key, timeout=10)
    assert cfg.status_code == 200 and "settings" in cfg.json()
