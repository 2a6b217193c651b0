"""`GET /metrics`: kiln's metrics through prometheus_client, under `kiln:` and vLLM's names.

Two kinds of series, one registry per app (not prometheus_client's global one, so several apps in
one process, as in tests, do not clash):

  * the engine's snapshot (queue, KV, prefix cache, step counters, MoE routing), read from
    `AsyncEngine.stats()` at each scrape by `_EngineCollector`: the engine thread copies it after
    every step, so a scrape never reads counters a step is adding to;
  * vLLM's request-level counters and histograms, fed by `ServerMetrics.observe` with each
    finished request's `RequestMetrics` (made by the one output processor, engine/output.py),
    with vLLM's names, types, buckets and `model_name` label, so a vLLM Grafana dashboard works
    unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.engine.output import RequestMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# stats key -> (metric name, type, help); kiln's own names, kept from the hand-written text.
METRICS: dict[str, tuple[str, str, str]] = {
    "num_running": ("kiln:num_requests_running", "gauge",
                    "Requests in the running batch."),
    "num_waiting": ("kiln:num_requests_waiting", "gauge",
                    "Requests waiting to be scheduled."),
    "num_inflight": ("kiln:num_requests_inflight", "gauge",
                     "Requests with an open stream."),
    "kv_usage": ("kiln:kv_cache_usage_perc", "gauge",
                 "Fraction of KV blocks held by requests."),
    "kv_blocks_total": ("kiln:kv_cache_blocks_total", "gauge",
                        "KV blocks in the pool."),
    "kv_blocks_free": ("kiln:kv_cache_blocks_free", "gauge",
                       "KV blocks free (incl. cached)."),
    "prefix_cache_queries_tokens": ("kiln:prefix_cache_queries_total", "counter",
                                    "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits_tokens": ("kiln:prefix_cache_hits_total", "counter",
                                 "Prompt tokens found in the prefix cache."),
    "num_preemptions": ("kiln:num_preemptions_total", "counter",
                        "Requests preempted (recomputed later) for lack of KV blocks."),
    "prefill_tokens": ("kiln:prompt_tokens_total", "counter",
                       "Prefill tokens computed."),
    "generated_tokens": ("kiln:generation_tokens_total", "counter",
                         "Tokens generated."),
    "steps": ("kiln:engine_steps_total", "counter",
              "Engine steps run."),
    "step_seconds": ("kiln:engine_step_seconds_total", "counter",
                     "Seconds spent in steps."),
    "session_cache_entries": ("kiln:session_cache_entries", "gauge",
                              "Conversations whose KV blocks are pinned."),
    "session_cache_pinned_blocks": ("kiln:session_cache_pinned_blocks", "gauge",
                                    "KV blocks pinned by the session cache."),
    "session_cache_released": ("kiln:session_cache_released_total", "counter",
                               "Sessions whose blocks were released (LRU or pool pressure)."),
    "prefix_rendezvous_waits": ("kiln:prefix_rendezvous_waits_total", "counter",
                                "Steps a request waited for a prefix another was prefilling."),
    "prefix_rendezvous_timeouts": ("kiln:prefix_rendezvous_timeouts_total", "counter",
                                   "Rendezvous waits that ran out of time."),
    "structured_rows": ("kiln:structured_output_rows_total", "counter",
                        "Sampled rows masked by a structured-output grammar."),
    "structured_seconds": ("kiln:structured_output_seconds_total", "counter",
                           "Seconds of grammar work: masks filled and applied, matchers advanced."),
    "structured_compiles": ("kiln:structured_output_compiles_total", "counter",
                            "Grammars compiled (structured-output cache misses)."),
    "cpu_threads_active": ("kiln:cpu_threads_active", "gauge",
                           ("CPU compute threads the engine runs now (below --threads while "
                            "other processes hold some of its CPUs; --adaptive-threads).")),
    "spec_num_speculative_tokens": ("kiln:spec_decode_num_speculative_tokens", "gauge",
                                    ("Draft tokens proposed per step now (K; moves with "
                                    "--num-speculative-tokens auto).")),
}

# The same snapshot under vLLM v1's names (same meaning; vLLM's KV usage is a 0..1 fraction too).
VLLM_SNAPSHOT: dict[str, tuple[str, str, str]] = {
    "num_running": ("vllm:num_requests_running", "gauge",
                    "Number of requests in model execution batches."),
    "num_waiting": ("vllm:num_requests_waiting", "gauge",
                    "Number of requests waiting to be processed."),
    "kv_usage": ("vllm:kv_cache_usage_perc", "gauge",
                 "KV-cache usage. 1 means 100 percent usage."),
    "num_preemptions": ("vllm:num_preemptions_total", "counter",
                        "Cumulative number of preemption from the engine."),
    "prefix_cache_queries_tokens": ("vllm:prefix_cache_queries_total", "counter",
                                    "Prefix cache queries, in terms of number of queried tokens."),
    "prefix_cache_hits_tokens": ("vllm:prefix_cache_hits_total", "counter",
                                 "Prefix cache hits, in terms of number of cached tokens."),
    # speculative decoding (only with it on): acceptance rate = accepted / draft tokens; tokens
    # per drafted step = 1 + accepted / drafts
    "spec_num_drafts": ("vllm:spec_decode_num_drafts_total", "counter",
                        "Number of spec decoding drafts."),
    "spec_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens_total", "counter",
                              "Number of draft tokens."),
    "spec_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens_total", "counter",
                                 "Number of accepted tokens."),
}

# MoE routing (labelled by layer, and by expert for the counter), only for an MoE model. The
# counter is the data; the gauges summarise it per layer for operators who do not want one
# series per expert on a dashboard (128 experts x 48 layers is 6144 series).
MOE_EXPERT_TOKENS = ("kiln:moe_expert_tokens_total", "counter",
                     ("Tokens routed to each expert of an MoE layer (a token counts once for "
                      "each of its top-k experts)."))
MOE_METRICS: dict[str, tuple[str, str, str]] = {
    "imbalance": ("kiln:moe_expert_load_imbalance", "gauge",
                  ("Tokens of the busiest expert of an MoE layer over the mean per expert, "
                   "since startup (1: even; the expert count: one expert takes all).")),
    "idle": ("kiln:moe_experts_idle", "gauge",
             "Experts of an MoE layer that no token has been routed to since startup."),
}

# vLLM v1's bucket boundaries (vllm/v1/metrics/loggers.py), so dashboards' quantiles match.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


def token_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets(max_model_len))."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(float(m * scale))
        scale *= 10


def moe_layer_summary(counts: Sequence[int]) -> dict[str, float]:
    """One MoE layer's routing at a glance: tokens per expert min/mean/max, max over mean
    (NaN before any token), and the experts no token reached (`kiln bench` reports it too)."""
    n = len(counts)
    mean = sum(counts) / n if n else 0.0
    top = max(counts, default=0)
    return {"min": float(min(counts, default=0)), "mean": mean, "max": float(top),
            "imbalance": top / mean if mean else float("nan"),
            "idle": float(sum(1 for c in counts if c == 0))}


def _family(name: str, kind: str, help_text: str, labels: list[str]) -> Metric:
    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    return cls(name, help_text, labels=labels)


class _EngineCollector(Collector):
    """The engine's snapshot as Prometheus families, read at each scrape."""

    def __init__(self, stats: Callable[[], Mapping[str, float]],
                 routing: Callable[[], Mapping[int, Sequence[int]]], model_name: str) -> None:
        self.stats, self.routing, self.model_name = stats, routing, model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        for table in (METRICS, VLLM_SNAPSHOT):
            for key, (name, kind, help_text) in table.items():
                if key in stats:
                    fam = _family(name, kind, help_text, ["model_name"])
                    fam.add_metric([self.model_name], float(stats[key]))
                    yield fam
        routing = self.routing()
        if routing:
            yield from self._routing(routing)

    def _routing(self, routing: Mapping[int, Sequence[int]]) -> Iterator[Metric]:
        name, kind, help_text = MOE_EXPERT_TOKENS
        fam = _family(name, kind, help_text, ["model_name", "layer", "expert"])
        for layer, counts in sorted(routing.items()):
            for e, c in enumerate(counts):
                fam.add_metric([self.model_name, str(layer), str(e)], float(c))
        yield fam
        summaries = {layer: moe_layer_summary(c) for layer, c in sorted(routing.items())}
        for key, (name, kind, help_text) in MOE_METRICS.items():
            fam = _family(name, kind, help_text, ["model_name", "layer"])
            for layer, summary in summaries.items():
                if summary[key] == summary[key]:  # no imbalance before the first routed token
                    fam.add_metric([self.model_name, str(layer)], summary[key])
            yield fam


