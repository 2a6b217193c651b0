"""Load generator for any OpenAI-compatible server: streaming requests over httpx (SSE).

Every request streams, so the client sees each chunk as it arrives and times it with
time.perf_counter() before parsing it. Token counts come from the server's `usage` (asked for
with `stream_options.include_usage`); a server that sends none falls back to counting chunks and
the record says so.

Load shapes:
  closed loop  `concurrency` workers, each sending its next session as soon as the last ends.
  open loop    sessions arrive as a Poisson process of `rate` per second, whatever is in flight.
Both stop issuing at `num_requests` or `max_duration`, whichever comes first; a request already
in flight finishes (bounded by `timeout`).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from kiln.bench.stats import LevelSummary, RequestRecord, summarize
from kiln.bench.workloads import (
    Session,
    TokenCounter,
    WorkloadConfig,
    chat_messages,
    completion_prompt,
    hf_token_counter,
    make_sessions,
    new_salt,
)
from kiln.errors import ConfigError, KilnError

if TYPE_CHECKING:
    import httpx


class ServerUnreachableError(KilnError):
    """The benchmark target does not answer, or answers something that is not OpenAI's API."""


# ---------------------------------------------------------------------------------------------
# SSE


class SSEDecoder:
    """Turns the lines of a text/event-stream into the `data` payload of each event.

    Per the SSE spec: an event ends at a blank line; several `data:` lines join with "\\n";
    lines starting with ":" are comments (keep-alives); other fields (event, id, retry) are
    ignored because the OpenAI stream carries everything in `data`.
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> list[str]:
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return []
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        return []

    def flush(self) -> list[str]:
        """The pending event, if any; call at end of stream for servers that omit the last blank
        line."""
        if not self._data:
            return []
        payload = "\n".join(self._data)
        self._data = []
        return [payload]


@dataclass
class Chunk:
    """What the benchmark needs from one stream chunk."""

    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    done: bool = False  # the "[DONE]" sentinel


def parse_chunk(payload: str) -> Chunk:
    """Parse one `data` payload of a /v1/completions or /v1/chat/completions stream."""
    if payload.strip() == "[DONE]":
        return Chunk(done=True)
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        return Chunk(error=f"bad stream chunk: {payload[:200]!r}")
    if not isinstance(obj, dict):
        return Chunk(error=f"bad stream chunk: {payload[:200]!r}")
    if "error" in obj:
        err = obj["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        return Chunk(error=f"server error: {msg}")
    chunk = Chunk(usage=obj.get("usage") or None)
    for choice in obj.get("choices") or []:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            # Reasoning models stream their thinking in a separate field; it is output too.
            chunk.text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        else:
            chunk.text += choice.get("text") or ""
        chunk.finish_reason = choice.get("finish_reason") or chunk.finish_reason
    return chunk


# ---------------------------------------------------------------------------------------------
# Configuration and results


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    concurrency: list[int] = field(default_factory=list)  # closed-loop levels
    request_rates: list[float] = field(default_factory=list)  # open-loop levels (req/s, inf ok)
    num_requests: int = 64  # per level
    max_duration: float | None = None  # seconds per level; None: no limit
    warmup: int = 2  # per level, excluded from the figures
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request
    timeout: float = 600.0  # per request
    seed: int | None = None  # pins the prompts (then runs are no longer fresh)
    tokenizer: str | None = None  # HF id/folder or .gguf: exact prompt lengths
    progress: bool = True
    # Optional precomputed counter; wins over `tokenizer` (lets callers load it once).
    token_counter: TokenCounter | None = field(default=None, repr=False, compare=False)

    def levels(self) -> list[tuple[int | None, float | None]]:
        """(concurrency, rate) per level; closed-loop levels first."""
        closed = self.concurrency or ([] if self.request_rates else [1])
        return [(c, None) for c in closed] + [(None, r) for r in self.request_rates]

    def validate(self) -> None:
        self.workload.validate()
        if any(c < 1 for c in self.concurrency):
            raise ConfigError("--concurrency values must be at least 1")
        if any(not r > 0 for r in self.request_rates):
            raise ConfigError("--request-rate values must be positive (inf for all at once)")
        if self.num_requests < 1:
            raise ConfigError("--num-requests must be at least 1")
        if self.warmup < 0:
            raise ConfigError("--warmup must not be negative")
        if self.max_duration is not None and self.max_duration <= 0:
            raise ConfigError("--max-duration must be positive")
        if self.timeout <= 0:
            raise ConfigError("--timeout must be positive")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("token_counter", None)
        d["api_key"] = "***" if self.api_key else None  # never write secrets to results files
        d["request_rates"] = [r if math.isfinite(r) else "inf" for r in self.request_rates]
        return d


@dataclass
class LevelResult:
    summary: LevelSummary
    records: list[RequestRecord]
    t0: float  # perf_counter of the first measured send
    salt: str
    # the server's speculative decoding during the level (/metrics deltas); None: off / unknown
    spec: dict[str, float] | None = None


@dataclass
class BenchResult:
    config: BenchConfig
    model: str
    levels: list[LevelResult]
    started_at: str
    salt: str

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "kiln-bench",
            "version": 1,
            "started_at": self.started_at,
            "model": self.model,
            "salt": self.salt,
            "config": self.config.to_json(),
            "levels": [
                {
                    "salt": lv.salt,
                    "summary": lv.summary.to_json(),
                    "spec_decode": lv.spec,
                    "requests": [r.to_json(lv.t0) for r in lv.records],
                }
                for lv in self.levels
            ],
        }


# ---------------------------------------------------------------------------------------------
# Client


class BenchClient:
    """Sends benchmark requests to one OpenAI-compatible base URL."""

    def __init__(self, cfg: BenchConfig, http: httpx.AsyncClient, model: str) -> None:
        self.cfg = cfg
        self.http = http
        self.model = model
        self.base = cfg.base_url.rstrip("/")

    @staticmethod
    def headers(api_key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def body(self, session: Session, turn: int, replies: list[str]) -> tuple[str, dict[str, Any]]:
        """(url, JSON body) for one turn of a session."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": session.max_tokens,
            "temperature": self.cfg.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.cfg.ignore_eos:
            body["ignore_eos"] = True
        if self.cfg.workload.endpoint == "chat":
            url = f"{self.base}/chat/completions"
            body["messages"] = chat_messages(session, turn, replies)
        else:
            url = f"{self.base}/completions"
            body["prompt"] = completion_prompt(session, turn, replies)
        body.update(self.cfg.extra_body)
        return url, body

    async def send(self, url: str, body: dict[str, Any], record: RequestRecord) -> None:
        """Stream one request into `record` (start is set by the caller just before)."""
        import httpx

        texts: list[str] = []
        finished = False
        try:
            for attempt in range(2):
                got_response = False
                try:
                    async with self.http.stream(
                        "POST", url, json=body, headers=self.headers(self.cfg.api_key)
                    ) as resp:
                        got_response = True
                        if resp.status_code != 200:
                            detail = (await resp.aread()).decode("utf-8", "replace")[:300]
                            record.error = f"HTTP {resp.status_code}: {detail}"
                            return
                        decoder = SSEDecoder()
                        async for line in resp.aiter_lines():
                            now = time.perf_counter()  # before parsing: parsing is client cost
                            for payload in decoder.feed(line):
                                finished |= self._take(parse_chunk(payload), now, record, texts)
                            if record.error:
                                return
                        for payload in decoder.flush():
                            now = time.perf_counter()
                            finished |= self._take(parse_chunk(payload), now, record, texts)
                    break
                except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                    # A pooled keep-alive connection that the server closed just before we used
                    # it fails before any response: that is the client's race, not a server
                    # error, so resend once on a fresh connection (and count it).
                    if got_response or attempt:
                        raise
                    record.retries += 1
                    record.start = time.perf_counter()
        except httpx.HTTPError as err:
            record.error = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        except asyncio.TimeoutError:
            record.error = "timeout"
        finally:
            record.end = time.perf_counter()
            record.text = "".join(texts)
        if record.error is None and not finished:
            record.error = "stream ended before [DONE] or a finish_reason"
        if record.error is None:
            record.ok = True
            if not record.usage_reported:
                # No usage from this server: one chunk per token is the best guess left.
                record.completion_tokens = len(record.chunk_times)

    @staticmethod
    def _take(chunk: Chunk, now: float, record: RequestRecord, texts: list[str]) -> bool:
        if chunk.error:
            record.error = chunk.error
            return False
        if chunk.text:
            record.chunk_times.append(now)
            texts.append(chunk.text)
        if chunk.usage:
            record.prompt_tokens = chunk.usage.get("prompt_tokens", record.prompt_tokens)
            record.completion_tokens = chunk.usage.get(
                "completion_tokens", record.completion_tokens
            )
            record.usage_reported = True
        return chunk.done or chunk.finish_reason is not None

    async def run_session(
        self,
        session: Session,
        out: list[RequestRecord],
        deadline: float | None,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """Send a session's turns one after another, each resending the history."""
        replies: list[str] = []
        for turn in range(len(session.turns)):
            if deadline is not None and time.perf_counter() >= deadline:
                return
            url, body = self.body(session, turn, replies)
            record = RequestRecord(start=0.0, end=0.0, ok=False, session=session.id, turn=turn)
            # Fallback prompt length for servers without usage: the workload's own estimate.
            record.prompt_tokens = session.prefix_tokens + sum(session.turn_tokens[: turn + 1])
            if self.cfg.ignore_eos:
                record.expected_tokens = int(body.get("max_tokens", session.max_tokens))
            record.start = time.perf_counter()
            await self.send(url, body, record)
            out.append(record)
            if on_done is not None:
                on_done()
            if not record.ok:
                return  # the history is broken; later turns would measure something else
            replies.append(record.text)

    async def closed_loop(
        self,
        sessions: list[Session],
        concurrency: int,
        deadline: float | None,
        on_done: Callable[[], None] | None = None,
    ) -> list[RequestRecord]:
        out: list[RequestRecord] = []
        pending = iter(sessions)  # shared by the workers; safe, asyncio runs one at a time

        async def worker() -> None:
            for session in pending:
                if deadline is not None and time.perf_counter() >= deadline:
                    return
                await self.run_session(session, out, deadline, on_done)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return out

    async def open_loop(
        self,
        sessions: list[Session],
        rate: float,
        deadline: float | None,
        rng: random.Random,
        on_done: Callable[[], None] | None = None,
    ) -> list[RequestRecord]:
        out: list[RequestRecord] = []
        tasks: list[asyncio.Task[None]] = []
        next_at = time.perf_counter()
        for session in sessions:
            now = time.perf_counter()
            if next_at > now:
                await asyncio.sleep(next_at - now)
            if deadline is not None and time.perf_counter() >= deadline:
                break
            tasks.append(asyncio.create_task(self.run_session(session, out, deadline, on_done)))
            # Absolute schedule, so time spent creating tasks does not slow the arrival rate.
            if math.isfinite(rate):
                next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        return out


async def discover_model(http: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    """The first model id of GET {base_url}/models."""
    import httpx

    url = base_url.rstrip("/") + "/models"
    try:
        resp = await http.get(url, headers=BenchClient.headers(api_key))
    except httpx.HTTPError as err:
        raise ServerUnreachableError(
            f"cannot reach {url}: {type(err).__name__}: {err}",
            hint="start the server first, or pass --base-url (including the /v1 part)",
            code="bench.unreachable",
        ) from err
    if resp.status_code != 200:
        raise ServerUnreachableError(
            f"GET {url} answered HTTP {resp.status_code}: {resp.text[:200]}",
            hint="check --base-url and --api-key, or pass --model", code="bench.models_refused",
        )
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise ServerUnreachableError(
            f"GET {url} did not list any model", hint="pass --model NAME", code="bench.no_model"
        ) from err


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="req",
        file=sys.stderr,
        disable=not enabled,
        dynamic_ncols=True,
        leave=True,
    )


SPEC_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts_total",
                 "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
                 "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total"}


