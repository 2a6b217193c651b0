"""benchmarks/soak.py in miniature, so the script does not rot: a few clients for a few seconds
against a real `kiln serve`, with disconnects; every completed greedy answer equals the same
request alone, no KV block leaks, the integrity check holds after each phase."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.heavy]


def test_a_short_soak_passes(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--clients", "6",
         "--duration", "6", "--phases", "2", "--pool", "8", "--max-prompt-words", "80",
         "--max-tokens", "12", "--disconnect-rate", "0.3", "--drain-timeout", "120",
         "--out", str(out), "--", "--max-model-len", "512"],
        capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(out.read_text())
    assert r["ok"] and r["completed_greedy"] > 0 and r["compared_with_solo"] > 0
    assert r["mismatches"] == 0 and r["leaked_blocks"] == 0 and not r["errors"]
    assert [ph["kv"]["integrity"] for ph in r["phases"]] == ["ok"] * 3  # 2 phases + solo
    assert r["rss_mib"]["start"] > 0 and r["rss_mib"]["end"] > 0
    assert "0 mismatches" in p.stdout
