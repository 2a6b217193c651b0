"""Methods torch.compile must leave eager (`@eager_only`), marked without importing
torch._dynamo.

`torch.compiler.disable` imports torch._dynamo, and with it sympy and ~1,300 modules: ~1.4 s
and ~60 MiB of a server that never compiles (compile is off by default). `@eager_only` only
records the method; `apply_eager_marks()`, called by the compile path once it has imported
dynamo, wraps every recorded method in `torch.compiler.disable`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MARKED: list[tuple[type, str]] = []  # (class, method name), in definition order
_applied = False


class eager_only:  # (a class: its __set_name__ learns the method's class)
    """Records a method as one torch.compile must not trace (data-dependent control flow,
    host-side routing); the class gets the plain function back."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __set_name__(self, owner: type, name: str) -> None:
        _MARKED.append((owner, name))
        setattr(owner, name, self.fn)
        if _applied:  # a class defined after compile started
            _disable(owner, name)


def _disable(owner: type, name: str) -> None:
    import torch

    setattr(owner, name, torch.compiler.disable(getattr(owner, name)))


def apply_eager_marks() -> None:
    """Wraps each `@eager_only` method in torch.compiler.disable (once per process)."""
    global _applied
    if _applied:
        return
    _applied = True
    for owner, name in _MARKED:
        _disable(owner, name)
