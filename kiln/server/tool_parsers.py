"""Tool calls out of generated text: one parser per model family's format, chosen by
`--tool-call-parser` (auto: from the chat template).

    hermes       Hermes / Qwen2.5 / Qwen3: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
                 (also a bare or ```json-fenced call object opening the message, naming an offered
                 tool: small Qwen2.5 models often drop the tags, as llama.cpp's parser accepts;
                 and such an object in doubled braces, {{...}}, as Qwen2.5-Coder-1.5B writes it)
    llama3_json  Llama 3.x: the message is {"name": ..., "parameters": {...}}, several joined by ";"
                 (an optional <|python_tag|> first)
    mistral      Mistral: [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]

Every parser is one pure function of the text so far, `parse(text, final) -> Parsed`, with one
promise: what it returns for a prefix of the output (final=False) is a prefix of what it returns
for the whole (the content a prefix of the content, each call's name already final and its
arguments a prefix of the arguments). Streaming sends the difference between two parses
(`ToolCallStream`), a whole answer is one parse with final=True, so the deltas a client assembles
are the answer, by construction:

    text so far --parse--> Parsed(content, calls) --diff vs what was sent--> delta.content,
                                                                            delta.tool_calls

To keep the promise, text that may still turn into a call (a partial "<tool_call", an object
whose "name" has not arrived) is held back until it is decided; a call is sent from the moment its
name is known, its arguments as the model writes them (the raw JSON text, not re-serialized, so
streamed and whole answers carry the same string). Whitespace around calls is not content (the
content is stripped). A call whose JSON breaks after its name keeps what came before the break.

`tool_choice="required"` and a named function constrain the output to the calls in the model's
own format: each parser writes the grammar of its format (`ToolParser.call_grammar`: the wrapper,
tags or marker, and each offered function's {"name", arguments} object with the arguments' JSON
schema), so the model writes what it was trained to write and the same parser reads it (a model
that opens with its wrapper is not forced into bare arguments, where a schema field called `name`
would receive the function's name). Without a server parser (a template with no known tool format)
the output is vLLM's JSON shapes instead, an array of {"name", "parameters"} or the named function's
bare arguments, read by `RequiredParser` / `NamedParser`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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


def new_call_id() -> str:
    """OpenAI-like tool call id: call_ and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


# --------------------------------------------------------------------------- JSON scanning
# Just enough JSON to find where a value ends in text that may stop anywhere; json.loads decides
# validity of the pieces that matter (keys, the name).

INCOMPLETE = -1  # the text ends inside the value
ERROR = -2  # not JSON here

_WS = " \t\r\n"
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_STRUCT = re.compile(r'["{}\[\]]')
_SCALAR = re.compile(r"-?[0-9][0-9.eE+\-]*|true|false|null")


def _skip_ws(text: str, i: int) -> int:
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
        j = _skip_ws(text, j)
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
        j = _skip_ws(text, m.end())
        if j >= len(text):
            return sc
        if text[j] != ":":
            return broke(j)
        j = _skip_ws(text, j + 1)
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
        j = _skip_ws(text, e)
        if j >= len(text):
            return sc
        if text[j] == ",":
            j += 1
        elif text[j] == "}":
            sc.end = j + 1
            return sc
        else:
            return broke(j)


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class _Builder:
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
class _Step:
    """The outcome of trying to read a call at some position."""

    kind: str  # "call" | "none" (not a call here) | "hold" (undecided: stop, send nothing more)
    next: int = 0  # for "call": where the text goes on (INCOMPLETE: the call is still written)
    scan: CallScan | None = None


def _call_object(text: str, k: int, final: bool, accept: Callable[[str], bool]) -> _Step:
    """A call object starting at text[k] ("{"), committed once its name is known and accepted."""
    sc = scan_call(text, k)
    if sc.name is None:
        return _Step("hold") if sc.end == INCOMPLETE and not final else _Step("none")
    if not accept(sc.name):
        return _Step("none")
    return _Step("call", sc.end, sc)


