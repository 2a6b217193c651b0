"""Typed errors. Each one carries what the user should do next."""

from __future__ import annotations

from typing import Any

from kiln.i18n import english, msg


class KilnError(Exception):
    """Base class: `str(err)` is a message a user can act on, in the CLI's language when the
    message and hint come from the catalogue (kiln/i18n/); `english()` is the same text for
    what machines read (effective config, API error bodies). `code` is what a program (and a
    test) matches instead of the wording: the one given, else the catalogue key of the message
    (`config.invalid_value`), the same in every language; None for a message in plain text.
    `causes` are the codes of the problems an error gathers into one message (the settings an
    engine cannot run, each a line of `handoff.cannot_run`), so a program sees each of them."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None, code: str | None = None,
                 causes: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self._code = code
        self.causes = causes

    @property
    def code(self) -> str | None:
        return self._code or getattr(self.message, "key", None)

    def __str__(self) -> str:
        return msg("error.hint", message=self.message, hint=self.hint) if self.hint else self.message

    def english(self) -> str:
        message = english(self.message)
        return f"{message}\n  hint: {english(self.hint)}" if self.hint else message


class BadValue(ValueError):
    """A setting's parser refusing a value, with the code of its reason (`fault.unknown_kind`):
    settings resolution wraps it in config.invalid_value and lists the code in `causes`, so a
    program sees which rule refused, as it does for the hand-off's problems."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code


def error_record(error: BaseException) -> dict[str, Any]:
    """What machines read of a failure (an effective config's `error`, `kiln pull --json`):
    its type, its code (None for an error kiln did not word), its English message, the codes of
    the problems it gathers (`causes`) where it has any, and the catalogue key of its advice
    (`hint_code`: which way out it gave, e.g. model.did_you_mean) where it has one."""
    out: dict[str, Any] = {"type": type(error).__name__, "code": getattr(error, "code", None),
                           "message": english(error)}
    causes = getattr(error, "causes", ())
    if causes:
        out["causes"] = list(causes)
    hint_code = getattr(getattr(error, "hint", None), "key", None)
    if hint_code:
        out["hint_code"] = hint_code
    return out


class ConfigError(KilnError):
    """A setting has a bad value, or two settings conflict."""


class ModelNotFoundError(KilnError):
    """MODEL names nothing kiln can find locally or download."""


class ModelLoadError(KilnError):
    """Weights or config could not be loaded (missing/unknown tensor, bad file)."""


class DeviceError(KilnError):
    """The requested device is not available or cannot run the requested dtype."""


class MemoryFitError(KilnError):
    """The model and its KV cache do not fit in the memory budget."""


class EngineNotFoundError(KilnError):
    """An external engine (vLLM, SGLang) is not installed or is too old."""


class DiagnosticFault(KilnError):
    """Raised by a fault injected with --diagnostic-fault (kiln/obs/faults.py), never by a real
    failure. Here with the other errors so that both places that raise it (the fault plan and
    the startup stages in kiln/obs/trace.py) import it from below, not from each other."""
