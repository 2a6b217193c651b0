"""--request-dump-dir: one JSON bundle per request, for reading and for `kiln replay`.

A bundle holds the request body as the client sent it (secret-looking fields removed; headers,
`Authorization` among them, are never read), and per choice the resolved sampling params, the
prompt and output token ids, the output text and finish reason, the timings, and the hash of the
effective config the server ran with. Written on the event loop's thread when the response is
complete (a few KB, one file).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kiln.sampling_params import SamplingParams


# What a bundle reads of the server's choices (kiln.server.serving's ChoiceSpec and ChoiceEvent
# have these fields), spelled out here so that this lower floor does not import the server that
# writes through it (tests/test_layering.py keeps kiln/ free of import cycles).
class ChoiceSpec(Protocol):
    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams


class ChoiceEvent(Protocol):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None

    @property
    def finished(self) -> bool: ...

# Body fields that may carry a credential. Matched by exact (lower-case) name at any depth: a
# substring test would also remove max_tokens and logit_bias's token ids.
SECRET_KEYS = frozenset({"api_key", "apikey", "authorization", "password", "secret", "token",
                         "access_token", "secret_key", "bearer"})
BUNDLE_VERSION = 1


def sanitize(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: sanitize(v) for k, v in obj.items()
                if str(k).lower().replace("-", "_") not in SECRET_KEYS}
    if isinstance(obj, list):
        return [sanitize(v) for v in obj]
    return obj


class RequestDumper:
    def __init__(self, folder: str | Path, config_hash: str) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.config_hash = config_hash

    def begin(self, endpoint: str, body: Any, specs: list[ChoiceSpec]) -> RequestDump:
        raw = body.model_dump(mode="json", exclude_unset=True) if hasattr(
            body, "model_dump") else dict(body)
        return RequestDump(self, endpoint, sanitize(raw), specs)


class RequestDump:
    """One request's bundle, filled as its events arrive (streaming) or at once (collect)."""

    def __init__(self, dumper: RequestDumper, endpoint: str, body: dict[str, Any],
                 specs: list[ChoiceSpec]) -> None:
        self.dumper = dumper
        self.endpoint = endpoint
        self.body = body
        self.specs = specs
        self.received = time.time()
        self.t0 = time.monotonic()
        self.first_token_s: float | None = None
        self.text: dict[int, list[str]] = {s.index: [] for s in specs}
        self.token_ids: dict[int, list[int]] = {s.index: [] for s in specs}
        self.final: dict[int, ChoiceEvent] = {}

    def add(self, ev: ChoiceEvent) -> None:
        if self.first_token_s is None and ev.token_ids:
            self.first_token_s = time.monotonic() - self.t0
        self.text[ev.index].append(ev.text)
        self.token_ids[ev.index].extend(ev.token_ids)
        if ev.finished:
            self.final[ev.index] = ev

    def write(self, error: str | None = None) -> Path:
        choices = []
        for s in self.specs:
            fin = self.final.get(s.index)
            choices.append({
                "index": s.index, "request_id": s.request_id,
                "sampling_params": asdict(s.params),
                "greedy": s.params.greedy, "seeded": s.params.seed is not None,
                "prompt_token_ids": s.prompt_ids,
                "output_token_ids": self.token_ids[s.index],
                "text": "".join(self.text[s.index]),
                "finish_reason": fin.finish_reason if fin else None,
            })
        request_id = self.specs[0].request_id.rsplit("-", 1)[0] if self.specs else "request"
        bundle = {
            "version": BUNDLE_VERSION, "request_id": request_id, "endpoint": self.endpoint,
            "request": self.body, "choices": choices, "error": error,
            "effective_config_hash": self.dumper.config_hash,
            "timings": {"received": self.received, "first_token_s": self.first_token_s,
                        "total_s": time.monotonic() - self.t0},
        }
        path = self.dumper.folder / f"{int(self.received * 1000)}-{request_id}.json"
        path.write_text(json.dumps(bundle, indent=1, default=str))
        return path
