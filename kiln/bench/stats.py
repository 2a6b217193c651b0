"""Per-request metrics and per-level summaries.

Definitions (the ones vLLM's benchmark_serving uses, so numbers compare):
  TTFT  time from sending the request to the first chunk that carries output text.
  TPOT  (e2e - ttft) / (output_tokens - 1): mean time per output token after the first, per
        request, with output_tokens taken from the server's `usage`.
  ITL   gaps between consecutive output-carrying chunks; a chunk holding several tokens counts
        as one gap, so ITL and TPOT differ exactly when a server batches tokens into chunks.
  E2E   time from sending the request to the end of the stream.
Throughput divides token counts by the level's wall time: first measured send to last end.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, as numpy's default does."""
    if not values:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Distribution:
    """Summary of one metric in seconds (latencies) or any unit; NaN when there are no values."""

    count: int = 0
    mean: float = math.nan
    p50: float = math.nan
    p90: float = math.nan
    p99: float = math.nan
    min: float = math.nan
    max: float = math.nan

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls()
        return cls(
            count=len(values),
            mean=sum(values) / len(values),
            p50=percentile(values, 50),
            p90=percentile(values, 90),
            p99=percentile(values, 99),
            min=min(values),
            max=max(values),
        )


@dataclass
class RequestRecord:
    """Raw timings of one request, all times from time.perf_counter()."""

    start: float
    end: float
    ok: bool
    # Arrival time of every chunk that carried output text, absolute perf_counter values.
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    usage_reported: bool = False  # False: completion_tokens was counted from chunks
    error: str | None = None
    session: int = 0
    turn: int = 0
    text: str = ""
    retries: int = 0  # resends after a stale keep-alive connection (see BenchClient.send)
    # max_tokens when the request asked for ignore_eos (so fewer tokens mean the server cut it
    # short); None when stopping early is allowed.
    expected_tokens: int | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        ttft = self.ttft
        n = self.completion_tokens
        if ttft is None or n is None or n < 2:
            return None
        return (self.e2e - ttft) / (n - 1)

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]

    def to_json(self, t0: float) -> dict[str, Any]:
        """Raw numbers relative to `t0` (the level's first send), rounded to microseconds."""
        return {
            "start": round(self.start - t0, 6),
            "end": round(self.end - t0, 6),
            "ok": self.ok,
            "ttft": None if self.ttft is None else round(self.ttft, 6),
            "tpot": None if self.tpot is None else round(self.tpot, 6),
            "chunk_times": [round(c - self.start, 6) for c in self.chunk_times],
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "usage_reported": self.usage_reported,
            "error": self.error,
            "session": self.session,
            "turn": self.turn,
            "retries": self.retries,
            "expected_tokens": self.expected_tokens,
        }


@dataclass
class LevelSummary:
    label: str
    concurrency: int | None
    request_rate: float | None
    completed: int
    errors: int
    error_messages: list[str]
    duration_s: float
    input_tokens: int
    output_tokens: int
    requests_per_s: float
    output_tok_s: float
    total_tok_s: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    usage_missing: int  # ok requests whose server sent no usage (counts came from chunks)
    short_outputs: int = 0  # ok requests with fewer tokens than an ignore_eos request asked for
    retries: int = 0  # resends after stale keep-alive connections (the client's race, not errors)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


MAX_ERROR_MESSAGES = 5


def summarize(
    records: Sequence[RequestRecord],
    *,
    label: str,
    concurrency: int | None = None,
    request_rate: float | None = None,
) -> LevelSummary:
    ok = [r for r in records if r.ok]
    bad = [r for r in records if not r.ok]
    messages: list[str] = []
    for r in bad:
        msg = r.error or "unknown error"
        if msg not in messages:
            messages.append(msg)
        if len(messages) >= MAX_ERROR_MESSAGES:
            break
    if records:
        duration = max(r.end for r in records) - min(r.start for r in records)
    else:
        duration = 0.0
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.completion_tokens or 0 for r in ok)

    def rate(x: float) -> float:
        return x / duration if duration > 0 else math.nan

    return LevelSummary(
        label=label,
        concurrency=concurrency,
        request_rate=request_rate,
        completed=len(ok),
        errors=len(bad),
        error_messages=messages,
        duration_s=duration,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        requests_per_s=rate(len(ok)),
        output_tok_s=rate(output_tokens),
        total_tok_s=rate(input_tokens + output_tokens),
        ttft=Distribution.of([t for r in ok if (t := r.ttft) is not None]),
        tpot=Distribution.of([t for r in ok if (t := r.tpot) is not None]),
        itl=Distribution.of([g for r in ok for g in r.itls]),
        e2e=Distribution.of([r.e2e for r in ok]),
        usage_missing=sum(1 for r in ok if not r.usage_reported),
        retries=sum(r.retries for r in records),
        short_outputs=sum(
            1
            for r in ok
            if r.expected_tokens is not None and (r.completion_tokens or 0) < r.expected_tokens
        ),
    )
