"""Faults outside kiln, as a user meets them: no network; a Hugging Face hub that answers
401/404/429/5xx, or whose connection drops half way through a file (faked by a local HTTP server
that HF_ENDPOINT points at); a full disk; truncated or corrupt weights; a port in use; an
unwritable cache folder. Each is one line naming the cause and what to do, never a traceback,
fails fast, and leaves nothing half-written under a final name."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kiln.i18n import msg
from kiln.i18n.catalogue import CATALOGUE


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


def _pull(endpoint: str, tmp: Path, max_file_bytes: int | None = None
          ) -> tuple[int, str, float, str | None]:
    """`kiln pull --json` in a process of its own: exit code, stderr + stdout, seconds, and the
    code of the error it printed as JSON (None when it did not fail)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp), "HF_ENDPOINT": endpoint,
           "HF_HOME": str(tmp / "hf"), "KILN_CACHE_DIR": str(tmp / "kiln"),
           "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}

    def limit_file_size() -> None:  # a full disk, as far as this process can tell
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write(), not a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "kiln", "pull", "someone/some-model", "--json"],
                       env=env,
                       capture_output=True, text=True, timeout=120, check=False,
                       preexec_fn=limit_file_size if max_file_bytes else None)
    seconds = time.monotonic() - t0
    code = json.loads(p.stdout)["error"]["code"] if p.returncode else None
    return p.returncode, p.stderr + p.stdout, seconds, code


def _one_error(out: str) -> list[str]:
    assert "Traceback" not in out, out
    lines = [ln for ln in out.splitlines()
             if ln.startswith("kiln") and not ln.startswith("kiln: downloading")
             and not ln.startswith('  "')]  # --json's lines
    assert len(lines) == 1, out
    return lines


def test_no_network_is_one_line_in_seconds(tmp_path: Path) -> None:
    rc, out, seconds, code = _pull(f"http://127.0.0.1:{_free_port()}", tmp_path)  # no one there
    assert rc != 0 and seconds < 30 and code == "download.unreachable"
    (line,) = _one_error(out)
    assert "someone/some-model" in line
    assert "--offline" in out and "KILN_MODEL_DIRS" in out


# (The hub client retries 408, 429, 500 and 502-504 with ~24 s of backoff: 429's message is
# checked below without the wait, and 501 takes the same 5xx hint as 503 would, at once.)
@pytest.mark.parametrize(("status", "code", "says"), [
    (401, "download.http", "HF_TOKEN"), (404, "download.no_repo", "HF_TOKEN"),
    (501, "download.http", "kiln pull someone/some-model")])  # the command to run again
def test_hub_http_errors_are_one_line_with_what_to_do(hub, tmp_path: Path, status: int,
                                                      code: str, says: str) -> None:
    hub.status = status
    rc, out, _, got = _pull(f"http://127.0.0.1:{hub.server_address[1]}", tmp_path)
    assert rc != 0 and got == code
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
    assert err.code == "download.http" and err.message.fields["status"] == 429
    assert err.hint.key == "download.http.429" and "HF_TOKEN" in err.hint  # wait, or a token


