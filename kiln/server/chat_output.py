"""A chat choice's text as OpenAI's message: reasoning, content and tool calls, whole or as
stream deltas; and what a request's `tools` / `tool_choice` ask of the sampler.

    engine text --ReasoningParser--> reasoning_content | rest --tool parser--> content, tool_calls

One `ChoiceParser` per choice serves both the JSON answer (one `feed(text, final=True)`) and the
stream (a `feed` per engine step): the parsers promise that parses of a prefix are prefixes of the
whole (see kiln/server/tool_parsers.py), so the assembled deltas equal the answer.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from kiln.sampling_params import StructuredOutputsParams
from kiln.server import reasoning_parsers, tool_parsers
from kiln.server.reasoning_parsers import Reasoned, ReasoningParser
from kiln.server.request_params import strict_schema
from kiln.server.tool_call_stream import ToolCallStream
from kiln.server.tool_parsers import NamedParser, RequiredParser, SpecialId, ToolParser


@dataclass(frozen=True)
class ChatFormat:
    """The server's choices for chat output (settings tool_call_parser, enable_auto_tool_choice,
    reasoning_parser, enable_thinking), resolved: parser names or None."""

    tool_parser: str | None = None
    auto_tool_choice: bool = True
    reasoning_parser: str | None = None
    enable_thinking: bool | None = None  # None: the template's own default

    @classmethod
    def from_settings(cls, s: Any) -> ChatFormat:
        def name(key: str) -> str | None:
            v = s.get(key)
            return None if v in (None, "none", "auto") else v

        return cls(name("tool_call_parser"), bool(s.get("enable_auto_tool_choice", True)),
                   name("reasoning_parser"), s.get("enable_thinking"))


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    # The whole answer's (ChoiceParser.result): content[:lead] came before the first tool call.
    lead: int = 0


class ChoiceParser:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallStream | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.text = ""
        self.reasoning_sent = 0
        self.content_sent = 0
        self.result = ChatDelta()  # everything, once fed with final=True
        # Characters of the content (as parsed so far) written before the first tool call; None
        # while no call has been seen (all of it, so far).
        self.lead: int | None = None

    def feed(self, delta: str, final: bool) -> ChatDelta:
        self.text += delta
        r = self.reasoning.parse(self.text, final) if self.reasoning else Reasoned("", self.text)
        out = ChatDelta(reasoning=r.reasoning[self.reasoning_sent:])
        self.reasoning_sent = max(self.reasoning_sent, len(r.reasoning))
        if self.tools is not None:
            out.content, out.tool_calls = self.tools.update(r.content, final)
            self.lead = self.tools.lead
        else:
            out.content = r.content[self.content_sent:]
            self.content_sent = max(self.content_sent, len(r.content))
        if final:
            self.result = ChatDelta(r.reasoning, r.content, [])
            if self.tools is not None:
                assert self.tools.final is not None
                self.result.content = self.tools.final.content
                self.result.tool_calls = self.tools.tool_calls()
            self.result.lead = len(self.result.content) if self.lead is None else self.lead
        return out

    @property
    def called(self) -> bool:
        """Whether any tool call was sent (finish_reason "tool_calls")."""
        return self.tools is not None and bool(self.tools.sent)


# --------------------------------------------------------------------------- tool_choice


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function") or {}


def _params_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The function's parameters schema as the grammar enforces it: with OpenAI's
    `"strict": true` on the function, properties it does not list are forbidden (as for
    response_format's strict json_schema); without it, extra keys stay allowed, as in OpenAI's
    and vLLM's non-strict function calling."""
    params = copy.deepcopy(_function(tool).get("parameters") or {"type": "object"})
    return strict_schema(params) if _function(tool).get("strict") else params


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """tool_choice="required": a JSON array of {"name", "parameters"}, one entry per call, each
    naming an offered function with its parameters' schema (vLLM's shape). Each function's
    `$defs` move to the top, where their "#/$defs/..." references point."""
    defs: dict[str, Any] = {}
    options = []
    for tool in tools:
        params = _params_schema(tool)
        defs.update(params.pop("$defs", {}))
        options.append({"type": "object",
                        "properties": {"name": {"type": "string",
                                                "enum": [_function(tool).get("name")]},
                                       "parameters": params},
                        "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass
class ToolPlan:
    """What a request's tools ask for: the parser of its output, and the constraint (None: the
    model chooses freely)."""

    parser: ToolParser | None = None
    structured: StructuredOutputsParams | None = None
    max_calls: int | None = None


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               parallel_tool_calls: bool | None, fmt: ChatFormat,
               special: SpecialId | None = None) -> ToolPlan:
    """`tool_choice` (validated by the protocol) -> ToolPlan. auto (the default with tools):
    the server's parser reads whatever the model writes; required / a named function: the
    output is constrained by the grammar engine to calls in the server parser's own format
    (its wrapper around each function's arguments schema: what the model writes unconstrained,
    so it is not pushed off its training), at most one where parallel_tool_calls is false or a
    function is named, and read by that parser. Without a server parser, vLLM's shapes (see
    kiln/server/tool_parsers.py). `special`: a marker's special-token id (the grammar names
    special tokens by id)."""
    if not tools or tool_choice == "none":
        return ToolPlan()
    names = [_function(t).get("name", "") for t in tools]
    max_calls = 1 if parallel_tool_calls is False else None
    server = tool_parsers.PARSERS[fmt.tool_parser](names) if fmt.tool_parser else None
    if server is not None and (isinstance(tool_choice, dict) or tool_choice == "required"):
        chosen, calls = tools, max_calls
        if isinstance(tool_choice, dict):
            chosen = [t for t in tools
                      if _function(t).get("name") == tool_choice["function"]["name"]][:1]
            calls = 1
        grammar = server.call_grammar(
            [(_function(t).get("name", ""), _params_schema(t)) for t in chosen], calls, special)
        if grammar is not None:
            parser = type(server)([_function(t).get("name", "") for t in chosen])
            return ToolPlan(parser, StructuredOutputsParams(grammar=grammar), calls)
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        tool = next(t for t in tools if _function(t).get("name") == name)
        return ToolPlan(NamedParser(name), StructuredOutputsParams(json=_params_schema(tool)), 1)
    if tool_choice == "required":
        return ToolPlan(RequiredParser(names, fallback=server),
                        StructuredOutputsParams(json=required_schema(tools,
                                                                     max_calls is None)),
                        max_calls)
    # --no-enable-auto-tool-choice: the model may still call, but nothing reads its calls.
    return ToolPlan(server if fmt.auto_tool_choice else None, None, max_calls)


def reasoning_parser(fmt: ChatFormat, prompt_tail: str) -> ReasoningParser | None:
    if fmt.reasoning_parser is None:
        return None
    return reasoning_parsers.PARSERS[fmt.reasoning_parser](prompt_tail)
