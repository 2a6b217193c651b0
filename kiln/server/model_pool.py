"""The models a router serves (`kiln serve --models`): one `kiln serve` process per loaded model.

Each model runs in its own process on a loopback port, so unloading one gives back all of its
memory (weights, KV pool, compiled kernels, allocator caches) the moment the process exits,
and a model that fails to load takes nothing else down. The pool decides when:

    first request naming a model -> load (spawn, wait for /health; others asking wait too)
    request done                 -> idle; unloaded keep_alive seconds later (Ollama's rule)
    a load that does not fit     -> idle models unloaded, least recently used first, until it
                                    fits in --models-memory / the memory the machine has, and
                                    within --max-loaded-models

Each child gets its settings through a config file of its own: the router's settings (CLI,
KILN_* environment, config file), less the router's own (config.ROUTER_SETTINGS), then the
model's `[models.NAME]` entry on top. So a per-model setting beats a router-wide one, which a
KILN_* variable of the router's environment could not (env outranks a config file).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import tomli_w

from kiln.resolve.hardware import ram_available_bytes, rss_bytes
from kiln.settings.table import BY_NAME, ROUTER_SETTINGS, SETTINGS

log = logging.getLogger("kiln.router")

GIB = 1 << 30
# A model's first load is judged by its weights' size; what a process adds beyond them
# (PyTorch, the KV pool, activations) is guessed here, then measured once it has run.
PROCESS_OVERHEAD = 400 << 20
MEMORY_RESERVE = 1 * GIB  # left to the rest of the machine when no --models-memory is set


@dataclass
class Child:
    """A model's process while it is loading or loaded."""

    name: str
    port: int
    proc: asyncio.subprocess.Process
    log_path: Path
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    error: str | None = None  # why it failed to load (then it is gone)
    inflight: int = 0
    last_used: float = field(default_factory=time.monotonic)
    keep_alive: float = 300.0  # seconds idle before unloading; < 0: forever
    started: float = field(default_factory=time.time)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def expired(self, now: float) -> bool:
        return (self.ready.is_set() and self.inflight == 0 and self.keep_alive >= 0
                and now - self.last_used >= self.keep_alive)