def test_truncated_gguf_is_named_as_such(tmp_path: Path, gguf_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """An interrupted download or copy: the header is whole, the tensors are not."""
    cut = tmp_path / "cut.gguf"
    size = gguf_path.stat().st_size // 2
    cut.write_bytes(gguf_path.read_bytes()[:size])
    code, err = _failed(tmp_path, capsys, "serve", str(cut), "--dry-run")
    assert "Traceback" not in err and code == "gguf.truncated"
    assert str(cut) in err and f"{size:,}" in err  # the file, and the bytes it has
    assert "kiln pull" in err  # the hint's way out: fetch it again


def _failed(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str
            ) -> tuple[str | None, str]:
    """Runs the kiln command `argv`, which must fail: the code of its effective config's error
    (what a program matches) and its stderr (what a person reads)."""
    from kiln.cli.main import main

    eff = tmp_path / "eff.json"
    assert main([*argv, "--effective-config-json", str(eff)]) != 0
    return json.loads(eff.read_text())["error"]["code"], capsys.readouterr().err


def test_port_in_use_fails_before_the_model_loads(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        code, err = _failed(tmp_path, capsys, "serve", "--port", str(port), "--no-compile")
        seconds = time.monotonic() - t0
    assert code == "serve.port_in_use" and f"127.0.0.1:{port}" in err and "--port" in err
    loading = CATALOGUE["serve.loading"]["en"].split("{")[0]  # "kiln: loading ", the load's line
    assert loading not in err and seconds < 30


def test_unwritable_cache_dir_is_one_line_naming_it(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # a path under a file: not writable even for root, who ignores permission bits
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("KILN_CACHE_DIR", str(blocker / "kiln"))
    code, err = _failed(tmp_path, capsys, "run", "Hello", "--max-tokens", "2")
    assert "Traceback" not in err
    assert code == "paths.cache_unwritable" and str(blocker / "kiln") in err
    assert "KILN_CACHE_DIR" in err


# -- a hub that serves a real file, and drops the connection half way -------------------------

REPO = "someone/some-model"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class _RepoHub(BaseHTTPRequestHandler):
    """A one-file repo (model.gguf). The first `cuts` GETs of the file send half of what they
    promise, then hang up; every Range header asked for is recorded."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        srv = self.server
        data: bytes = srv.data  # type: ignore[attr-defined]
        if "/api/models/" in self.path:
            body = json.dumps([{"type": "file", "path": "model.gguf", "size": len(data),
                                "oid": "f" * 40, "lfs": {"oid": srv.sha, "size": len(data),
                                                         "pointerSize": 134}}]).encode()
            self._head(200, len(body), "application/json")
            self.wfile.write(body)
            return
        if not self.path.endswith("/model.gguf"):
            self._head(404, 0, "text/plain")
            return
        start = 0
        rng = self.headers.get("Range")
        if self.command == "GET":
            srv.ranges.append(rng)  # type: ignore[attr-defined]
        if rng:
            start = int(rng.removeprefix("bytes=").split("-")[0])
        body = data[start:]
        self._head(206 if rng else 200, len(body), "application/octet-stream",
                   extra={"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"}
                   if rng else {})
        if self.command == "HEAD":
            return
        if srv.cuts > 0:  # type: ignore[attr-defined]
            srv.cuts -= 1  # type: ignore[attr-defined]
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(body)

    do_HEAD = do_GET

    def _head(self, status: int, length: int, ctype: str, extra: dict[str, str] | None = None
              ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(length))
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{self.server.sha}"')  # type: ignore[attr-defined]
        self.send_header("Accept-Ranges", "bytes")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def repo_hub(gguf_path: Path) -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RepoHub)
    server.data = gguf_path.read_bytes()  # type: ignore[attr-defined]
    server.sha = hashlib.sha256(server.data).hexdigest()  # type: ignore[attr-defined]
    server.cuts = 0  # type: ignore[attr-defined]
    server.ranges = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def _hub_files(tmp: Path) -> list[Path]:
    return [p for p in (tmp / "hf").rglob("*") if p.is_file() or p.is_symlink()]


def test_a_download_cut_half_way_resumes_and_is_complete(repo_hub, tmp_path: Path) -> None:
    repo_hub.cuts = 1
    rc, out, _, _ = _pull(f"http://127.0.0.1:{repo_hub.server_address[1]}", tmp_path)
    assert rc == 0, out
    assert "Traceback" not in out
    first, resumed = repo_hub.ranges  # the whole file, then from where it was cut
    start = int(resumed.removeprefix("bytes=").removesuffix("-"))
    assert first is None and 0 < start <= len(repo_hub.data) // 2  # resumed, not restarted
    (got,) = [p for p in _hub_files(tmp_path) if p.name == "model.gguf"]
    assert hashlib.sha256(got.read_bytes()).hexdigest() == repo_hub.sha
    assert not [p for p in _hub_files(tmp_path) if p.name.endswith(".incomplete")]


def test_a_download_that_keeps_dropping_is_one_line_and_leaves_nothing(repo_hub,
                                                                       tmp_path: Path) -> None:
    repo_hub.cuts = 100
    rc, out, _, code = _pull(f"http://127.0.0.1:{repo_hub.server_address[1]}", tmp_path)
    assert rc != 0 and code == "download.cut"
    (line,) = _one_error(out)
    assert REPO in line
    assert "kiln pull someone/some-model" in out and "KILN_MODEL_DIRS" in out
    assert len(repo_hub.ranges) > 2  # it did resume before giving up
    left = [p.name for p in _hub_files(tmp_path)]
    assert "model.gguf" not in left and not [n for n in left if n.endswith(".incomplete")]


def test_a_full_disk_is_one_line_and_leaves_nothing(repo_hub, tmp_path: Path) -> None:
    rc, out, _, code = _pull(f"http://127.0.0.1:{repo_hub.server_address[1]}", tmp_path,
                             max_file_bytes=4 << 20)
    assert rc != 0 and code == "download.disk_full"
    (line,) = _one_error(out)
    assert REPO in line and "HF_HOME" in out
    left = [p.name for p in _hub_files(tmp_path)]
    assert "model.gguf" not in left and not [n for n in left if n.endswith(".incomplete")]


# -- corrupt weights ----------------------------------------------------------------------------


def _first_tensor_offset_pos(path: Path, data: bytes) -> int:
    """Where the first tensor's offset field sits in a GGUF header (kiln's own parser gives the
    tensor's name and rank)."""
    from kiln.models.gguf import GGUFFile

    first = GGUFFile(path).tensors[0]
    name = first.name.encode()
    pos = data.index(struct.pack("<Q", len(name)) + name)
    return pos + 8 + len(name) + 4 + 8 * len(first.shape) + 4


@pytest.mark.parametrize("damage", ["bad magic", "garbage offset", "unaligned offset"])
def test_a_corrupt_gguf_is_one_line_naming_it(tmp_path: Path, gguf_path: Path, damage: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    data = bytearray(gguf_path.read_bytes())
    if damage == "bad magic":
        data[:4] = b"GGUX"
        want, names = "gguf.bad_magic", "GGUX"
    else:
        pos = _first_tensor_offset_pos(gguf_path, bytes(data))
        data[pos:pos + 8] = struct.pack("<Q", 1 << 40 if damage == "garbage offset" else 7)
        from kiln.models.gguf import GGUFFile

        want, names = "gguf.corrupt", repr(GGUFFile(gguf_path).tensors[0].name)  # the tensor
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    code, err = _failed(tmp_path, capsys, "serve", str(bad), "--dry-run")
    assert "Traceback" not in err and code == want
    lines = [ln for ln in err.splitlines() if ln.startswith("kiln")]
    assert len(lines) == 1 and str(bad) in lines[0] and names in lines[0], err
    assert msg(f"{want}.hint") in err  # the way out: fetch it again


@pytest.mark.parametrize("damage", ["header length", "offsets", "not json"])
def test_a_corrupt_safetensors_file_is_one_line_naming_it(
        tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]) -> None:
    from conftest import add_word_tokenizer, make_tiny_model

    folder = make_tiny_model("llama", tmp_path / "tiny")
    add_word_tokenizer(folder)
    st = folder / "model.safetensors"
    raw = st.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    if damage == "header length":
        raw = struct.pack("<Q", 1 << 40) + raw[8:]
    elif damage == "offsets":  # a header that lies: a tensor's bytes run past the file
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"][1] += 1 << 30
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        raw = struct.pack("<Q", len(h)) + h + raw[8 + n:]
    else:
        raw = raw[:8] + b"{" * n + raw[8 + n:]
    st.write_bytes(raw)
    code, err = _failed(tmp_path, capsys, "run", str(folder), "hello", "--max-tokens", "1",
                        "--no-compile")
    assert "Traceback" not in err and code == "load.bad_safetensors"
    lines = [ln for ln in err.splitlines() if ln.startswith("kiln")]
    assert len(lines) == 1 and str(st) in lines[0], err
    assert "kiln pull" in err  # the hint's way out: fetch it again
