"""Running an external engine: which engine `--engine auto` picks, the "server running" block
(kiln's own server prints the same), and launch(): the child in its own process group, output
streamed with a `[vllm] ` prefix, SIGINT/SIGTERM forwarded, /health awaited."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from kiln.backends.table import LaunchPlan, get_backend
from kiln.errors import EngineNotFoundError
from kiln.i18n import msg


def choose_engine(requested: str, tp: int, pp: int, nnodes: int,
                  vllm_available: bool) -> tuple[str, str, str]:
    """`--engine auto`: kiln's own engine runs one device; more than one GPU (TP x PP > 1) or
    more than one node goes to vLLM when it is installed. Returns (engine, reason, code), the
    code `engine.<why>` as the settings table's decisions have one."""
    if requested != "auto":
        return requested, f"--engine {requested}", "engine.asked"
    gpus = max(1, tp) * max(1, pp)
    if nnodes > 1:
        if vllm_available:
            return "vllm", (f"{nnodes} nodes: kiln's own engine runs on one machine, so auto "
                            f"hands the model to vLLM (Ray)"), "engine.nodes_to_vllm"
        raise EngineNotFoundError(
            msg("engine.nodes_need_vllm", nnodes=nnodes), hint=msg("engine.nodes_need_vllm.hint"),
        )
    if gpus > 1:
        if vllm_available:
            return "vllm", (f"tensor parallel {tp} x pipeline parallel {pp} needs {gpus} GPUs: "
                            f"kiln's own engine runs on one device, so auto hands off to vLLM"
                            ), "engine.gpus_to_vllm"
        return "kiln", (f"tensor parallel {tp} x pipeline parallel {pp} would need vLLM, which "
                        f"is not installed (pip install vllm); kiln's own engine uses one "
                        f"device"), "engine.gpus_without_vllm"
    return "kiln", "one device: kiln's own engine", "engine.one_device"


