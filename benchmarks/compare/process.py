"""A peer's server process: start it in its own session, wait until it answers, sample the
memory of its whole process tree, stop it and everything it forked."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.compare.common import HOST, REPO, PeerError, tail
from benchmarks.compare.peers import Launch
from kiln.resolve.hardware import rss_bytes


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _proc_tree(root: int) -> list[int]:
    """root and all its descendants, from /proc (no psutil needed)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out



class RssSampler:
    """Peak resident memory of a process tree, sampled every `interval` seconds."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        self.pid = pid
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, sum(rss_bytes(p) for p in _proc_tree(self.pid)))
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:  # noqa: PYI034 - final class
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def wait_ready(proc: subprocess.Popen[bytes], base: str, timeout: float, logfile: Path) -> str:
    """Poll until the server lists a model and answers a 1-token completion; its model id."""
    import httpx

    deadline = time.monotonic() + timeout
    model: str | None = None
    with httpx.Client(timeout=30.0) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise PeerError(f"exited with {proc.returncode} while starting: {tail(logfile, 4)}")
            try:
                if model is None:
                    r = http.get(f"{base}/models")
                    if r.status_code == 200 and r.json().get("data"):
                        model = str(r.json()["data"][0]["id"])
                if model is not None:
                    r = http.post(
                        f"{base}/completions",
                        json={"model": model, "prompt": "Hello", "max_tokens": 1},
                    )
                    if r.status_code == 200:
                        return model
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.25)
    raise PeerError(f"not healthy after {timeout:.0f} s: {tail(logfile, 4)}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the whole process group, then SIGKILL what is left after 20 s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextlib.contextmanager
def started(launch: Launch, logfile: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(logfile, "w") as f:
        f.write(f"$ {' '.join(launch.cmd)}\n")
        f.flush()
        # A session of its own, so stop() reaches every worker the peer forks.
        proc = subprocess.Popen(
            launch.cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, **launch.env},
            start_new_session=True,
            cwd=REPO,
        )
    try:
        yield proc
    finally:
        stop(proc)
