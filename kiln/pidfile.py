"""Pid files of running kiln servers: `<runtime_dir>/<port>.pid` (kiln/paths.py), one JSON object
each, written once the server answers and removed when it exits (also on SIGTERM / Ctrl-C, which
end `kiln serve` through its drain). `kiln ps` and `kiln stop` read them; a file whose process
is gone (killed, crashed) is stale: ignored and deleted by whoever reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kiln.paths import runtime_dir


@dataclass
class ServerRecord:
    pid: int
    port: int
    host: str
    model: str  # the primary served name
    weights: str = ""  # what was loaded (file or folder)
    engine: str = "kiln"
    version: str = ""
    started_at: float = field(default_factory=time.time)  # epoch seconds

    @property
    def url(self) -> str:
        """Where to reach it from this machine (a wildcard bind answers on loopback)."""
        host = "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"


def path_for(port: int) -> Path:
    return runtime_dir() / f"{port}.pid"


def write(record: ServerRecord) -> Path:
    """Writes the record atomically (a reader never sees half a file); the folder is private."""
    path = path_for(record.port)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(f".{record.pid}.tmp")
    tmp.write_text(json.dumps(asdict(record)) + "\n")
    tmp.replace(path)
    return path


def remove(record: ServerRecord) -> None:
    """Removes the record's file if it is still this process's (a later server on the same
    port owns it otherwise)."""
    path = path_for(record.port)
    current = _read(path)
    if current is not None and current.pid == record.pid:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def registered(record: ServerRecord) -> Iterator[Path]:
    """The pid file for as long as the block runs."""
    path = write(record)
    try:
        yield path
    finally:
        remove(record)


def running() -> list[ServerRecord]:
    """Servers whose pid file names a live kiln process, by port; stale files are deleted."""
    folder = runtime_dir()
    out: list[ServerRecord] = []
    for path in sorted(folder.glob("*.pid")) if folder.is_dir() else []:
        rec = _read(path)
        if rec is None or not is_alive(rec.pid):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            continue
        out.append(rec)
    return sorted(out, key=lambda r: r.port)


def is_alive(pid: int) -> bool:
    """Whether `pid` runs and is a kiln process. A zombie (exited, not yet reaped by its
    parent) is dead; a pid reused by another program is not ours."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: alive, judged by its command line below
    proc = Path(f"/proc/{pid}")
    try:
        stat = (proc / "stat").read_text()
        if stat[stat.rindex(")") + 2:].startswith("Z"):
            return False
        return b"kiln" in (proc / "cmdline").read_bytes()
    except (OSError, ValueError):
        return True  # no /proc (macOS): the signal check is all there is


def _read(path: Path) -> ServerRecord | None:
    try:
        data = json.loads(path.read_text())
        return ServerRecord(**{k: v for k, v in data.items()
                               if k in ServerRecord.__dataclass_fields__})
    except (OSError, ValueError, TypeError):
        return None
