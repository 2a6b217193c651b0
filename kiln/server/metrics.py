"""Prometheus text exposition of the engine's metrics (`GET /metrics`).

Names follow vLLM's where the meaning is the same (`kiln:num_requests_running` ~
`vllm:num_requests_running`), so existing dashboards need only the prefix changed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# stats key -> (metric name, type, help)
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


def render(stats: Mapping[str, float], model_name: str,
           routing: Mapping[int, Sequence[int]] | None = None) -> str:
    """The Prometheus text of `stats` (engine metrics by METRICS key) and, for an MoE model,
    `routing` ({layer: tokens routed to each expert}, as Engine.routing_stats gives it)."""
    lines: list[str] = []
    label = f'{{model_name="{model_name}"}}'
    for key, (name, kind, help_text) in METRICS.items():
        if key not in stats:
            continue
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name}{label} {float(stats[key])!r}")
    if routing:
        lines.extend(_render_routing(routing, model_name))
    return "\n".join(lines) + "\n"


def moe_layer_summary(counts: Sequence[int]) -> dict[str, float]:
    """One MoE layer's routing at a glance: tokens per expert min/mean/max, max over mean
    (NaN before any token), and the experts no token reached (`kiln bench` reports it too)."""
    n = len(counts)
    mean = sum(counts) / n if n else 0.0
    top = max(counts, default=0)
    return {"min": float(min(counts, default=0)), "mean": mean, "max": float(top),
            "imbalance": top / mean if mean else float("nan"),
            "idle": float(sum(1 for c in counts if c == 0))}


def _render_routing(routing: Mapping[int, Sequence[int]], model_name: str) -> list[str]:
    name, kind, help_text = MOE_EXPERT_TOKENS
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for layer, counts in sorted(routing.items()):
        lines.extend(f'{name}{{model_name="{model_name}",layer="{layer}",expert="{e}"}} '
                     f"{float(c)!r}" for e, c in enumerate(counts))
    summaries = {layer: moe_layer_summary(c) for layer, c in sorted(routing.items())}
    for key, (name, kind, help_text) in MOE_METRICS.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for layer, summary in summaries.items():
            if summary[key] == summary[key]:  # no imbalance before the first routed token
                lines.append(f'{name}{{model_name="{model_name}",layer="{layer}"}} '
                             f"{summary[key]!r}")
    return lines