def _bare_call(text: str, i: int, final: bool, accept: Callable[[str], bool],
               fenced: bool) -> _Step:
    k = _skip_ws(text, i)
    if k >= len(text):
        return _Step("hold") if not final else _Step("none")
    close_fence = False
    if fenced and text[k] == "`":
        if not final and _FENCE_OPEN.startswith(text[k:k + len(_FENCE_OPEN)]) and \
                len(text) - k < len(_FENCE_OPEN):
            return _Step("hold")
        m = _FENCE.match(text, k)
        if m is None:
            return _Step("none")
        k = _skip_ws(text, m.end())
        if k >= len(text):
            return _Step("hold") if not final else _Step("none")
        close_fence = True
    if text[k] != "{":
        return _Step("none")
    # Qwen2.5-Coder-1.5B, told "Use the tools to answer.", doubles the braces: {{"name": ...}}
    # (template syntax from its code data). The inner object is the call, the outer pair goes.
    inner = _skip_ws(text, k + 1)
    doubled = inner < len(text) and text[inner] == "{"
    step = _call_object(text, inner if doubled else k, final, accept)
    if step.kind == "call" and step.next >= 0 and doubled:
        j = _skip_ws(text, step.next)
        if text.startswith("}", j):
            step.next = j + 1
        elif j >= len(text) and not final:
            step.next = len(text)  # the outer brace may still come
    if step.kind == "call" and step.next >= 0 and close_fence:
        j = _skip_ws(text, step.next)
        if text.startswith("```", j):
            step.next = j + 3
        elif len(text) - j < 3 and "```".startswith(text[j:]):
            step.next = len(text)  # the fence being closed: nothing after it yet
    return step


# --------------------------------------------------------------------------- the parsers


# A function a constrained call may name: (name, its arguments' JSON schema).
Function = tuple[str, dict[str, Any]]
# A special token's id by its text (None: not one token of the vocabulary, or not special).
SpecialId = Callable[[str], "int | None"]


