"""Paths, the peers' host, the one error type and the log line shared by the compare modules."""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PEERS_DIR = REPO / "benchmarks" / ".peers"
RESULTS_DIR = REPO / "benchmarks" / "results"
MAIN_VENV = REPO / ".venv"
MAIN_VENV_PY = MAIN_VENV / "bin" / "python"
HOST = "127.0.0.1"


class PeerError(Exception):
    """A peer could not be installed or started; the message says which step and why."""


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def tail(path: Path, n: int) -> str:
    """The last `n` meaningful lines of a log, joined on one line for a status message."""
    try:
        text = path.read_text(errors="replace")
        # Skip blank lines and Python's ^^^^ traceback markers: the tail should say something.
        lines = [ln for ln in text.splitlines() if ln.strip(" ^~\t")]
    except OSError:
        return ""
    return " | ".join(ln.strip()[:200] for ln in lines[-n:])
