"""Soak: many clients against one `kiln serve` for a while, then every greedy answer checked
against the same request run alone. Loopback only; stops by itself.

    .venv/bin/python benchmarks/soak.py                          # 64 clients, 10 minutes
    .venv/bin/python benchmarks/soak.py --clients 8 --duration 20 --phases 2 --pool 12
    .venv/bin/python benchmarks/soak.py -- --max-num-seqs 16      # flags after -- go to serve

It starts `kiln serve` (the embedded SmolLM2 unless --model) on a free 127.0.0.1 port. Each
client loops until its phase ends: it picks one of `--pool` distinct requests (chat or
completions, random prompt length, random max_tokens, streamed or not; greedy, with logprobs),
and with probability `--disconnect-rate` it hangs up at a random point (before any answer, or
after a few streamed chunks). Requests still running `--drain-timeout` seconds after a phase's
end are cut too (counted apart), so the script ends in bounded time however slow the machine.
About one request in ten is sampled (n=2, temperature 1), so the engine also runs several
sequences of one request; those are not compared.

Between phases the clients stop, the server goes idle, and GET /debug/kv must show the KV
manager's invariants intact and 0 leaked blocks. The server's RSS is sampled every few seconds.
At the end each distinct greedy request that completed is sent again alone, and every completed
answer of it must equal that solo answer: the same text, tokens, logprobs and finish reason
(kiln's batch invariance). Writes benchmarks/results/soak-<time>.json and prints a summary; the
exit status is 1 when an answer differs, a block leaked, the integrity check failed, or the
server answered 5xx.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
API_KEY = "sk-soak"
RSS_EVERY_S = 5.0


@dataclass
class Spec:
    """One distinct request of the pool."""

    key: int
    endpoint: str  # "chat" | "completions"
    stream: bool
    words: int
    max_tokens: int
    body: dict[str, Any]
    greedy: bool = True


@dataclass
class Answer:
    """What a completed greedy request gave: compared with the solo run."""

    text: str
    tokens: list[str]
    logprobs: list[float]
    finish_reason: str | None


@dataclass
class Stats:
    started: int = 0
    completed: int = 0
    completed_sampled: int = 0
    disconnects: Counter = field(default_factory=Counter)  # by where the client hung up
    errors: Counter = field(default_factory=Counter)  # by kind
    ttft_s: list[float] = field(default_factory=list)  # streamed, completed
    latency_s: list[float] = field(default_factory=list)  # completed
    completion_tokens: int = 0
    answers: dict[int, list[Answer]] = field(default_factory=dict)  # pool key -> answers


# ------------------------------------------------------------------------------- the pool


def make_pool(rng: random.Random, size: int, max_prompt_words: int, max_tokens: int
              ) -> list[Spec]:
    from kiln.bench.workloads import WORDS

    pool: list[Spec] = []
    for key in range(size):
        endpoint = rng.choice(("chat", "completions"))
        stream = rng.random() < 0.5
        words = int(rng.triangular(4, max_prompt_words, max_prompt_words / 6))
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        mt = rng.randint(1, max_tokens)
        greedy = rng.random() >= 0.1
        body: dict[str, Any] = {"max_tokens": mt, "stream": stream}
        if greedy:
            body["temperature"] = 0
        else:
            body.update(temperature=1.0, n=2)
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": f"Continue this: {text}"}]
            if greedy:
                body.update(logprobs=True, top_logprobs=1)
        else:
            body["prompt"] = text
            if greedy:
                body["logprobs"] = 1
        if stream:
            body["stream_options"] = {"include_usage": True}
        pool.append(Spec(key, endpoint, stream, words, mt, body, greedy))
    return pool


def _path(spec: Spec) -> str:
    return "/v1/chat/completions" if spec.endpoint == "chat" else "/v1/completions"


def _answer_from_json(spec: Spec, data: dict[str, Any]) -> Answer:
    choice = data["choices"][0]
    if spec.endpoint == "chat":
        lp = (choice.get("logprobs") or {}).get("content") or []
        return Answer(choice["message"]["content"] or "", [t["token"] for t in lp],
                      [t["logprob"] for t in lp], choice["finish_reason"])
    lp = choice.get("logprobs") or {}
    return Answer(choice["text"], list(lp.get("tokens") or []),
                  list(lp.get("token_logprobs") or []), choice["finish_reason"])


class _StreamAnswer:
    """Assembles a streamed choice 0 into an Answer."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.answer = Answer("", [], [], None)
        self.tokens = 0

    def add(self, chunk: dict[str, Any]) -> bool:
        """True when the chunk carried output."""
        if chunk.get("usage"):
            self.tokens = chunk["usage"]["completion_tokens"]
        got = False
        for choice in chunk.get("choices") or []:
            if choice["index"] != 0:
                continue
            a = self.answer
            if self.spec.endpoint == "chat":
                a.text += (choice.get("delta") or {}).get("content") or ""
                for t in ((choice.get("logprobs") or {}).get("content") or []):
                    a.tokens.append(t["token"])
                    a.logprobs.append(t["logprob"])
            else:
                a.text += choice.get("text") or ""
                lp = choice.get("logprobs") or {}
                a.tokens += lp.get("tokens") or []
                a.logprobs += lp.get("token_logprobs") or []
            if choice.get("finish_reason"):
                a.finish_reason = choice["finish_reason"]
            got = got or bool(a.text or a.tokens)
        return got


