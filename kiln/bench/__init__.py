"""Benchmarks: `kiln bench` drives any OpenAI-compatible server; `--offline` the engine itself.

  workloads.py  prompts (fixed, shared-prefix, multi-turn), fresh per run
  client.py     httpx streaming client, SSE parsing, closed/open-loop load, run_benchmark()
  stats.py      percentiles, TTFT/TPOT/ITL/E2E per request, per-level summaries
  report.py     human tables and JSON output
  offline.py    in-process prefill / decode throughput through kiln.llm.LLM

Importing this package is cheap: httpx, tqdm and torch load only when a benchmark runs.
"""

from __future__ import annotations

from kiln.bench.client import BenchConfig, BenchResult, ServerUnreachableError, run_benchmark
from kiln.bench.workloads import WorkloadConfig

__all__ = [
    "BenchConfig",
    "BenchResult",
    "ServerUnreachableError",
    "WorkloadConfig",
    "run_benchmark",
]