async def spec_counters(http: Any, base_url: str, api_key: str | None) -> dict[str, float] | None:
    """The server's speculative-decoding counters from its /metrics (vLLM's names, which kiln
    and vLLM both write); None when it has none (off, or no /metrics)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        r = await http.get(root + "/metrics", headers=BenchClient.headers(api_key))
    except Exception:  # noqa: BLE001 - a server without /metrics is fine: no report
        return None
    if r.status_code != 200:
        return None
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        for key, name in SPEC_COUNTERS.items():
            if line.startswith((name + "{", name + " ")):
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out if len(out) == len(SPEC_COUNTERS) else None


def spec_delta(before: dict[str, float] | None, after: dict[str, float] | None
               ) -> dict[str, float] | None:
    """What the level added: drafts, acceptance rate (accepted / draft tokens) and tokens per
    drafted step (1 + accepted / drafts)."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    d["acceptance_rate"] = d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else 0.0
    d["tokens_per_step"] = 1 + d["accepted_tokens"] / d["drafts"] if d["drafts"] else 1.0
    return d


def level_label(concurrency: int | None, rate: float | None) -> str:
    if concurrency is not None:
        return f"c={concurrency}"
    return "rate=inf" if rate is not None and not math.isfinite(rate) else f"rate={rate:g}/s"


