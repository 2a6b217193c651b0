"""Reading tool-call objects out of generated text that may stop anywhere: the pieces every
format's parser (kiln/server/tool_parsers.py) is built from.

Just enough JSON to find where a value ends (`value_end`), a call object's "name" and
"arguments" as far as the text goes (`scan_call`), and the steps a parser takes at a position:
a call object (`call_object`), a bare or ```json-fenced one opening the message (`bare_call`), a
JSON array of them (`array_calls`). Each says "hold" while the text so far cannot decide, which
is what keeps a parse of a prefix a prefix of the whole parse (the promise the parsers make).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

# --------------------------------------------------------------------------- what a parse gives


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text; while streaming, a prefix of the final text


@dataclass
class Parsed:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)
    # content[:lead] was written before the first call (all of it while there is no call): the
    # Responses API puts the rest, text after the calls, in a message item after them.
    lead: int | None = None


# --------------------------------------------------------------------------- JSON scanning
# Just enough JSON to find where a value ends in text that may stop anywhere; json.loads decides
# validity of the pieces that matter (keys, the name).

INCOMPLETE = -1  # the text ends inside the value
ERROR = -2  # not JSON here

_WS = " \t\r\n"
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_STRUCT = re.compile(r'["{}\[\]]')
_SCALAR = re.compile(r"-?[0-9][0-9.eE+\-]*|true|false|null")


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def value_end(text: str, i: int) -> int:
    """Index just past the JSON value starting at text[i], INCOMPLETE or ERROR."""
    c = text[i]
    if c == '"':
        m = _STRING.match(text, i)
        return m.end() if m else INCOMPLETE
    if c in "{[":
        depth, j = 0, i
        while True:
            m = _STRUCT.search(text, j)
            if m is None:
                return INCOMPLETE
            if m.group() == '"':
                s = _STRING.match(text, m.start())
                if s is None:
                    return INCOMPLETE
                j = s.end()
                continue
            depth += 1 if m.group() in "{[" else -1
            j = m.end()
            if depth == 0:
                return j
    m = _SCALAR.match(text, i)
    if m is None:
        rest = text[i:]
        return INCOMPLETE if any(w.startswith(rest) for w in ("true", "false", "null")) else ERROR
    return INCOMPLETE if m.end() == len(text) else m.end()  # a number may go on


ARG_KEYS = ("arguments", "parameters")


@dataclass
class CallScan:
    """One call object {"name": ..., "arguments": ...} scanned as far as the text goes."""

    name: str | None = None
    args_start: int = -1  # where the arguments value starts (-1: not seen yet)
    args_end: int = INCOMPLETE
    end: int = INCOMPLETE  # past the closing brace (or where the JSON broke), or INCOMPLETE
    broken: bool = False  # not valid JSON from `end` on

    def arguments(self, text: str) -> str:
        """The arguments text so far: raw JSON for an object or array (a prefix while it is
        written), a string's decoded value or a scalar once complete, {} when the object closed
        without any."""
        if self.args_start < 0:
            return "{}" if self.end != INCOMPLETE else ""
        kind = text[self.args_start]
        if kind in "{[":
            return text[self.args_start:len(text) if self.args_end < 0 else self.args_end]
        if self.args_end < 0:
            return ""
        raw = text[self.args_start:self.args_end]
        if kind == '"':  # arguments given as a JSON string holding the JSON
            try:
                value = json.loads(raw)
            except ValueError:
                return raw
            return value if isinstance(value, str) else raw
        return raw


def scan_call(text: str, i: int) -> CallScan:
    """Scan the object at text[i] ("{") for its top-level "name" and "arguments" (or
    "parameters"); other keys are skipped."""
    sc = CallScan()

    def broke(at: int) -> CallScan:
        sc.end, sc.broken = at, True
        return sc

    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            return sc
        if text[j] == "}":
            sc.end = j + 1
            return sc
        if text[j] != '"':
            return broke(j)
        m = _STRING.match(text, j)
        if m is None:
            return sc
        try:
            key = json.loads(m.group())
        except ValueError:
            return broke(j)
        j = skip_ws(text, m.end())
        if j >= len(text):
            return sc
        if text[j] != ":":
            return broke(j)
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return sc
        e = value_end(text, j)
        if e == ERROR:
            return broke(j)
        if key == "name" and sc.name is None:
            if e == INCOMPLETE:
                return sc
            try:
                name = json.loads(text[j:e])
            except ValueError:
                return broke(j)
            if not isinstance(name, str):
                return broke(j)
            sc.name = name
        elif key in ARG_KEYS and sc.args_start < 0:
            sc.args_start, sc.args_end = j, e
        if e == INCOMPLETE:
            return sc
        j = skip_ws(text, e)
        if j >= len(text):
            return sc
        if text[j] == ",":
            j += 1
        elif text[j] == "}":
            sc.end = j + 1
            return sc
        else:
            return broke(j)


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class CallBuilder:
    """Collects content pieces and calls; the content is stripped (see the module doc)."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.calls: list[ParsedCall] = []
        self.lead = 0

    def text(self, s: str) -> None:
        self.pieces.append(s)

    def call(self, text: str, sc: CallScan) -> None:
        assert sc.name is not None
        if not self.calls:
            # The stripped content starts with the stripped text before the call (when any).
            self.lead = len("".join(self.pieces).strip())
        self.calls.append(ParsedCall(sc.name, sc.arguments(text)))

    def result(self) -> Parsed:
        content = "".join(self.pieces).strip()
        return Parsed(content, self.calls, self.lead if self.calls else None)


