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
(`ToolCallStream`, kiln/server/tool_call_stream.py), a whole answer is one parse with
final=True, so the deltas a client assembles are the answer, by construction:

    text so far --parse--> Parsed(content, calls) --diff vs what was sent--> delta.content,
                                                                            delta.tool_calls

To keep the promise, text that may still turn into a call (a partial "<tool_call", an object
whose "name" has not arrived) is held back until it is decided; a call is sent from the moment its
name is known, its arguments as the model writes them (the raw JSON text, not re-serialized, so
streamed and whole answers carry the same string). Whitespace around calls is not content (the
content is stripped). A call whose JSON breaks after its name keeps what came before the break.
The scanning every format shares (where a JSON value ends, a call object as far as it goes,
when to hold) is kiln/server/tool_call_scan.py.

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
from collections.abc import Callable
from typing import Any

from kiln.server.tool_call_scan import (
    INCOMPLETE,
    CallBuilder,
    Parsed,
    ParsedCall,
    Step,
    array_calls,
    bare_call,
    call_object,
    held_prefix,
    skip_ws,
)

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
        out = CallBuilder()
        i, boundary = 0, True  # boundary: the message start or right after a call
        while i < len(text):
            if boundary:
                boundary = False
                step = bare_call(text, i, final, self.known, fenced=True)
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
                out.text(tail if final else tail[:len(tail) - held_prefix(tail, self.OPEN)])
                break
            out.text(text[i:j])
            k = skip_ws(text, j + len(self.OPEN))
            if k >= len(text):
                if not final:
                    return out.result()
                break  # a lone opening tag at the end: nothing to call
            step = (call_object(text, k, final, lambda _: True) if text[k] == "{"
                    else Step("none"))
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
        out = CallBuilder()
        i = skip_ws(text, 0)
        if not final and i < len(text) and self.TAG.startswith(text[i:]):
            return out.result()
        if text.startswith(self.TAG, i):
            i += len(self.TAG)
        first = True
        while True:
            step = bare_call(text, i, final, lambda _: True, fenced=False)
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
            j = skip_ws(text, step.next)
            if j >= len(text):
                return out.result()
            if text[j] != ";":
                out.text(text[j:])
                return out.result()
            i = j + 1


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
        out = CallBuilder()
        i = 0
        while i < len(text):
            j = text.find(self.MARK, i)
            if j < 0:
                tail = text[i:]
                out.text(tail if final else tail[:len(tail) - held_prefix(tail, self.MARK)])
                break
            out.text(text[i:j])
            k = skip_ws(text, j + len(self.MARK))
            if k >= len(text):
                break
            if text[k] == "[":
                nxt = array_calls(text, k, final, out)
            elif text[k] == "{":
                step = call_object(text, k, final, lambda _: True)
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
        i = skip_ws(text, 0)
        if i >= len(text):
            return Parsed("")
        if text[i] != "[":
            return self.fallback.parse(text, final) if self.fallback else Parsed(text.strip())
        out = CallBuilder()
        nxt = array_calls(text, i, final, out)
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