async def run_benchmark(cfg: BenchConfig) -> BenchResult:
    """Run every load level of `cfg` against its server and return all raw records."""
    import httpx

    cfg.validate()
    counter = cfg.token_counter
    if counter is None and cfg.tokenizer:
        counter = hf_token_counter(cfg.tokenizer)
    base_salt = f"seed{cfg.seed}" if cfg.seed is not None else new_salt()
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    levels = cfg.levels()
    max_conn = max([c for c, _ in levels if c is not None] + [1])
    if any(r is not None for _, r in levels):
        max_conn = max(max_conn, 256)  # open loop: in-flight count is not bounded by us
    limits = httpx.Limits(max_connections=max_conn + 4, max_keepalive_connections=max_conn + 4)
    timeout = httpx.Timeout(cfg.timeout, connect=min(cfg.timeout, 30.0))
    results: list[LevelResult] = []
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        model = cfg.model or await discover_model(http, cfg.base_url, cfg.api_key)
        client = BenchClient(cfg, http, model)
        for i, (concurrency, rate) in enumerate(levels):
            # A fresh salt per level: no level is helped by the caches of the one before.
            salt = f"{base_salt}-L{i}"
            label = level_label(concurrency, rate)
            if cfg.warmup:
                warm = make_sessions(cfg.workload, cfg.warmup, salt, counter, tag="warmup")
                await client.closed_loop(warm, min(cfg.warmup, concurrency or cfg.warmup), None)
            sessions = make_sessions(cfg.workload, cfg.num_requests, salt, counter)
            bar = _progress(cfg.num_requests, label, cfg.progress)
            spec_before = await spec_counters(http, cfg.base_url, cfg.api_key)
            try:
                t0 = time.perf_counter()
                deadline = t0 + cfg.max_duration if cfg.max_duration else None
                if concurrency is not None:
                    records = await client.closed_loop(sessions, concurrency, deadline, bar.update)
                else:
                    assert rate is not None
                    rng = random.Random(f"{salt}:arrivals")
                    records = await client.open_loop(sessions, rate, deadline, rng, bar.update)
            finally:
                bar.close()
            if records:
                t0 = min(r.start for r in records)
            summary = summarize(records, label=label, concurrency=concurrency, request_rate=rate)
            spec = spec_delta(spec_before, await spec_counters(http, cfg.base_url, cfg.api_key))
            results.append(LevelResult(summary=summary, records=records, t0=t0, salt=salt,
                                       spec=spec))
    return BenchResult(
        config=cfg, model=model, levels=results, started_at=started_at, salt=base_salt
    )
