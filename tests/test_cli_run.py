"""`kiln run MODEL PROMPT` answers in the terminal (one-shot, streamed to stdout)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_kiln_run_one_shot_answers():
    r = subprocess.run(
        [sys.executable, "-m", "kiln", "run", "smollm2", "--temperature", "0", "--system",
         "You are a helpful assistant.", "--kv-cache-memory", "64MiB",
         "What is the capital of France?"],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout
