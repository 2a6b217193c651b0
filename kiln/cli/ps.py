"""`kiln ps`: the kiln servers running on this machine, from their pid files (kiln/pidfile.py),
with the requests each one's /metrics counts now (kiln's own engine, vLLM or SGLang behind it)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from kiln.cli import add_json_flag, add_lang_flag, format_table
from kiln.pidfile import ServerRecord


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("ps", help="list running kiln servers",
                              description="List the kiln servers running on this machine: port, "
                              "model, pid, uptime, requests running and waiting.")
    add_json_flag(p)
    add_lang_flag(p)
    p.set_defaults(func=main)


# Requests running / waiting in each engine's /metrics (kiln's carries vLLM's names too).
QUEUE_GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
                "sglang:num_running_reqs": "running", "sglang:num_queue_reqs": "waiting"}


def queue_now(rec: ServerRecord, timeout: float = 2.0) -> dict[str, int] | None:
    """{"running": n, "waiting": n} from the server's /metrics, or None when it does not
    answer (starting up, draining, hung, or metrics off)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = httpx.get(f"{rec.url}/metrics", timeout=timeout)
        if r.status_code != 200:
            return None
        out = {"running": 0, "waiting": 0}
        for fam in text_string_to_metric_families(r.text):
            key = QUEUE_GAUGES.get(fam.name)
            if key:
                out[key] += int(sum(s.value for s in fam.samples))
        return out
    except (httpx.HTTPError, ValueError):
        return None


def format_uptime(seconds: float) -> str:
    s = int(max(seconds, 0))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{d}d{h:02d}h" if d else f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def status(rec: ServerRecord) -> dict[str, Any]:
    """One server as `kiln ps --json` prints it."""
    from kiln.resolve.hardware import rss_bytes

    h = queue_now(rec)
    return {"port": rec.port, "pid": rec.pid, "model": rec.model, "url": rec.url,
            "memory_bytes": rss_bytes(rec.pid) or None,
            "engine": rec.engine, "weights": rec.weights, "version": rec.version,
            "started_at": rec.started_at, "uptime_s": round(time.time() - rec.started_at, 1),
            "responding": h is not None,
            "requests_running": h["running"] if h else None,
            "requests_waiting": h["waiting"] if h else None}


def main(args: argparse.Namespace) -> int:
    from kiln import pidfile
    from kiln.i18n import msg

    rows = [status(r) for r in pidfile.running()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(msg("ps.none"))
        return 0

    def n(v: Any) -> str:
        return "-" if v is None else str(v)

    def mib(v: Any) -> str:
        return "-" if not v else f"{v / 2**20:.0f} MiB"

    # A router (--models) is a row of its own; each model it has loaded is a `kiln serve` of
    # its own, so a row too, with its memory.
    print(format_table([[str(r["port"]), str(r["pid"]), r["model"] + (
                             " (router)" if r["engine"] == "router" else ""),
                         mib(r["memory_bytes"]), format_uptime(r["uptime_s"]),
                         n(r["requests_running"]), n(r["requests_waiting"]), r["url"]]
                        for r in rows],
                       ["PORT", "PID", "MODEL", "MEMORY", "UPTIME", "RUNNING", "WAITING",
                        "URL"]))
    return 0