# Where a bare call object may start: fenced as ```json, or not.
_FENCE = re.compile(r"```(?:json)?[ \t]*\n?")
_FENCE_OPEN = "```json\n"


@dataclass
class Step:
    """The outcome of trying to read a call at some position."""

    kind: str  # "call" | "none" (not a call here) | "hold" (undecided: stop, send nothing more)
    next: int = 0  # for "call": where the text goes on (INCOMPLETE: the call is still written)
    scan: CallScan | None = None


def call_object(text: str, k: int, final: bool, accept: Callable[[str], bool]) -> Step:
    """A call object starting at text[k] ("{"), committed once its name is known and accepted."""
    sc = scan_call(text, k)
    if sc.name is None:
        return Step("hold") if sc.end == INCOMPLETE and not final else Step("none")
    if not accept(sc.name):
        return Step("none")
    return Step("call", sc.end, sc)


def bare_call(text: str, i: int, final: bool, accept: Callable[[str], bool],
               fenced: bool) -> Step:
    k = skip_ws(text, i)
    if k >= len(text):
        return Step("hold") if not final else Step("none")
    close_fence = False
    if fenced and text[k] == "`":
        if not final and _FENCE_OPEN.startswith(text[k:k + len(_FENCE_OPEN)]) and \
                len(text) - k < len(_FENCE_OPEN):
            return Step("hold")
        m = _FENCE.match(text, k)
        if m is None:
            return Step("none")
        k = skip_ws(text, m.end())
        if k >= len(text):
            return Step("hold") if not final else Step("none")
        close_fence = True
    if text[k] != "{":
        return Step("none")
    # Qwen2.5-Coder-1.5B, told "Use the tools to answer.", doubles the braces: {{"name": ...}}
    # (template syntax from its code data). The inner object is the call, the outer pair goes.
    inner = skip_ws(text, k + 1)
    doubled = inner < len(text) and text[inner] == "{"
    step = call_object(text, inner if doubled else k, final, accept)
    if step.kind == "call" and step.next >= 0 and doubled:
        j = skip_ws(text, step.next)
        if text.startswith("}", j):
            step.next = j + 1
        elif j >= len(text) and not final:
            step.next = len(text)  # the outer brace may still come
    if step.kind == "call" and step.next >= 0 and close_fence:
        j = skip_ws(text, step.next)
        if text.startswith("```", j):
            step.next = j + 3
        elif len(text) - j < 3 and "```".startswith(text[j:]):
            step.next = len(text)  # the fence being closed: nothing after it yet
    return step


def array_calls(text: str, i: int, final: bool, out: CallBuilder) -> int:
    """Calls in a JSON array starting at text[i] ("["): into `out`. Returns where the text goes
    on after the array, or INCOMPLETE (stop: undecided or still written)."""
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            return INCOMPLETE if not final else len(text)
        if text[j] == "]":
            return j + 1
        if text[j] == ",":
            j += 1
            continue
        if text[j] != "{":
            return j  # not a call: the rest is content
        step = call_object(text, j, final, lambda _: True)
        if step.kind == "hold":
            return INCOMPLETE
        if step.kind == "none":
            return j
        assert step.scan is not None
        out.call(text, step.scan)
        if step.next < 0:
            return INCOMPLETE
        j = step.next