def _call_rules(functions: list[Function], args_key: str) -> list[str]:
    """Lark rules `call_<i>` (one call object per function, {"name": const, args_key: schema},
    the keys in that order) and `call` (any of them). Each function is its own %json grammar, so
    its `$defs` stay at the root its "#/$defs/..." references point to, and two functions' defs
    of one name do not collide."""
    from kiln.engine.structured import JSON_DEFAULTS

    rules = []
    for i, (name, params) in enumerate(functions):
        params = dict(params)
        defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
        schema = {"type": "object", "properties": {"name": {"const": name}, args_key: params},
                  "required": ["name", args_key], "additionalProperties": False,
                  # the same JSON layout as response_format's (one line, ", " and ": ")
                  "x-guidance": JSON_DEFAULTS, **defs}
        rules.append(f"call_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(functions))))
    return rules


def _calls(item: str, sep: str, max_calls: int | None) -> str:
    """One `item`, or (max_calls None) one or more joined by `sep`."""
    return item if max_calls == 1 else f"{item} ({json.dumps(sep)} {item})*"


def _marker(text: str, special: SpecialId | None) -> str:
    """A format's marker in Lark: the special token by id (special tokens are never matched as
    text), else the literal."""
    tid = special(text) if special is not None else None
    return f"<[{tid}]>" if tid is not None else json.dumps(text)


class ToolParser:
    """Base: `tool_names` are the request's tools (a bare call must name one of them)."""

    name = ""
    # The format's markers are special tokens in some tokenizers ([TOOL_CALLS], <tool_call> in
    # Hermes 2 Pro): keep them in the text, or the parser never sees them (vLLM does the same).
    keep_special_tokens = True

    def __init__(self, tool_names: list[str] | None = None) -> None:
        self.tool_names = set(tool_names or [])

    def known(self, name: str) -> bool:
        return name in self.tool_names

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def call_grammar(self, functions: list[Function], max_calls: int | None,
                     special: SpecialId | None = None) -> str | None:
        """The Lark grammar (llguidance's dialect) of output that is only calls to `functions`
        in this format: exactly one when `max_calls` is 1, else one or more. None: the format
        has no grammar here."""
        return None


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def call_grammar(self, functions: list[Function], max_calls: int | None,
                     special: SpecialId | None = None) -> str | None:
        # As Qwen's and Hermes' templates teach it: <tool_call>\n{"name": ..., "arguments":
        # {...}}\n</tool_call>, one block per call, a newline between blocks.
        block = f'{_marker(self.OPEN, special)} "\\n" call "\\n" {_marker(self.CLOSE, special)}'
        return "\n".join(["start: " + _calls("block", "\n", max_calls), f"block: {block}",
                          *_call_rules(functions, "arguments")])

    def parse(self, text: str, final: bool) -> Parsed:
        out = _Builder()
        i, boundary = 0, True  # boundary: the message start or right after a call
        while i < len(text):
            if boundary:
                boundary = False
                step = _bare_call(text, i, final, self.known, fenced=True)
                if step.kind == "hold":
                    return out.result()
                if step.kind == "call":
                    assert step.scan is not None
                    out.call(text, step.scan)
                    if step.next < 0:
                        return out.result()
                    i, boundary = step.next, True
                    continue
            j = text.find(self.OPEN, i)
            if j < 0:
                tail = text[i:]
                out.text(tail if final else tail[:len(tail) - _held_prefix(tail, self.OPEN)])
                break
            out.text(text[i:j])
            k = _skip_ws(text, j + len(self.OPEN))
            if k >= len(text):
                if not final:
                    return out.result()
                break  # a lone opening tag at the end: nothing to call
            step = (_call_object(text, k, final, lambda _: True) if text[k] == "{"
                    else _Step("none"))
            if step.kind == "hold":
                return out.result()
            if step.kind == "none":
                out.text(self.OPEN)
                i = j + len(self.OPEN)
                continue
            assert step.scan is not None
            out.call(text, step.scan)
            if step.next < 0:
                return out.result()
            # Anything between the object and the closing tag is dropped with the tag.
            e = text.find(self.CLOSE, step.next)
            if e < 0:
                return out.result()
            i, boundary = e + len(self.CLOSE), True
        return out.result()


class Llama3JsonParser(ToolParser):
    """The whole message is the calls, or it is content (vLLM's llama3_json)."""

    name = "llama3_json"
    keep_special_tokens = False  # <|python_tag|> may go; the JSON is what counts
    TAG = "<|python_tag|>"

    def call_grammar(self, functions: list[Function], max_calls: int | None,
                     special: SpecialId | None = None) -> str | None:
        # Llama 3.x's JSON calls: {"name": ..., "parameters": {...}}, several joined by "; ".
        return "\n".join([f"start: {_calls('call', '; ', max_calls)}",
                          *_call_rules(functions, "parameters")])

    def parse(self, text: str, final: bool) -> Parsed:
        out = _Builder()
        i = _skip_ws(text, 0)
        if not final and i < len(text) and self.TAG.startswith(text[i:]):
            return out.result()
        if text.startswith(self.TAG, i):
            i += len(self.TAG)
        first = True
        while True:
            step = _bare_call(text, i, final, lambda _: True, fenced=False)
            if step.kind == "hold":
                return out.result()
            if step.kind == "none":
                if first:
                    out.text(text)  # not a call: everything is content
                else:
                    out.text(text[i:])
                return out.result()
            assert step.scan is not None
            out.call(text, step.scan)
            first = False
            if step.next < 0:
                return out.result()
            j = _skip_ws(text, step.next)
            if j >= len(text):
                return out.result()
            if text[j] != ";":
                out.text(text[j:])
                return out.result()
            i = j + 1


def _array_calls(text: str, i: int, final: bool, out: _Builder) -> int:
    """Calls in a JSON array starting at text[i] ("["): into `out`. Returns where the text goes
    on after the array, or INCOMPLETE (stop: undecided or still written)."""
    j = i + 1
    while True:
        j = _skip_ws(text, j)
        if j >= len(text):
            return INCOMPLETE if not final else len(text)
        if text[j] == "]":
            return j + 1
        if text[j] == ",":
            j += 1
            continue
        if text[j] != "{":
            return j  # not a call: the rest is content
        step = _call_object(text, j, final, lambda _: True)
        if step.kind == "hold":
            return INCOMPLETE
        if step.kind == "none":
            return j
        assert step.scan is not None
        out.call(text, step.scan)
        if step.next < 0:
            return INCOMPLETE
        j = step.next


class MistralParser(ToolParser):
    name = "mistral"
    MARK = "[TOOL_CALLS]"

    def call_grammar(self, functions: list[Function], max_calls: int | None,
                     special: SpecialId | None = None) -> str | None:
        # [TOOL_CALLS] then one JSON array of {"name": ..., "arguments": {...}} objects.
        calls = _calls("call", ", ", max_calls)
        return "\n".join([f'start: {_marker(self.MARK, special)} "[" {calls} "]"',
                          *_call_rules(functions, "arguments")])

    def parse(self, text: str, final: bool) -> Parsed:
        out = _Builder()
        i = 0
        while i < len(text):
            j = text.find(self.MARK, i)
            if j < 0:
                tail = text[i:]
                out.text(tail if final else tail[:len(tail) - _held_prefix(tail, self.MARK)])
                break
            out.text(text[i:j])
            k = _skip_ws(text, j + len(self.MARK))
            if k >= len(text):
                break
            if text[k] == "[":
                nxt = _array_calls(text, k, final, out)
            elif text[k] == "{":
                step = _call_object(text, k, final, lambda _: True)
                if step.kind == "call":
                    assert step.scan is not None
                    out.call(text, step.scan)
                nxt = step.next if step.kind == "call" else (
                    INCOMPLETE if step.kind == "hold" else k)
            else:
                nxt = k
            if nxt < 0:
                break
            i = nxt
        return out.result()


class RequiredParser(ToolParser):
    """tool_choice="required": the output is constrained to [{"name": ..., "parameters": ...},
    ...]. Unconstrained output that is not an array goes to the server's parser (`fallback`)."""

    name = "required"

    def __init__(self, tool_names: list[str] | None = None,
                 fallback: ToolParser | None = None) -> None:
        super().__init__(tool_names)
        self.fallback = fallback

    def parse(self, text: str, final: bool) -> Parsed:
        i = _skip_ws(text, 0)
        if i >= len(text):
            return Parsed("")
        if text[i] != "[":
            return self.fallback.parse(text, final) if self.fallback else Parsed(text.strip())
        out = _Builder()
        nxt = _array_calls(text, i, final, out)
        if nxt >= 0:
            out.text(text[nxt:])
        return out.result()


class NamedParser(ToolParser):
    """tool_choice naming a function: the whole output is its arguments (constrained to its
    parameters' schema)."""

    name = "named"

    def __init__(self, function: str) -> None:
        super().__init__([function])
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        # Stripping is stable under growth: leading whitespace is never arguments, trailing
        # whitespace is held until something follows it.
        return Parsed("", [ParsedCall(self.function, text.strip())])


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def choose_for_template(template: str | None) -> tuple[str, str]:
    """`--tool-call-parser auto`: (parser name or "none", why), from the chat template text."""
    if not template:
        return "none", "the model has no chat template"
    if "<tool_call>" in template:
        return "hermes", "the chat template writes tool calls as <tool_call> JSON (Hermes / Qwen)"
    if "[TOOL_CALLS]" in template:
        return "mistral", "the chat template writes tool calls after [TOOL_CALLS] (Mistral)"
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return "llama3_json", "the chat template is Llama 3's (ipython role, JSON calls)"
    return "none", "the chat template shows no tool-call format kiln knows"


# --------------------------------------------------------------------------- streaming


@dataclass
class _Sent:
    id: str
    name: str
    args: int = 0  # characters of the arguments already sent


class ToolCallStream:
    """Turns successive parses of the growing text into OpenAI deltas: content pieces and
    delta.tool_calls entries ({index, id, type, function: {name, arguments: ""}} when a call
    starts, then {index, function: {arguments: piece}})."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls  # parallel_tool_calls=false: 1
        self.content_sent = 0
        self.sent: list[_Sent] = []
        self.final: Parsed | None = None
        self.lead: int | None = None  # the latest parse's (None: no call yet)

    def update(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        parsed = self.parser.parse(text, final)
        if self.max_calls is not None:
            parsed.calls = parsed.calls[:self.max_calls]
        if final:
            self.final = parsed
        self.lead = (parsed.lead or 0) if parsed.calls else None
        content = parsed.content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(parsed.content))
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(parsed.calls):
            if index == len(self.sent):
                self.sent.append(_Sent(new_call_id(), call.name))
                deltas.append({"index": index, "id": self.sent[index].id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            s = self.sent[index]
            piece = call.arguments[s.args:]
            if piece:
                s.args = len(call.arguments)
                if deltas and deltas[-1]["index"] == index:
                    deltas[-1]["function"]["arguments"] += piece
                else:
                    deltas.append({"index": index, "function": {"arguments": piece}})
        return content, deltas

    def tool_calls(self) -> list[dict[str, Any]]:
        """The final calls, in OpenAI's message shape, with the ids the stream used."""
        assert self.final is not None
        while len(self.sent) < len(self.final.calls):
            self.sent.append(_Sent(new_call_id(), self.final.calls[len(self.sent)].name))
        return [{"id": s.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for s, c in zip(self.sent, self.final.calls, strict=False)]
