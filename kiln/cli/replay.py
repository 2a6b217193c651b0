"""`kiln replay DIR [--url URL]`: re-send the request bundles of --request-dump-dir to a server
and report which outputs differ.

A greedy choice (temperature 0) must give the same text and finish reason again; a sampled one
is compared only when it was seeded, else it is reported as not comparable. Exit code 1 when a
comparable output differs (or a request fails), so a script can gate on it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "replay", help="re-send dumped requests (--request-dump-dir) and report differences",
        description="Re-send every bundle of DIR (written by kiln serve --request-dump-dir) "
        "to a server, non-streamed, and compare the outputs: greedy and seeded choices must "
        "match; others are reported as not comparable.")
    p.add_argument("dir", type=Path, metavar="DIR", help="folder of request bundles")
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="server to replay against (default: %(default)s)")
    p.add_argument("--api-key", default=None,
                   help="key for the server's --api-key [env KILN_API_KEY]")
    p.add_argument("--model", default=None,
                   help="send this model name instead of the one each request asked for")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=main)


@dataclass
class ReplayReport:
    """What a replay found: requests sent, choices compared, how many matched the dump and
    which failed or differ (the dicts say which request and where)."""
    requests: int = 0
    choices: int = 0
    matched: int = 0
    not_comparable: int = 0
    failed: list[dict[str, Any]] = field(default_factory=list)  # the replay request failed
    differ: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differ and not self.failed

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "choices": self.choices, "matched": self.matched,
                "not_comparable": self.not_comparable, "differences": len(self.differ),
                "failed": self.failed, "differ": self.differ}


def load_bundles(folder: Path) -> list[dict[str, Any]]:
    bundles = []
    for path in sorted(folder.glob("*.json")):
        b = json.loads(path.read_text())
        if b.get("error") is None and b.get("choices"):
            b["_path"] = str(path)
            bundles.append(b)
    return bundles


def replay(bundles: list[dict[str, Any]], url: str, *, api_key: str | None = None,
           model: str | None = None, timeout: float = 300.0) -> ReplayReport:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    report = ReplayReport()
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout) as http:
        for b in bundles:
            report.requests += 1
            body = dict(b["request"])
            body["stream"] = False
            body.pop("stream_options", None)
            if model:
                body["model"] = model
            resp = http.post(f"/v1/{b['endpoint']}", json=body)
            if resp.status_code != 200:
                report.failed.append({"bundle": b["_path"], "status": resp.status_code,
                                      "body": resp.text[:500]})
                continue
            got = {c["index"]: c for c in resp.json()["choices"]}
            for c in b["choices"]:
                report.choices += 1
                if not (c["greedy"] or c["seeded"]):
                    report.not_comparable += 1
                    continue
                new = got.get(c["index"], {})
                text = new.get("message", {}).get("content") if "message" in new else (
                    new.get("text"))
                if text == c["text"] and new.get("finish_reason") == c["finish_reason"]:
                    report.matched += 1
                else:
                    report.differ.append({"bundle": b["_path"], "index": c["index"],
                                          "expected": c["text"], "got": text,
                                          "finish_reason": [c["finish_reason"],
                                                            new.get("finish_reason")]})
    return report


def main(args: argparse.Namespace) -> int:
    if not args.dir.is_dir():
        print(f"kiln: error: {args.dir} is not a folder of request bundles", file=sys.stderr)
        return 2
    bundles = load_bundles(args.dir)
    if not bundles:
        print(f"kiln: error: no request bundles in {args.dir}", file=sys.stderr)
        return 2
    try:
        report = replay(bundles, args.url, api_key=args.api_key or os.environ.get("KILN_API_KEY"),
                        model=args.model, timeout=args.timeout)
    except Exception as e:  # noqa: BLE001 - httpx.TransportError (server not reachable) and friends
        print(f"kiln: error: replay against {args.url} failed: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(f"replayed {report.requests} request(s), {report.choices} choice(s): "
              f"{report.matched} match, {len(report.differ)} differ, "
              f"{report.not_comparable} not comparable (sampled without a seed), "
              f"{len(report.failed)} failed")
        for d in report.differ:
            print(f"  differs: {d['bundle']} choice {d['index']}: expected {d['expected']!r}, "
                  f"got {d['got']!r}")
        for f in report.failed:
            print(f"  failed: {f['bundle']}: HTTP {f['status']} {f['body'][:200]}")
    return 0 if report.ok else 1