# --------------------------------------------------------------------------- running block


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "", "*"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def format_running_block(model_name: str, engine: str, host: str, port: int,
                         extra: Mapping[str, Any] | None = None,
                         routes: list[str] | None = None) -> str:
    """The block printed once the server answers; kiln's native server prints the same.
    `routes`: "METHOD /path" of what the model serves (default: the generating ones)."""
    base = f"http://{_url_host(host)}:{port}"
    rows: list[tuple[str, str]] = [("model", model_name), ("engine", engine)]
    if host in ("0.0.0.0", "::", "", "*"):
        rows.append(("listening", f"{host or '0.0.0.0'}:{port} (all interfaces)"))
    rows += [(str(k), str(v)) for k, v in (extra or {}).items()]
    width = max(len(k) for k, _ in rows + [("endpoints", "")])
    lines = ["kiln: server running"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    routes = routes or ["POST /v1/chat/completions", "POST /v1/completions"]
    endpoints = [f"{base}/v1", *(f"{r.split()[0].ljust(4)} {base}{r.split()[1]}"
                                 for r in routes),
                 f"GET  {base}/v1/models", f"GET  {base}/health"]
    lines.append(f"  {'endpoints'.ljust(width)}  {endpoints[0]}")
    lines += [f"  {''.ljust(width)}  {e}" for e in endpoints[1:]]
    lines.append(msg("launch.press_ctrl_c"))
    return "\n".join(lines)


# --------------------------------------------------------------------------- launch


def _healthy(base: str, api_key: str | None) -> bool:
    # No proxies: an http_proxy in the environment must not swallow a loopback probe.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for path in ("/health", "/v1/models"):
        try:
            with opener.open(urllib.request.Request(base + path, headers=headers),
                             timeout=2) as r:
                if 200 <= r.status < 300:
                    return True
        except urllib.error.HTTPError:
            continue  # 404: try the next path; 503: loading
        except (urllib.error.URLError, OSError, ValueError):
            return False  # not listening yet
    return False


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # killed by signal N -> 128+N, as a shell reports it


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def launch(
    plan: LaunchPlan,
    *,
    host: str | None = None,
    port: int | None = None,
    health_timeout_s: float = 1800.0,
    drain_timeout_s: float = 30.0,
    print_fn: Callable[[str], None] = print,
    extra: Mapping[str, Any] | None = None,
    poll_s: float = 0.25,
    on_ready: Callable[[], None] | None = None,
) -> int:
    """Runs the engine and returns its exit code.

    The child gets its own process group, so a terminal's Ctrl-C reaches kiln alone and kiln
    decides: the first SIGINT/SIGTERM is forwarded to the whole group and the child has
    `drain_timeout_s` to finish in-flight requests; a second signal, or the drain running
    out, kills the group. If the child exits before it is healthy, its last output lines are
    printed and its code returned. If it never becomes healthy, it is stopped and 1 returned.
    `on_ready` runs once the engine is healthy (kiln serve writes its pid file then).
    """
    host = host or plan.host
    port = port or plan.port
    tag = f"[{plan.engine}] "
    last: deque[str] = deque(maxlen=40)
    # Unbuffered: the engine's prints must reach the terminal as they happen, not per 8 KiB.
    env = {"PYTHONUNBUFFERED": "1", **os.environ, **plan.env}
    try:
        proc = subprocess.Popen(plan.argv, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, text=True, errors="replace", bufsize=1)
    except OSError as e:
        backend = get_backend(plan.engine)
        raise EngineNotFoundError(msg("engine.cannot_start", command=plan.argv[0], error=e),
                                  hint=msg("engine.install", engine=backend.label,
                                           install=backend.install_hint)) from None
    pgid = proc.pid

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            last.append(line)
            print_fn(tag + line)

    reader = threading.Thread(target=pump, name=f"{plan.engine}-output", daemon=True)
    reader.start()

    state: dict[str, Any] = {"signals": 0, "kill_at": None, "note": None}

    def on_signal(signum: int, _frame: Any) -> None:
        # Only forwarding here; printing from a handler can re-enter a print the main thread
        # was in the middle of, so the loop below reports it.
        state["signals"] += 1
        if state["signals"] == 1:
            _signal_group(pgid, signum)
            state["kill_at"] = time.monotonic() + drain_timeout_s
            state["note"] = signum
        else:
            _signal_group(pgid, signal.SIGKILL)

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)

    base = f"http://{_url_host(host)}:{port}"
    deadline = time.monotonic() + health_timeout_s
    healthy = False
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if state["note"] is not None:
                print_fn(msg("launch.stopping", signal=signal.Signals(state["note"]).name,
                             engine=plan.engine, drain=f"{drain_timeout_s:g}"))
                state["note"] = None
            kill_at = state["kill_at"]
            if kill_at is not None and now > kill_at:
                print_fn(msg("launch.killing", engine=plan.engine,
                             drain=f"{drain_timeout_s:g}"))
                _signal_group(pgid, signal.SIGKILL)
                state["kill_at"] = None
            if not healthy and state["signals"] == 0:
                if _healthy(base, plan.api_key):
                    healthy = True
                    print_fn(format_running_block(plan.model_name, plan.engine, host, port,
                                                  extra))
                    if on_ready is not None:
                        on_ready()
                elif now > deadline:
                    print_fn(msg("launch.no_health", engine=plan.engine, base=base,
                                 timeout=f"{health_timeout_s:g}"))
                    _signal_group(pgid, signal.SIGTERM)
                    _wait(proc, drain_timeout_s, pgid)
                    reader.join(timeout=5)
                    return 1
            try:
                proc.wait(timeout=poll_s)
            except subprocess.TimeoutExpired:
                pass
        reader.join(timeout=5)
        code = _exit_code(proc.returncode)
        if not healthy and state["signals"] == 0:
            tail = "\n".join(f"  {line}" for line in list(last)[-20:])
            print_fn(msg("launch.exited_early", engine=plan.engine, code=code)
                     + (msg("launch.last_output", tail=tail) if tail else ""))
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            _signal_group(pgid, signal.SIGTERM)
            _wait(proc, drain_timeout_s, pgid)
        # Workers the engine spawned share its group; none may outlive kiln.
        _signal_group(pgid, signal.SIGKILL)


def _wait(proc: subprocess.Popen[str], timeout_s: float, pgid: int) -> None:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _signal_group(pgid, signal.SIGKILL)
        proc.wait()
