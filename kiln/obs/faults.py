"""Typed diagnostic faults (--diagnostic-fault KIND[:ARG], repeatable), for tests and drills.

    startup:STAGE    fail at that startup stage (kiln.obs.trace.STAGES, not process_start)
    step_raise:N     the model step after N steps raises, once: that step's requests fail
                     (HTTP 500), their blocks are freed, the server keeps serving
    step_delay_ms:N  every step sleeps N ms before the model runs
    kv_alloc[:N]     the Nth KV block allocation (default the 1st) fails, once: the request
                     waits, or a running one is preempted and recomputed, as when blocks run out
    drop_stream:N    the first streamed response is cut after N chunks, as if the client left

Every fault but step_delay_ms fires once, so the drill shows the failure and then the recovery.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.errors import BadValue, DiagnosticFault

KINDS = ("startup", "step_raise", "step_delay_ms", "kv_alloc", "drop_stream")


@dataclass(frozen=True, repr=False)
class Fault:
    kind: str
    arg: str | int | None = None

    def __str__(self) -> str:
        return self.kind if self.arg is None else f"{self.kind}:{self.arg}"

    __repr__ = __str__  # as the flag spells it, in --dry-run and the effective config


def parse_fault(text: str) -> Fault:
    from kiln.obs.trace import STAGES

    kind, _, arg = str(text).strip().partition(":")
    if kind not in KINDS:
        raise BadValue(f"unknown fault {kind!r}; kinds: {', '.join(KINDS)}",
                       code="fault.unknown_kind")
    if kind == "startup":
        if arg not in STAGES[1:]:
            raise BadValue(f"startup:STAGE needs one of {', '.join(STAGES[1:])}, got {arg!r}",
                           code="fault.unknown_stage")
        return Fault(kind, arg)
    if kind == "kv_alloc" and not arg:
        return Fault(kind, 1)
    try:
        n = int(arg)
    except ValueError:
        raise BadValue(f"{kind}:N needs an integer N, got {arg!r}",
                       code="fault.not_an_integer") from None
    if n < (1 if kind == "kv_alloc" else 0):
        raise BadValue(f"{kind}:N needs N >= {1 if kind == 'kv_alloc' else 0}, got {n}",
                       code="fault.too_small")
    return Fault(kind, n)


def parse_faults(value: Any) -> tuple[Fault, ...]:
    """The setting's parser: a list (repeated flag, config file) or 'a,b' (env)."""
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    faults = tuple(f if isinstance(f, Fault) else parse_fault(f) for f in items if str(f))
    kinds = [f.kind for f in faults]
    dup = next((k for k in kinds if kinds.count(k) > 1), None)
    if dup:
        raise BadValue(f"fault {dup!r} given twice", code="fault.given_twice")
    return faults


class Faults:
    """The engine's view of the faults asked for; the engine holds None when there are none."""

    def __init__(self, faults: tuple[Fault, ...]) -> None:
        by = {f.kind: f.arg for f in faults}
        self.raise_after: int | None = by.get("step_raise")  # type: ignore[assignment]
        delay = by.get("step_delay_ms")
        self.delay_s = int(delay) / 1000.0 if delay is not None else 0.0
        self.kv_alloc: int | None = by.get("kv_alloc")  # type: ignore[assignment]
        self.drop_stream: int | None = by.get("drop_stream")  # type: ignore[assignment]
        self.startup: str | None = by.get("startup")  # type: ignore[assignment]

    @classmethod
    def of(cls, faults: tuple[Fault, ...] | None) -> Faults | None:
        return cls(faults) if faults else None

    def before_step(self, steps_done: int) -> None:
        """Called by the engine just before the model runs (after `steps_done` steps)."""
        if self.delay_s:
            import time

            time.sleep(self.delay_s)
        if self.raise_after is not None and steps_done >= self.raise_after:
            self.raise_after = None
            raise DiagnosticFault(f"model step {steps_done + 1} failed by --diagnostic-fault "
                                  f"step_raise:{steps_done}", code="fault.step_raise")

    def wrap_allocate(self, allocate: Callable[..., bool]) -> Callable[..., bool]:
        """The KV manager's allocate, failing (returning False, as when no block is free) on
        its `kv_alloc`-th call."""
        left = [self.kv_alloc]

        def allocate_with_fault(*a: Any, **kw: Any) -> bool:
            if left[0] is not None:
                left[0] -= 1
                if left[0] == 0:
                    left[0] = None
                    return False
            return allocate(*a, **kw)

        return allocate_with_fault

    def take_drop_stream(self) -> int | None:
        """The chunk count after which this stream is cut (the first stream that asks), or
        None."""
        n, self.drop_stream = self.drop_stream, None
        return n
