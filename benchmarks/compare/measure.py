"""The workloads every peer is measured with, and the loop that runs them through kiln.bench."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.compare.common import log
from benchmarks.compare.peers import Context, Launch
from kiln.bench.client import BenchConfig, BenchResult, run_benchmark
from kiln.bench.report import fmt
from kiln.bench.workloads import WorkloadConfig


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
    # Long prompts (not run by default: minutes per request on 2 cores for a 1.5B model): the
    # time to the first token of one 2k / 8k-token prompt, nothing else running.
    Workload(
        "ttft2k", "TTFT of a 2048-token prompt", WorkloadConfig("fixed", "completions", 2048, 1),
        1, 3, 1, 0,
    ),
    Workload(
        "ttft8k", "TTFT of an 8192-token prompt", WorkloadConfig("fixed", "completions", 8192, 1),
        1, 2, 1, 0,
    ),
]
DEFAULT_WORKLOADS = ("c1", "c16", "prefix", "prefill")
BY_KEY = {w.key: w for w in WORKLOADS}


def chosen(keys: list[str]) -> list[Workload]:
    """The workloads named (in the table's order)."""
    return [w for w in WORKLOADS if w.key in keys]


def longest_request(workloads: list[Workload]) -> int:
    """Tokens the longest request of these workloads holds: prefix + prompt + output."""
    def tokens(w: WorkloadConfig) -> int:
        prefix = w.prefix_len if w.kind == "shared-prefix" else 0
        return prefix + w.input_len + w.output_len

    return max(tokens(w.workload) for w in workloads)


async def measure(
    base: str, model: str, launch: Launch, ctx: Context, counter: Callable[[str], int] | None,
    workloads: list[Workload] | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for wl in workloads or chosen(list(DEFAULT_WORKLOADS)):
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
