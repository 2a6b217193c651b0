"""A tool parser's successive parses of the growing text as OpenAI stream deltas: content pieces
and delta.tool_calls entries. The parsers promise a parse of a prefix is a prefix of the whole
parse (kiln/server/tool_parsers.py), so the deltas, assembled, are the whole answer.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from kiln.server.tool_call_scan import Parsed
from kiln.server.tool_parsers import ToolParser


def new_call_id() -> str:
    """OpenAI-like tool call id: call_ and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


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
