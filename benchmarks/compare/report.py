"""The figures read from each peer's results, and the outputs made of them: the ratio table
printed on the terminal, the README's markdown table, the bar chart and the JSON record."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.compare.common import HOST, log
from benchmarks.compare.measure import WORKLOADS
from kiln.bench.report import fmt
from kiln.bench.stats import percentile


@dataclass
class Figure:
    key: str
    label: str
    unit: str
    higher_is_better: bool
    get: Callable[[dict[str, Any]], float | None]


def _summary(peer: dict[str, Any], wl: str) -> dict[str, Any] | None:
    w = peer.get("workloads", {}).get(wl)
    return w["summary"] if w and w.get("summary") else None


def _field(wl: str, *path: str, scale: float = 1.0) -> Callable[[dict[str, Any]], float | None]:
    def get(peer: dict[str, Any]) -> float | None:
        v: Any = _summary(peer, wl)
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else v * scale

    return get


def _per_request_decode(peer: dict[str, Any]) -> float | None:
    tpot = _field("c1", "tpot", "p50")(peer)
    return 1.0 / tpot if tpot else None


def _prefill_rate(peer: dict[str, Any]) -> float | None:
    w = peer.get("workloads", {}).get("prefill")
    rates = [
        r["prompt_tokens"] / r["ttft"]
        for r in (w or {}).get("requests", [])
        if r.get("ok") and r.get("ttft") and r.get("prompt_tokens")
    ]
    # The median, as kiln bench's p50 defines it (so every p50 in the table means the same).
    return percentile(rates, 50) if rates else None


FIGURES = [
    Figure("c1_decode", "c=1 decode speed", "tok/s", True, _per_request_decode),
    Figure("c1_ttft", "c=1 TTFT p50", "ms", False, _field("c1", "ttft", "p50", scale=1e3)),
    Figure("c16_out", "c=16 output throughput", "tok/s", True, _field("c16", "output_tok_s")),
    Figure("c16_ttft", "c=16 TTFT p50", "ms", False, _field("c16", "ttft", "p50", scale=1e3)),
    Figure("c16_tpot", "c=16 TPOT p50", "ms", False, _field("c16", "tpot", "p50", scale=1e3)),
    Figure(
        "prefix_out", "shared prefix c=16 output", "tok/s", True, _field("prefix", "output_tok_s")
    ),
    Figure(
        "prefix_ttft",
        "shared prefix c=16 TTFT p50",
        "ms",
        False,
        _field("prefix", "ttft", "p50", scale=1e3),
    ),
    Figure("prefill", "prefill 512 tokens", "tok/s", True, _prefill_rate),
    Figure("ttft2k", "TTFT 2048-token prompt", "ms", False,
           _field("ttft2k", "ttft", "p50", scale=1e3)),
    Figure("ttft8k", "TTFT 8192-token prompt", "ms", False,
           _field("ttft8k", "ttft", "p50", scale=1e3)),
    Figure("ready", "ready after", "s", False, lambda p: p.get("ready_s")),
    Figure(
        "rss",
        "peak RSS",
        "MiB",
        False,
        lambda p: p["peak_rss_bytes"] / 2**20 if p.get("peak_rss_bytes") else None,
    ),
]


def figure_values(peers: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    # A peer that did not start has no figures, not even the memory it used while failing.
    def ran(p: dict[str, Any]) -> bool:
        return "ready_s" in p

    return {
        f.key: {name: f.get(p) if ran(p) else None for name, p in peers.items()} for f in FIGURES
    }


def best_peer(fig: Figure, values: dict[str, float | None]) -> tuple[str, float] | None:
    cands = [(n, v) for n, v in values.items() if n != "kiln" and v is not None and v > 0]
    if not cands:
        return None
    return (max if fig.higher_is_better else min)(cands, key=lambda nv: nv[1])


def _head(fig: Figure) -> list[str]:
    return [f"{fig.label} ({fig.unit})", "higher" if fig.higher_is_better else "lower"]


def _ratio(fig: Figure, values: dict[str, float | None]) -> tuple[str, str]:
    """("best-peer value", "kiln / best") cells of one figure, "-" where either is missing."""
    kiln = values.get("kiln")
    best = best_peer(fig, values)
    if best is None:
        return "-", "-"
    return f"{best[0]} {fmt(best[1], 1)}", "-" if kiln is None else f"{kiln / best[1]:.2f}x"


def ratio_rows(peers: dict[str, dict[str, Any]]) -> list[list[str]]:
    """One row per figure for the terminal: figure, direction, kiln, best peer, ratio."""
    values = figure_values(peers)
    return [
        [*_head(fig), fmt(values[fig.key].get("kiln"), 1), *_ratio(fig, values[fig.key])]
        for fig in _measured(values)
    ]


def _measured(values: dict[str, dict[str, float | None]]) -> list[Figure]:
    """The figures some peer has a value for (a run measures a chosen set of workloads)."""
    return [f for f in FIGURES if any(v is not None for v in values[f.key].values())]


def markdown_table(peers: dict[str, dict[str, Any]], threads: int, model: str) -> str:
    names = list(peers)
    values = figure_values(peers)
    head = ["figure", "better", *names, "kiln / best peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for fig in _measured(values):
        vals = values[fig.key]
        cells = [*_head(fig), *(fmt(vals.get(n), 1) for n in names), _ratio(fig, vals)[1]]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {n}: {p['status']}" for n, p in peers.items() if p.get("status") != "ok"]
    notes += [f"- {n}: {p['note']}" for n, p in peers.items() if p.get("note")]
    foot = (
        f"\n{model}, {threads} threads, {HOST}, completions endpoint, greedy, "
        "outputs forced to full length; generated by `python benchmarks/compare/run.py "
        "--markdown`."
    )
    return "\n".join(lines) + foot + ("\n\n" + "\n".join(notes) if notes else "")


def round_ratios(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, list[float]]:
    """kiln / best peer of every figure in each round where both were measured."""
    out: dict[str, list[float]] = {}
    for peers in rounds:
        values = figure_values(peers)
        for fig in FIGURES:
            kiln, best = values[fig.key].get("kiln"), best_peer(fig, values[fig.key])
            if kiln is not None and best is not None:
                out.setdefault(fig.key, []).append(kiln / best[1])
    return out


def rounds_table(rounds: list[dict[str, dict[str, Any]]], threads: int, model: str) -> str:
    """The markdown table of a run of several rounds (the peers alternated within each, so a
    machine whose speed drifts slows all of them alike): each figure's per-round ratios and
    their median, the figure the README quotes."""
    ratios = round_ratios(rounds)
    lines = ["| figure | better | kiln / best peer, each round | median |", "|---|---|---|---|"]
    for fig in FIGURES:
        rs = ratios.get(fig.key)
        if rs:
            each = ", ".join(f"{r:.2f}x" for r in rs)
            lines.append(f"| {' | '.join(_head(fig))} | {each} | {percentile(rs, 50):.2f}x |")
    return "\n".join(lines) + (
        f"\n{model}, {threads} threads, {len(rounds)} rounds, the peers' order reversed every "
        "other round; generated by `python benchmarks/compare/run.py --rounds N --markdown`."
    )


def chart(peers: dict[str, dict[str, Any]], path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no chart (pip install matplotlib into .venv)")
        return None
    values = figure_values(peers)
    names = list(peers)
    colors = {
        "kiln": "#d9480f",
        "llama-server": "#1c7ed6",
        "llama-cpp-python": "#37b24d",
        "vllm": "#7048e8",
    }
    cols = 5
    rows = math.ceil(len(FIGURES) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    for ax, f in zip(axes.flat, FIGURES):
        vals = [values[f.key].get(n) or 0.0 for n in names]
        bars = ax.bar(range(len(names)), vals, color=[colors.get(n, "#868e96") for n in names])
        ax.set_title(
            f"{f.label}\n({f.unit}, {'higher' if f.higher_is_better else 'lower'} is better)",
            fontsize=8,
        )
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
        for b, v, n in zip(bars, vals, names):
            label = fmt(v, 1) if values[f.key].get(n) is not None else "n/a"
            ax.annotate(
                label,
                (b.get_x() + b.get_width() / 2, b.get_height()),
                ha="center",
                va="bottom",
                fontsize=6,
            )
    for ax in list(axes.flat)[len(FIGURES) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def result_record(
    peers: dict[str, dict[str, Any]], *, started_at: str, model: str, threads: int, quick: bool,
    rounds: list[dict[str, dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Everything a run measured, as written to compare-<time>.json (format version 1): `peers`
    the last round's records; with several rounds, `rounds` each round's figures and `ratios`
    each figure's kiln / best peer per round."""
    extra: dict[str, Any] = {}
    if rounds and len(rounds) > 1:
        extra = {"rounds": [figure_values(r) for r in rounds], "ratios": round_ratios(rounds)}
    return {
        "kind": "kiln-compare",
        "version": 1,
        "started_at": started_at,
        "model": model,
        "threads": threads,
        "quick": quick,
        "host": HOST,
        "workloads": {w.key: w.title for w in WORKLOADS},
        "figures": {
            f.key: {"label": f.label, "unit": f.unit, "higher_is_better": f.higher_is_better}
            for f in FIGURES
        },
        "values": figure_values(peers),
        "peers": peers,
        **extra,
    }