# ------------------------------------------------------------------------------- clients


async def one_request(http: httpx.AsyncClient, spec: Spec, rng: random.Random, stats: Stats,
                      disconnect_rate: float) -> None:
    stats.started += 1
    hang_up = rng.random() < disconnect_rate
    # Where: before any answer (a random moment), or after a few streamed chunks.
    mid_stream = hang_up and spec.stream and rng.random() < 0.6
    cut_after = rng.randint(1, 6) if mid_stream else None
    t0 = time.monotonic()

    async def run() -> Answer | None:
        if not spec.stream:
            r = await http.post(_path(spec), json=spec.body)
            if r.status_code != 200:
                stats.errors[f"http_{r.status_code}"] += 1
                return None
            data = r.json()
            stats.completion_tokens += data["usage"]["completion_tokens"]
            return _answer_from_json(spec, data)
        sa = _StreamAnswer(spec)
        chunks = 0
        first: float | None = None
        async with http.stream("POST", _path(spec), json=spec.body) as r:
            if r.status_code != 200:
                await r.aread()
                stats.errors[f"http_{r.status_code}"] += 1
                return None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    if first is not None:
                        stats.ttft_s.append(first)
                    stats.completion_tokens += sa.tokens
                    return sa.answer
                chunk = json.loads(payload)
                if "error" in chunk:
                    stats.errors[f"stream_error_{chunk['error'].get('code')}"] += 1
                    return None
                if sa.add(chunk) and first is None:
                    first = time.monotonic() - t0
                chunks += 1
                if cut_after is not None and chunks >= cut_after:
                    stats.disconnects["mid_stream"] += 1
                    return None  # leaving the block closes the connection
        stats.errors["stream_ended_without_done"] += 1
        return None

    try:
        if hang_up and not mid_stream:
            try:
                answer = await asyncio.wait_for(run(), timeout=rng.uniform(0.05, 3.0))
            except asyncio.TimeoutError:
                stats.disconnects["before_answer"] += 1
                return
        else:
            answer = await run()
    except httpx.HTTPError as e:
        stats.errors[type(e).__name__] += 1
        return
    if answer is None:
        return
    stats.latency_s.append(time.monotonic() - t0)
    if spec.greedy:
        stats.completed += 1
        stats.answers.setdefault(spec.key, []).append(answer)
    else:
        stats.completed_sampled += 1


async def client_loop(i: int, http: httpx.AsyncClient, pool: list[Spec], seed: int,
                      deadline: float, stats: Stats, disconnect_rate: float) -> None:
    rng = random.Random(f"{seed}:{i}:{deadline}")
    while time.monotonic() < deadline:
        await one_request(http, rng.choice(pool), rng, stats, disconnect_rate)


