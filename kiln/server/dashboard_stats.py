"""What the dashboard polls (`GET /v1/dashboard/stats`): the app's metrics registry, grouped by model.

One source of truth: the numbers are the samples `/metrics` renders, read from the same
`ServerMetrics.registry` (the engine snapshot and vLLM's request histograms), never counted again.
Counters and histogram buckets stay cumulative here; the page turns them into rates and into
percentiles over a sliding window by differencing two polls (Prometheus' `rate` and
`histogram_quantile` over `[1m]`, done in the browser: kiln/ui/dashboard.js), so the server keeps
no per-client state.

Each model is keyed by the `model_name` label the series carry, so when a server holds several
models each gets its own entry with no change here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from kiln.server.metrics import METRICS

# Dashboard field -> metrics.py key of the engine snapshot. Whether it is a gauge or a counter,
# and its sample name, are metrics.py's word: read from its table, not written twice.
ENGINE_SERIES: dict[str, str] = {
    "running": "num_running", "waiting": "num_waiting", "inflight": "num_inflight",
    "kv_usage": "kv_usage", "kv_blocks_total": "kv_blocks_total",
    # per engine step (live), where vllm:generation_tokens moves only when a request finishes
    "generation_tokens": "generated_tokens", "prompt_tokens": "prefill_tokens",
    "prefix_cache_queries": "prefix_cache_queries_tokens",
    "prefix_cache_hits": "prefix_cache_hits_tokens", "preemptions": "num_preemptions",
}


def _engine_series(kind: str) -> dict[str, str]:
    """field -> sample name of the engine series of this kind ("gauge" or "counter")."""
    return {f: METRICS[k][0] for f, k in ENGINE_SERIES.items() if METRICS[k][1] == kind}


GAUGES: dict[str, str] = _engine_series("gauge")
# vllm:request_success_total is summed over its finished_reason label.
COUNTERS: dict[str, str] = {**_engine_series("counter"),
                            "requests_finished": "vllm:request_success_total"}
HISTOGRAMS: dict[str, str] = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
}


def _empty_model(name: str) -> dict[str, Any]:
    return {"name": name, "served_names": [name],
            "gauges": dict.fromkeys(GAUGES), "counters": dict.fromkeys(COUNTERS),
            "histograms": {}}


def _histogram(buckets: Mapping[float, float], total: float | None, count: float | None
               ) -> dict[str, Any]:
    """Cumulative buckets as JSON can carry them: the finite upper bounds, and one more count
    (the +Inf bucket, every observation) than bounds."""
    bounds = sorted(b for b in buckets if math.isfinite(b))
    counts = [buckets[b] for b in bounds] + [buckets.get(math.inf, count or 0.0)]
    return {"bounds": bounds, "counts": counts, "sum": total or 0.0, "count": count or 0.0}


def snapshot(registry: CollectorRegistry, served_names: Sequence[str], *,
             max_model_len: int, version: str) -> dict[str, Any]:
    """{time, version, models: [{name, served_names, max_model_len, gauges, counters,
    histograms: {ttft|itl|e2e: {bounds, counts, sum, count}}}]}; the primary model first. A
    series the registry does not have (an embedding model's engine) is null."""
    by_sample = {v: k for k, v in GAUGES.items()}
    counters = {v: k for k, v in COUNTERS.items()}
    hist_names = {v: k for k, v in HISTOGRAMS.items()}
    models: dict[str, dict[str, Any]] = {}
    hist: dict[tuple[str, str], dict[str, Any]] = {}
    for family in registry.collect():
        for s in family.samples:
            name = s.labels.get("model_name")
            if name is None:
                continue
            m = models.setdefault(name, _empty_model(name))
            if s.name in by_sample:
                m["gauges"][by_sample[s.name]] = s.value
            elif s.name in counters:
                key = counters[s.name]
                m["counters"][key] = (m["counters"][key] or 0.0) + s.value
            else:
                base, _, part = s.name.rpartition("_")
                if base in hist_names:
                    h = hist.setdefault((name, hist_names[base]), {"buckets": {}})
                    if part == "bucket":
                        h["buckets"][float(s.labels["le"])] = s.value
                    elif part in ("sum", "count"):
                        h[part] = s.value
    for (name, key), h in hist.items():
        models[name]["histograms"][key] = _histogram(h["buckets"], h.get("sum"), h.get("count"))
    primary = served_names[0]
    models.setdefault(primary, _empty_model(primary))
    models[primary]["served_names"] = list(served_names)
    models[primary]["max_model_len"] = max_model_len
    ordered = [models[primary]] + [m for n, m in models.items() if n != primary]
    return {"time": time.time(), "version": version, "models": ordered}