class ModelUnavailable(Exception):
    """A model could not be made ready: `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ModelPool:
    def __init__(self, entries: list[dict[str, Any]], child_settings: dict[str, Any], *,
                 keep_alive: float, max_loaded: int | None, memory_budget: int | None,
                 load_timeout: float, workdir: Path) -> None:
        self.entries = {e["name"]: e for e in entries}
        self.child_settings = child_settings
        self.keep_alive = keep_alive
        self.max_loaded = max_loaded
        self.memory_budget = memory_budget
        self.load_timeout = load_timeout
        self.workdir = workdir
        self.children: dict[str, Child] = {}
        self.measured: dict[str, int] = {}  # name -> RSS seen when it last ran
        self.loads = 0
        self.unloads = 0
        self._lock = asyncio.Lock()  # one load decision at a time

    # ------------------------------------------------------------------ requests

    async def acquire(self, name: str, keep_alive: float | None = None) -> Child:
        """The model's ready process, loading it if needed; counted in flight until
        `release`. Waits at most --model-load-timeout for a load (its own or another's)."""
        if name not in self.entries:
            raise ModelUnavailable(404, f"The model {name!r} does not exist; this server serves "
                                        f"{', '.join(self.entries)} (GET /v1/models)")
        async with self._lock:
            child = self.children.get(name)
            if child is None:
                child = await self._start(name)
            child.inflight += 1
        child.last_used = time.monotonic()
        if keep_alive is not None:
            child.keep_alive = keep_alive
        try:
            await asyncio.wait_for(child.ready.wait(), self.load_timeout)
        except TimeoutError:
            child.inflight -= 1
            raise ModelUnavailable(503, f"model {name!r} is still loading after "
                                        f"{self.load_timeout:.0f} s (--model-load-timeout); "
                                        "retry later") from None
        if child.error is not None:
            child.inflight -= 1
            raise ModelUnavailable(503, f"model {name!r} failed to load: {child.error}")
        return child

    def release(self, child: Child) -> None:
        child.inflight -= 1
        child.last_used = time.monotonic()
        if child.keep_alive == 0 and child.inflight == 0:
            asyncio.get_running_loop().create_task(self._unload_if_idle(child))

    # ------------------------------------------------------------------ loading

    async def _start(self, name: str) -> Child:
        """Spawns the model's process (under the lock), making room first."""
        await self._make_room(name)
        entry = self.entries[name]
        port = free_port()
        config = self.workdir / f"{name_for_file(name)}.toml"
        settings = {**self.child_settings, **entry["settings"]}
        config.write_text(tomli_w.dumps(_toml_safe(settings)))
        log_path = self.workdir / f"{name_for_file(name)}.log"
        cmd = [sys.executable, "-m", "kiln", "serve", entry["model"], "--config", str(config),
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name]
        # The router's KILN_* settings are in the child's config file already; left in the
        # environment they would outrank the model's own entry.
        env = {k: v for k, v in os.environ.items() if k not in _SETTING_ENV and k != "KILN_CONFIG"}
        env["PYTHONUNBUFFERED"] = "1"
        with log_path.open("ab") as out:
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdout=out, stderr=asyncio.subprocess.STDOUT, env=env,
                start_new_session=True)  # a Ctrl-C at the router's terminal is the router's
        child = Child(name, port, proc, log_path, keep_alive=self.keep_alive)
        self.children[name] = child
        self.loads += 1
        log.info("loading %s (%s) as pid %d on port %d", name, entry["model"], proc.pid, port)
        asyncio.get_running_loop().create_task(self._watch_load(child))
        return child

    async def _watch_load(self, child: Child) -> None:
        """Marks the child ready when /health answers, or failed when it exits first."""
        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=2.0) as http:
            while child.proc.returncode is None:
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{child.url}/health")).status_code == 200:
                        self.measured[child.name] = child.rss()
                        log.info("%s ready in %.1f s (%.0f MiB)", child.name,
                                 time.monotonic() - t0, self.measured[child.name] / 2**20)
                        child.ready.set()
                        return
                await asyncio.sleep(0.25)
        child.error = last_error_line(child.log_path) or f"exited with {child.proc.returncode}"
        log.error("%s failed to load: %s", child.name, child.error)
        self.children.pop(child.name, None)
        child.ready.set()

    def estimate(self, name: str) -> int:
        """Memory a load of `name` will take: its last measured RSS, else its weights' size
        plus a process's overhead (a model not on disk yet counts as 1 GiB of weights)."""
        if name in self.measured:
            return self.measured[name]
        path = Path(os.path.expanduser(self.entries[name]["model"]))
        size = (sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir()
                else path.stat().st_size if path.is_file() else GIB)
        return size + PROCESS_OVERHEAD

    def _fits(self, name: str) -> bool:
        loaded = [c for c in self.children.values() if c.error is None]
        if self.max_loaded is not None and len(loaded) >= self.max_loaded:
            return False
        need = self.estimate(name)
        if self.memory_budget is not None:
            return sum(c.rss() for c in loaded) + need <= self.memory_budget
        available = ram_available_bytes()
        return available is None or need <= available - MEMORY_RESERVE

    async def _make_room(self, name: str) -> None:
        """Unloads idle models, least recently used first, until `name` fits. A model that
        does not fit beside the busy ones still loads (refusing would leave the request
        nowhere to go); the machine's own limits then decide."""
        while not self._fits(name):
            idle = sorted((c for c in self.children.values()
                           if c.inflight == 0 and c.ready.is_set()), key=lambda c: c.last_used)
            if not idle:
                log.warning("loading %s beside %d busy model(s): no idle one to unload", name,
                            len(self.children))
                return
            await self._unload(idle[0], "to make room for " + name)

    # ------------------------------------------------------------------ unloading

    async def _unload_if_idle(self, child: Child) -> None:
        async with self._lock:
            if self.children.get(child.name) is child and child.inflight == 0:
                await self._unload(child, "keep_alive 0")

    async def _unload(self, child: Child, why: str) -> None:
        self.children.pop(child.name, None)
        self.unloads += 1
        log.info("unloading %s (%s)", child.name, why)
        await stop_process(child.proc)

    async def reap(self) -> None:
        """Forever: unloads models idle past their keep_alive (run as a task)."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            async with self._lock:
                for child in [c for c in self.children.values() if c.expired(now)]:
                    await self._unload(child, f"idle for {child.keep_alive:.0f} s")

    async def preload(self) -> None:
        for name in self.entries:
            child = await self.acquire(name)
            self.release(child)

    async def close(self) -> None:
        children = list(self.children.values())
        self.children.clear()
        await asyncio.gather(*(stop_process(c.proc) for c in children))

    def status(self) -> list[dict[str, Any]]:
        """Each model as /v1/models and `kiln ps` show it."""
        out = []
        for name, entry in self.entries.items():
            c = self.children.get(name)
            state = ("unloaded" if c is None else "loading" if not c.ready.is_set()
                     else "loaded")
            out.append({"id": name, "model": entry["model"], "state": state,
                        "pid": c.proc.pid if c else None, "port": c.port if c else None,
                        "memory_bytes": c.rss() if c and state == "loaded" else None,
                        "requests_in_flight": c.inflight if c else 0,
                        "keep_alive_s": c.keep_alive if c else self.keep_alive})
        return out


_SETTING_ENV = frozenset(s.env_var for s in SETTINGS)


def child_settings(resolved: Any) -> dict[str, Any]:
    """The router's settings that a person set (CLI, environment, config file), less the
    router's own: what every model's process inherits."""
    out = {}
    for s in SETTINGS:
        if s.name in ROUTER_SETTINGS or resolved.source(s.name) not in ("cli", "env", "file"):
            continue
        out[s.name] = resolved[s.name]
    return out


def _toml_safe(settings: dict[str, Any]) -> dict[str, Any]:
    """TOML has no null; tuples become lists. Keys stay setting names (the config file's)."""
    out: dict[str, Any] = {}
    for k, v in settings.items():
        if v is None or k not in BY_NAME:
            continue
        out[k] = list(v) if isinstance(v, tuple) else v
    return out


def name_for_file(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_error_line(log_path: Path) -> str:
    """The last line of a failed child's log that says something (kiln's one-line errors)."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    errors = [ln for ln in lines if ln.startswith(("kiln: error", "kiln: unexpected error",
                                                   "ERROR"))]
    return (errors or [ln for ln in lines if ln] or [""])[-1][:500]


async def stop_process(proc: asyncio.subprocess.Process, grace: float = 30.0) -> None:
    """SIGTERM (kiln serve drains its requests), then SIGKILL after `grace` seconds."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), grace)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