class ServerMetrics:
    """One app's registry: the engine snapshot plus vLLM's request-level series. Wire it with
    `engine.finished_listeners.append(metrics.observe)`; `render()` is the /metrics body."""

    def __init__(self, stats: Callable[[], Mapping[str, float]],
                 routing: Callable[[], Mapping[int, Sequence[int]]], model_name: str,
                 max_model_len: int) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(stats, routing, model_name))
        reg, lbl = self.registry, ["model_name"]

        def hist(name: str, help_text: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, help_text, lbl, buckets=buckets, registry=reg).labels(
                model_name)

        tokens = token_buckets(max_model_len)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     lbl, registry=reg).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.", lbl,
                                         registry=reg).labels(model_name)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          ["model_name", "finished_reason"], registry=reg)
        self.success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self.ttft = hist("vllm:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds",
                        "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.",
                          REQUEST_LATENCY_BUCKETS)
        self.req_prompt = hist("vllm:request_prompt_tokens",
                               "Number of prefill tokens processed.", tokens)
        self.req_generation = hist("vllm:request_generation_tokens",
                                   "Number of generation tokens processed.", tokens)

    def observe(self, m: RequestMetrics) -> None:
        """One finished request (called on the engine thread; prometheus_client locks)."""
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.generation_tokens.inc(m.num_generation_tokens)
        reason = m.finish_reason if m.finish_reason in self.success else "abort"
        self.success[reason].inc()
        self.e2e.observe(m.e2e)
        self.req_prompt.observe(m.num_prompt_tokens)
        self.req_generation.observe(m.num_generation_tokens)
        if m.queue_time is not None:
            self.queue.observe(m.queue_time)
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for dt in m.inter_token_latencies:
            self.itl.observe(dt)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def render(stats: Mapping[str, float], model_name: str,
           routing: Mapping[int, Sequence[int]] | None = None) -> str:
    """The Prometheus text of an engine snapshot alone (no request histograms): `stats` by
    METRICS key and, for an MoE model, `routing` ({layer: tokens per expert})."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_EngineCollector(lambda: stats, lambda: routing or {}, model_name))
    return generate_latest(reg).decode()
