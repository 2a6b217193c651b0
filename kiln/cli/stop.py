"""`kiln stop [PORT|all]`: SIGTERM to running kiln servers (found by their pid files), then wait
while they drain in-flight requests (`kiln serve --drain-timeout`) and exit."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from typing import Any

from kiln.cli import add_lang_flag


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("stop", help="stop running kiln servers (SIGTERM, then wait)",
                              description="Send SIGTERM to the kiln server on PORT (or all of "
                              "them) and wait for each to drain its requests and exit.")
    p.add_argument("target", nargs="?", metavar="PORT|all",
                   help="the server's port, or all (default: the only one running)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="seconds to wait for the servers to exit (default: 60)")
    add_lang_flag(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from kiln import pidfile
    from kiln.i18n import msg

    servers = pidfile.running()
    target = args.target
    if target in (None, "all"):
        if not servers:
            print(msg("ps.none"), file=sys.stderr)
            return 0 if target == "all" else 1
        if target is None and len(servers) > 1:
            ports = ", ".join(str(s.port) for s in servers)
            print(msg("stop.which", ports=ports), file=sys.stderr)
            return 2
        chosen = servers
    else:
        try:
            port = int(target)
        except ValueError:
            print(msg("stop.bad_target", target=target), file=sys.stderr)
            return 2
        chosen = [s for s in servers if s.port == port]
        if not chosen:
            print(msg("stop.no_server", port=port), file=sys.stderr)
            return 1
    for s in chosen:
        with contextlib.suppress(ProcessLookupError):
            os.kill(s.pid, signal.SIGTERM)
        print(msg("stop.sent", port=s.port, pid=s.pid, model=s.model), file=sys.stderr)
    deadline = time.monotonic() + args.timeout
    left = list(chosen)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [s for s in left if pidfile.is_alive(s.pid)]
    for s in chosen:
        if s not in left:
            pidfile.remove(s)  # gone without removing it (killed): not listed again
            print(msg("stop.stopped", port=s.port, pid=s.pid), file=sys.stderr)
    if left:
        from kiln.cli.ps import status

        for s in left:
            st = status(s)
            print(msg("stop.still_running", port=s.port, pid=s.pid, timeout=args.timeout,
                      running="?" if st["requests_running"] is None else st["requests_running"]),
                  file=sys.stderr)
        return 1
    return 0
