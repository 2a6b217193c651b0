"""Prometheus text exposition of the engine's metrics (`GET /metrics`).

Names follow vLLM's where the meaning is the same (`kiln:num_requests_running` ~
`vllm:num_requests_running`), so existing dashboards need only the prefix changed.
"""

from __future__ import annotations

from collections.abc import Mapping

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


def render(stats: Mapping[str, float], model_name: str) -> str:
    lines: list[str] = []
    label = f'{{model_name="{model_name}"}}'
    for key, (name, kind, help_text) in METRICS.items():
        if key not in stats:
            continue
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name}{label} {float(stats[key])!r}")
    return "\n".join(lines) + "\n"
