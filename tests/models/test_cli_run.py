"""`kiln run MODEL PROMPT` answers in the terminal (one-shot, streamed to stdout)."""

from __future__ import annotations

import subprocess
import sys

import pytest


# The question is one whose greedy answer is not a near-tie. "What is the capital of France?"
# was: SmolLM2 Q4_1's first token is "The" / "La" / "Le" within 0.1-0.3 nat on every path
# (fp32 weights: 24.144 / 24.049 / 23.731), and int4's int8 activation rounding turns any
# 1e-6 difference in attention or the head into ~0.5 nat of logit noise, so a correct kernel
# change could flip it to "La femme de France, ..." (issue #26). This wording's answer, "The
# capital of France is Paris.", leads by 1.6 nat or more at every token up to "Paris".
@pytest.mark.slow
def test_kiln_run_one_shot_answers():
    r = subprocess.run(
        [sys.executable, "-m", "kiln", "run", "smollm2", "--temperature", "0", "--system",
         "You are a helpful assistant.", "--kv-cache-memory", "64MiB",
         "Name the capital of France."],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout
