"""Faults outside kiln, as a user meets them: no network, and a Hugging Face hub that answers
401/404/429/5xx (faked by a local HTTP server that HF_ENDPOINT points at). Each is one line
naming the cause and what to do, never a traceback, and fails fast."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


class _Hub(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        body = json.dumps({"error": f"fake hub says {self.server.status}"}).encode()
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Error-Code", "RepoNotFound" if self.server.status == 404 else "")
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def hub() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pull(endpoint: str, tmp: Path) -> tuple[int, str, float]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp), "HF_ENDPOINT": endpoint,
           "HF_HOME": str(tmp / "hf"), "KILN_CACHE_DIR": str(tmp / "kiln"),
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "kiln", "pull", "someone/some-model"], env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    return p.returncode, p.stderr + p.stdout, time.monotonic() - t0


def _one_error(out: str) -> list[str]:
    assert "Traceback" not in out, out
    lines = [ln for ln in out.splitlines() if ln.startswith("kiln")]
    assert len(lines) == 1, out
    return lines


def test_no_network_is_one_line_in_seconds(tmp_path: Path) -> None:
    rc, out, seconds = _pull(f"http://127.0.0.1:{_free_port()}", tmp_path)  # nothing listens
    assert rc != 0 and seconds < 30
    (line,) = _one_error(out)
    assert "cannot reach the Hugging Face hub" in line and "someone/some-model" in line
    assert "--offline" in out and "KILN_MODEL_DIRS" in out


# (429 is retried by the hub client as 5xx is, ~24 s of backoff: its message is checked below
# without the wait.)
@pytest.mark.parametrize(("status", "says"), [
    (401, "HF_TOKEN"), (404, "no Hugging Face repo"), (503, "again later")])
def test_hub_http_errors_are_one_line_with_what_to_do(hub, tmp_path: Path, status: int,
                                                      says: str) -> None:
    hub.status = status
    rc, out, _ = _pull(f"http://127.0.0.1:{hub.server_address[1]}", tmp_path)
    assert rc != 0
    _one_error(out)
    assert says in out, out


def test_rate_limit_says_wait_and_token() -> None:
    """What the hub client raises after its retries on 429, as kiln reports it."""
    import importlib

    from huggingface_hub.errors import HfHubHTTPError

    from kiln.resolve.download import _hub_error

    # the HTTP library this huggingface_hub version runs on (httpx, or its httpx2 fork)
    response_type = HfHubHTTPError.__init__.__annotations__["response"]
    module = response_type if isinstance(response_type, str) else response_type.__module__
    http = importlib.import_module(module.split(".")[0])
    resp = http.Response(429, request=http.Request("GET", "http://127.0.0.1/api/models/a/b"))
    err = _hub_error("a/b", HfHubHTTPError("429 Client Error: Too Many Requests", response=resp))
    assert "answered 429 for a/b" in str(err)
    assert "rate limited" in str(err.hint) and "HF_TOKEN" in str(err.hint)


def test_truncated_gguf_is_named_as_such(tmp_path: Path, gguf_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """An interrupted download or copy: the header is whole, the tensors are not."""
    from kiln.cli.main import main

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_path.read_bytes()[: gguf_path.stat().st_size // 2])
    assert main(["serve", str(cut), "--dry-run"]) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"{cut} is truncated: its tensors need" in err and "fetch it again" in err


def test_port_in_use_fails_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    from kiln.cli.main import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        assert main(["serve", "--port", str(port), "--no-compile"]) != 0
        seconds = time.monotonic() - t0
    err = capsys.readouterr().err
    assert f"error (port): cannot listen on 127.0.0.1:{port}" in err and "--port" in err
    assert "loading" not in err and seconds < 30
