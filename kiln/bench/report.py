"""Human tables and JSON files for benchmark results."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.bench.client import BenchResult
    from kiln.bench.offline import OfflineResult
    from kiln.bench.stats import Distribution, LevelSummary


def fmt(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def table(headers: list[str], rows: list[list[str]], left: int = 1) -> str:
    """A plain text table: the first `left` columns left-aligned, the rest right-aligned."""
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def _ms(d: Distribution) -> list[str]:
    return [fmt(v * 1000.0) for v in (d.mean, d.p50, d.p90, d.p99)]


def format_summaries(summaries: list[LevelSummary]) -> str:
    rows = [
        [
            s.label,
            str(s.completed),
            str(s.errors),
            fmt(s.requests_per_s, 2),
            fmt(s.output_tok_s),
            fmt(s.total_tok_s),
            fmt(s.duration_s),
        ]
        for s in summaries
    ]
    out = [table(["level", "ok", "err", "req/s", "out tok/s", "total tok/s", "time s"], rows)]
    lat_rows: list[list[str]] = []
    for s in summaries:
        for name, dist in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E", s.e2e)):
            lat_rows.append([s.label, name, *_ms(dist)])
    out.append("")
    out.append(table(["level", "ms", "mean", "p50", "p90", "p99"], lat_rows, left=2))
    notes: list[str] = []
    for s in summaries:
        if s.errors:
            notes.append(f"{s.label}: {s.errors} failed; first: " + " | ".join(s.error_messages))
        if s.short_outputs:
            notes.append(
                f"{s.label}: {s.short_outputs} responses stopped before max_tokens although "
                "ignore_eos was asked: the server ignores it or cut them short"
            )
        if s.usage_missing:
            notes.append(
                f"{s.label}: {s.usage_missing} responses had no usage; tokens counted from chunks"
            )
    if notes:
        out += ["", *notes]
    return "\n".join(out)


def format_result(result: BenchResult) -> str:
    w = result.config.workload
    head = (
        f"kiln bench  {result.config.base_url}  model={result.model}  endpoint={w.endpoint}  "
        f"workload={w.kind}  input~{w.input_len}  output={w.output_len}"
    )
    if w.kind == "shared-prefix":
        head += f"  prefix~{w.prefix_len}"
    if w.kind == "multi-turn":
        head += f"  turns={w.turns}"
    out = head + "\n\n" + format_summaries([lv.summary for lv in result.levels])
    spec = [[lv.summary.label, f"{lv.spec['drafts']:.0f}", f"{lv.spec['draft_tokens']:.0f}",
             f"{lv.spec['acceptance_rate'] * 100:.1f}%", fmt(lv.spec["tokens_per_step"], 2)]
            for lv in result.levels if lv.spec is not None]
    if spec:
        out += ("\n\nspeculative decoding (the server's /metrics over each level):\n"
                + table(["level", "drafts", "draft tok", "accepted", "tok/step"], spec, left=1))
    return out


def format_offline(result: OfflineResult) -> str:
    rows = [["prefill", f"{result.prefill_tokens} tok prompt", fmt(result.prefill_tok_s)]]
    for d in result.decode:
        note = "" if d.method == "difference" else " (whole call: timing was noisy)"
        rows.append([f"decode b={d.batch}", f"{d.tokens_per_seq} tok/seq", fmt(d.tok_s) + note])
    from kiln.bench.offline import REPORTED

    measured = [[name, str(result.settings[name]["value"]), result.settings[name]["source"]]
                for name in REPORTED if name in result.settings]
    head = f"kiln bench --offline  model={result.model}\n\n"
    if measured:
        head += ("configuration measured (resolved as kiln serve resolves it):\n"
                 + table(["setting", "value", "source"], measured, left=2) + "\n\n")
    out = head + table(["phase", "shape", "tok/s"], rows, left=2)
    roofs = [(d.batch, d.roofline) for d in result.decode if d.roofline]
    if roofs:
        read = roofs[0][1]["read_gbs"]
        lines = [[f"decode b={b}", fmt(r["weight_bytes"] / 1e6), fmt(r["kv_bytes"] / 1e6),
                  fmt(r["achieved_gbs"]), f"{100 * r['fraction']:.0f}%"] for b, r in roofs]
        moe = any(r.get("expert_total_bytes") for _, r in roofs)
        if moe:
            for line, (_, r) in zip(lines, roofs):
                line.insert(2, fmt(r["expert_bytes"] / 1e6))
        out += (f"\n\nmemory roofline (read bandwidth measured here: {read:.1f} GB/s; a step reads "
                "its weights once and each row's KV"
                + ("; of the experts, the shared ones and the distinct routed ones the rows "
                   "select, expected from the routing measured" if moe else "") + "):\n"
                + table(["phase", "weights MB", *(["of them experts MB"] if moe else []),
                         "KV MB", "GB/s", "of read bw"], lines, left=2))
    if result.moe_routing:
        routing = [[str(r["layer"]), str(r["tokens"]), fmt(r["min"], 0), fmt(r["mean"]),
                    fmt(r["max"], 0), fmt(r["imbalance"], 2), f"{r['idle']:.0f}/{r['experts']}"]
                   for r in result.moe_routing]
        out += ("\n\nMoE routing during the benchmark (tokens per expert; a token counts once "
                "per selected expert):\n"
                + table(["layer", "routed", "min", "mean", "max", "imbalance", "idle"], routing))
    return out


def _clean(obj: Any) -> Any:
    # JSON has no NaN/inf; null says "no value" and inf becomes a string that round-trips.
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """Write strict JSON (NaN -> null) atomically, creating the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_clean(data), indent=1, allow_nan=False) + "\n")
    tmp.replace(path)
    return path