# ------------------------------------------------------------------------------- the server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, workdir: Path) -> tuple[subprocess.Popen, str, Path]:
    port = _free_port()
    eff = workdir / "effective-config.json"
    cmd = [sys.executable, "-m", "kiln", "serve", *([args.model] if args.model else []),
           "--host", "127.0.0.1", "--port", str(port), "--api-key", API_KEY,
           "--effective-config-json", str(eff), *args.serve_args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = (workdir / "server.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"kiln serve exited with {proc.returncode}:\n"
                             f"{(workdir / 'server.log').read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, eff
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("kiln serve did not become healthy in time")
        time.sleep(0.5)


def rss_mib(pid: int) -> float:
    from kiln.resolve.hardware import rss_bytes

    return rss_bytes(pid) / 2**20


async def wait_idle_kv(http: httpx.AsyncClient, timeout: float = 300.0) -> dict[str, Any]:
    """/debug/kv once the engine has nothing left (disconnected requests aborted)."""
    deadline = time.monotonic() + timeout
    while True:
        kv = (await http.get("/debug/kv")).json()
        health = (await http.get("/health")).json()
        if kv["idle"] and not health.get("num_inflight"):
            return kv
        if time.monotonic() > deadline:
            return {**kv, "timeout": True}
        await asyncio.sleep(0.25)


async def sample_rss(pid: int, t0: float, series: list[tuple[float, float]],
                     stop: asyncio.Event) -> None:
    while not stop.is_set():
        series.append((round(time.monotonic() - t0, 1), round(rss_mib(pid), 1)))
        try:
            await asyncio.wait_for(stop.wait(), RSS_EVERY_S)
        except asyncio.TimeoutError:
            pass


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[min(98, max(0, int(q) - 1))]


async def soak(args: argparse.Namespace, url: str, pid: int) -> dict[str, Any]:
    rng = random.Random(args.seed)
    pool = make_pool(rng, args.pool, args.max_prompt_words, args.max_tokens)
    stats = Stats()
    phases: list[dict[str, Any]] = []
    rss: list[tuple[float, float]] = []
    limits = httpx.Limits(max_connections=args.clients * 2 + 8)
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits,
                                 headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_rss(pid, t0, rss, stop))
        rss_start = rss_mib(pid)
        per_phase = args.duration / args.phases
        for p in range(args.phases):
            deadline = time.monotonic() + per_phase
            before = (stats.started, stats.completed, sum(stats.disconnects.values()))
            tasks = [asyncio.create_task(client_loop(i, http, pool, args.seed + p, deadline,
                                                     stats, args.disconnect_rate))
                     for i in range(args.clients)]
            # The phase ends at its deadline; requests still running get --drain-timeout more
            # seconds, then are cut (the script stays bounded however slow the machine is).
            _, late = await asyncio.wait(tasks, timeout=per_phase + args.drain_timeout)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            stats.disconnects["cut_at_phase_end"] += len(late)
            kv = await wait_idle_kv(http)
            phases.append({"phase": p + 1, "ended_s": round(time.monotonic() - t0, 1),
                           "requests": stats.started - before[0],
                           "completed_greedy": stats.completed - before[1],
                           "disconnects": sum(stats.disconnects.values()) - before[2],
                           "rss_mib": round(rss_mib(pid), 1), "kv": kv})
            print(f"phase {p + 1}/{args.phases}: {phases[-1]['requests']} requests, "
                  f"kv {kv['integrity']}, leaked {kv['leaked_blocks']}, "
                  f"rss {phases[-1]['rss_mib']} MiB", flush=True)
        soak_s = time.monotonic() - t0
        # Each distinct greedy request that completed, alone, once; every answer must match.
        mismatches: list[dict[str, Any]] = []
        compared = 0
        solo_t0 = time.monotonic()
        for key in sorted(stats.answers):
            spec = pool[key]
            body = {**spec.body, "stream": False}
            body.pop("stream_options", None)
            r = await http.post(_path(spec), json=body)
            if r.status_code != 200:
                stats.errors[f"solo_http_{r.status_code}"] += 1
                continue
            solo = _answer_from_json(spec, r.json())
            for a in stats.answers[key]:
                compared += 1
                if a != solo:
                    what = ("text" if a.text != solo.text else "tokens" if a.tokens != solo.tokens
                            else "logprobs" if a.logprobs != solo.logprobs else "finish_reason")
                    mismatches.append({"key": key, "endpoint": spec.endpoint,
                                       "stream": spec.stream, "differs_in": what,
                                       "got": asdict(a), "solo": asdict(solo)})
        solo_s = time.monotonic() - solo_t0
        kv_end = await wait_idle_kv(http)
        stop.set()
        await sampler
    rss.append((round(time.monotonic() - t0, 1), round(rss_mib(pid), 1)))
    phases.append({"phase": "solo", "requests": len(stats.answers), "kv": kv_end,
                   "rss_mib": rss[-1][1]})
    leaked = sum((ph["kv"].get("leaked_blocks") or 0) for ph in phases)
    broken = [ph["phase"] for ph in phases if ph["kv"].get("integrity") != "ok"
              or ph["kv"].get("timeout")]
    server_errors = sum(n for k, n in stats.errors.items() if "http_5" in k or "stream_error" in k)
    ok = not mismatches and not leaked and not broken and not server_errors
    return {
        "ok": ok,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "soak_seconds": round(soak_s, 1), "solo_seconds": round(solo_s, 1),
        "requests_started": stats.started,
        "completed_greedy": stats.completed,
        "completed_sampled": stats.completed_sampled,
        "distinct_greedy_requests_completed": len(stats.answers),
        "disconnects": dict(stats.disconnects),
        "disconnects_total": sum(n for k, n in stats.disconnects.items()
                                 if k != "cut_at_phase_end"),
        "errors": dict(stats.errors),
        "completion_tokens": stats.completion_tokens,
        "output_tokens_per_s": round(stats.completion_tokens / soak_s, 1),
        "compared_with_solo": compared, "mismatches": len(mismatches),
        "mismatch_examples": mismatches[:5],
        "leaked_blocks": leaked, "integrity_failed_phases": broken,
        "ttft_s": {"count": len(stats.ttft_s), "p50": _percentile(stats.ttft_s, 50),
                   "p99": _percentile(stats.ttft_s, 99)},
        "latency_s": {"count": len(stats.latency_s), "p50": _percentile(stats.latency_s, 50),
                      "p99": _percentile(stats.latency_s, 99)},
        "rss_mib": {"start": round(rss_start, 1), "after_phase_1": phases[0]["rss_mib"],
                    "end": rss[-1][1], "peak": max(v for _, v in rss), "series": rss},
        "phases": phases,
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_args = argv[:cut], argv[cut + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load, all phases")
    ap.add_argument("--phases", type=int, default=3, help="KV integrity checked after each")
    ap.add_argument("--pool", type=int, default=64, help="distinct requests the clients draw")
    ap.add_argument("--max-prompt-words", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=48, help="max_tokens drawn from 1..N")
    ap.add_argument("--disconnect-rate", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="what kiln serve serves (default: SmolLM2)")
    ap.add_argument("--drain-timeout", type=float, default=120.0,
                    help="seconds a phase's last requests may run past its end before they are cut")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=None,
                    help="result JSON (default benchmarks/results/soak-<time>.json)")
    args = ap.parse_args(argv)
    args.serve_args = serve_args
    out = args.out or RESULTS / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    # SIGTERM (timeout, kill): unwind, so the server below is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="kiln-soak-") as tmp:
        proc, url, eff = start_server(args, Path(tmp))
        try:
            result = asyncio.run(soak(args, url, proc.pid))
            config = json.loads(eff.read_text()) if eff.exists() else {}
            engine = config.get("engine", {})
            settings = config.get("settings", {})
            result["server"] = {
                "kv_bytes": engine.get("kv_bytes"), "kv_blocks": engine.get("kv_blocks"),
                "max_model_len": engine.get("max_model_len"),
                **{k: (settings.get(k) or {}).get("value") for k in (
                    "max_num_seqs", "quantization", "dtype", "batch_invariant", "threads")},
            }
            result["machine"] = {"cpus": os.cpu_count(),
                                 "loadavg_end": list(os.getloadavg())}
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    r = result
    print(f"soak {r['soak_seconds']} s, {args.clients} clients: {r['requests_started']} requests, "
          f"{r['completed_greedy']} greedy completed ({r['distinct_greedy_requests_completed']} "
          f"distinct), {r['completed_sampled']} sampled, {r['disconnects_total']} disconnects "
          f"{r['disconnects']}")
    print(f"  vs solo: {r['compared_with_solo']} compared, {r['mismatches']} mismatches; "
          f"leaked blocks {r['leaked_blocks']}; integrity failed in {r['integrity_failed_phases']}")
    print(f"  errors {r['errors']}; TTFT p50 {r['ttft_s']['p50']} s p99 {r['ttft_s']['p99']} s; "
          f"{r['output_tokens_per_s']} output tok/s")
    print(f"  RSS MiB: start {r['rss_mib']['start']}, after phase 1 "
          f"{r['rss_mib']['after_phase_1']}, end {r['rss_mib']['end']}, peak "
          f"{r['rss_mib']['peak']}; KV pool {r['server'].get('kv_bytes')} bytes")
    print(f"  -> {out}  {'OK' if r['ok'] else 'FAILED'}")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
