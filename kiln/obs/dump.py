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

from kiln.engine.output import ParentRequest, RequestOutput

if TYPE_CHECKING:
    from kiln.sampling_params import SamplingParams


# What a bundle reads of the server's engine requests (kiln.server.serving's PromptSpec has
# these fields), spelled out here so that this lower floor does not import the server that
# writes through it (tests/unit/test_layering.py keeps kiln/ free of import cycles).
class PromptSpec(Protocol):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    first_index: int


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

    def begin(self, endpoint: str, body: Any, specs: list[PromptSpec]) -> RequestDump:
        raw = body.model_dump(mode="json", exclude_unset=True) if hasattr(
            body, "model_dump") else dict(body)
        return RequestDump(self, endpoint, sanitize(raw), specs)


class RequestDump:
    """One request's bundle, filled from the engine's outputs as they arrive (a stream's
    DELTA pieces, folded by `RequestOutput.add`) or at once (a JSON answer's FINAL_ONLY one)."""

    def __init__(self, dumper: RequestDumper, endpoint: str, body: dict[str, Any],
                 specs: list[PromptSpec]) -> None:
        self.dumper = dumper
        self.endpoint = endpoint
        self.body = body
        self.specs = specs
        self.received = time.time()
        self.t0 = time.monotonic()
        self.first_token_s: float | None = None
        self.outputs = [RequestOutput(s.request_id, s.prompt_ids, [], finished=False)
                        for s in specs]

    def add(self, pos: int, out: RequestOutput) -> None:
        """An output of the engine request `specs[pos]`."""
        if self.first_token_s is None and any(co.token_ids for co in out.outputs):
            self.first_token_s = time.monotonic() - self.t0
        self.outputs[pos].add(out)

    def write(self, error: str | None = None) -> Path:
        choices = []
        for s, out in zip(self.specs, self.outputs, strict=True):
            got = {co.index: co for co in out.outputs}
            # The sequences the engine ran the request as, and each one's params.
            runs = ParentRequest(s.request_id, s.prompt_ids, s.params).children()
            for i, (seq_id, params) in enumerate(runs):
                co = got.get(i)
                choices.append({
                    "index": s.first_index + i, "request_id": seq_id,
                    "sampling_params": asdict(params),
                    "greedy": params.greedy, "seeded": params.seed is not None,
                    "prompt_token_ids": s.prompt_ids,
                    "output_token_ids": co.token_ids if co else [],
                    "text": co.text if co else "",
                    "finish_reason": co.finish_reason if co else None,
                })
        request_id = self.specs[0].request_id if self.specs else "request"
        if len(self.specs) > 1:  # a batch of prompts: `{api id}-{prompt}`
            request_id = request_id.rsplit("-", 1)[0]
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
