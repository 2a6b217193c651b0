"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the chat path.

    request --chat_request--> a chat completion request (input items -> messages after the
      stored conversation of previous_response_id and `instructions` as the first system
      message; function tools, tool_choice, text.format -> response_format)
      --routes/chat.prepare_chat--> the prompt, SamplingParams and tool plan chat completions
      makes of it (the same token ids, special-token handling and tool-choice grammar)
      --> one engine request --> the chat parser (reasoning, content, tool calls)
      --> OutputItems: a `response` object, or its stream of typed SSE events

Finished responses are kept in memory (`ResponseStore`, least recently used go first, at most
--responses-store-size) with the conversation that led to them, so a later request can continue
it by `previous_response_id` (its `instructions` are not carried over, as at OpenAI).
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from kiln.engine.output import CompletionOutput, RequestOutput
from kiln.server.chat_output import ChoiceParser
from kiln.server.errors import APIError
from kiln.server.protocol import (
    ChatCompletionRequest,
    JsonSchemaFormat,
    ResponseFormat,
    template_tool_call,
)
from kiln.server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputTokensDetails,
    OutputText,
    OutputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from kiln.server.routes.chat import prepare_chat
from kiln.server.serving import Outputs, PromptSpec, Serving

# Errors name the Responses' own fields, not the chat request they are checked as.
_PARAM_NAMES = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                "messages": "input", "response_format": "text"}


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as GET returns it
    messages: list[dict[str, Any]]  # its conversation (no instructions), its output included


class ResponseStore:
    """Finished responses by id, least recently used evicted past `max_entries`."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def put(self, response_id: str, item: StoredResponse) -> None:
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param=param,
                    code="response_not_found")


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """This request's input as chat-template messages: a string is one user message; a
    function_call joins the assistant message before it (or starts one), a function_call_output
    is a `role: tool` message."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict[str, Any]] = []
    for item in req.input:
        if isinstance(item, FunctionCallItem):
            call = template_tool_call({"id": item.call_id, "type": "function", "function": {
                "name": item.name, "arguments": item.arguments}})
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        else:  # chat templates predate "developer"
            out.append({"role": "system" if item.role == "developer" else item.role,
                        "content": item.text()})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses' flat {"type": "function", "name": ...} as chat's nested shape; strings and
    anything else as sent (the chat request's validation says what is wrong with them)."""
    if isinstance(choice, dict) and "function" not in choice and "name" in choice:
        return {"type": choice.get("type"), "function": {"name": choice["name"]}}
    return choice


def chat_request(req: ResponsesRequest, conversation: list[dict[str, Any]]
                 ) -> ChatCompletionRequest:
    """The chat completion request this Responses request is: `instructions` as the first
    system message before `conversation`, the flat function tools in chat's shape, tool_choice,
    parallel_tool_calls, text.format as response_format (so `strict` means what it means
    there) and the sampling fields. The one conversion: what it gives is prepared and parsed
    by the chat endpoint's code, so both endpoints render the same prompt for it."""
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
        raise APIError(400, "text.format of type json_schema needs a `schema`",
                       param="text", code="invalid_value")
    response_format = None if fmt is None else ResponseFormat(
        type=fmt.type, json_schema=JsonSchemaFormat(
            name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict)
        if fmt.type == "json_schema" else None)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []
                ) + conversation
    try:
        return ChatCompletionRequest(
            messages=messages, model=req.model, temperature=req.temperature, top_p=req.top_p,
            max_completion_tokens=req.max_output_tokens, seed=req.seed, top_k=req.top_k,
            min_p=req.min_p, repetition_penalty=req.repetition_penalty, user=req.user,
            response_format=response_format, stream=req.stream,
            tools=[t.chat_tool() for t in req.tools] if req.tools else None,
            tool_choice=_chat_tool_choice(req.tool_choice),
            parallel_tool_calls=req.parallel_tool_calls)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err.get("loc") else None
        raise APIError(400, f"invalid request: {err.get('msg')}",
                       param=_PARAM_NAMES.get(field or "", field), code="invalid_value") from e


def _usage(outs: Outputs) -> ResponseUsage:
    u = outs.usage()
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return ResponseUsage(input_tokens=u.prompt_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=cached),
                         output_tokens=u.completion_tokens,
                         output_tokens_details=OutputTokensDetails(),
                         total_tokens=u.total_tokens)


# event(type, **fields) -> the event's JSON text (numbered in order)
Emit = Callable[..., str]


class OutputItems:
    """A response's output items, from the chat endpoint's reading of the generated text
    (ChoiceParser: reasoning, content, tool calls), in this order:

        [reasoning]  [message: the text before any call]  function_call ...  [message: text
        written after the calls]      (an empty message when there is nothing else)

    Fed once with the whole text (a JSON answer) or once per engine step (a stream: `feed`
    returns the step's events, ordered as OpenAI sends them: an item is added, its deltas
    follow, it is done before the next one is added; a call's arguments arrive as
    function_call_arguments deltas, never as output_text). The parser's reads of a prefix are
    prefixes of its read of the whole, so both give the same items; text after the calls is
    held to the end, where the whole answer has it too."""

    def __init__(self, parser: ChoiceParser, emit: Emit | None = None) -> None:
        self.parser = parser
        self.emit = emit
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written (the last one)
        self.content_seen = 0  # characters of content the parser has given so far
        self.trail = ""  # content after the first call, held to the end
        self.calls: dict[int, dict[str, Any]] = {}  # the parser's call index -> its item
        self.events: list[str] = []

    def _event(self, type_: str, **fields: Any) -> None:
        if self.emit is not None:
            self.events.append(self.emit(type_, **fields))

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        index = next(i for i, x in enumerate(self.items) if x is item)
        return {"item_id": item["id"], "output_index": index}

    def _add(self, item: dict[str, Any]) -> dict[str, Any]:
        self._close("completed")
        self.items.append(item)
        self.open = item
        self._event("response.output_item.added", output_index=len(self.items) - 1,
                    item=copy.deepcopy(item))
        if item["type"] in ("message", "reasoning"):
            self._event("response.content_part.added", **self._where(item), content_index=0,
                        part=_part(item["type"], ""))
        return item

    def _close(self, status: str) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        where = self._where(item)
        if item["type"] == "function_call":
            self._event("response.function_call_arguments.done", **where,
                        arguments=item["arguments"])
        else:
            text = item["content"][0]["text"]
            done = ("response.output_text.done" if item["type"] == "message"
                    else "response.reasoning_text.done")
            self._event(done, **where, content_index=0, text=text,
                        **({"logprobs": []} if item["type"] == "message" else {}))
            self._event("response.content_part.done", **where, content_index=0,
                        part=_part(item["type"], text))
        item["status"] = status
        self._event("response.output_item.done", output_index=where["output_index"],
                    item=copy.deepcopy(item))

    def _text(self, kind: str, piece: str) -> None:
        if not piece:
            return
        item = self.open
        if item is None or item["type"] != kind:
            item = self._add(_text_item(kind))
        item["content"][0]["text"] += piece
        delta = ("response.output_text.delta" if kind == "message"
                 else "response.reasoning_text.delta")
        self._event(delta, **self._where(item), content_index=0, delta=piece,
                    **({"logprobs": []} if kind == "message" else {}))

    def feed(self, text: str, final: bool, status: str = "completed") -> list[str]:
        """Reads `text` (the output's next piece); on the last piece (`final`) closes the
        items, the last with `status`. Returns the events this piece made (none without
        `emit`)."""
        d = self.parser.feed(text, final)
        self._text("reasoning", d.reasoning)
        lead = self.parser.lead
        k = len(d.content) if lead is None else max(0, lead - self.content_seen)
        self.content_seen += len(d.content)
        self._text("message", d.content[:k])
        self.trail += d.content[k:]
        for c in d.tool_calls:
            item = self.calls.get(c["index"])
            if item is None:
                item = self.calls[c["index"]] = self._add({
                    "id": f"fc_{uuid.uuid4().hex}", "type": "function_call",
                    "call_id": c["id"], "name": c["function"]["name"], "arguments": "",
                    "status": "in_progress"})
            piece = c["function"].get("arguments") or ""
            if piece:
                item["arguments"] += piece
                self._event("response.function_call_arguments.delta", **self._where(item),
                            delta=piece)
        if final:
            self._text("message", self.trail.strip())
            if not any(i["type"] != "reasoning" for i in self.items):
                self._add(_text_item("message"))  # OpenAI always answers with an item
            self._close(status)
        events, self.events = self.events, []
        return events


def _text_item(kind: str) -> dict[str, Any]:
    prefix = "msg" if kind == "message" else "rs"
    item: dict[str, Any] = {"id": f"{prefix}_{uuid.uuid4().hex}", "type": kind,
                            "status": "in_progress", "content": [_part(kind, "")]}
    if kind == "message":
        item["role"] = "assistant"
    else:
        item["summary"] = []
    return item


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return OutputText(text=text).model_dump(mode="json")
    return {"type": "reasoning_text", "text": text}


class _Turn:
    """One /v1/responses request: its ids, conversation and the response object it becomes."""

    def __init__(self, store: ResponseStore, req: ResponsesRequest, model: str,
                 conversation: list[dict[str, Any]]) -> None:
        self.store, self.req, self.model = store, req, model
        self.conversation = conversation
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def response(self, status: str, output: list[dict[str, Any]],
                 usage: ResponseUsage | None = None, incomplete: bool = False) -> ResponseObject:
        req = self.req
        text = req.text.model_dump(mode="json", by_alias=True) if req.text else None
        return ResponseObject(
            id=self.id, created_at=self.created, status=status, model=self.model,
            output=output,  # type: ignore[arg-type]  # validated into the item models
            usage=usage, instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id, temperature=req.temperature,
            top_p=req.top_p, tools=[t.model_dump(mode="json") for t in req.tools or []],
            tool_choice=req.tool_choice or "auto",
            parallel_tool_calls=req.parallel_tool_calls is not False,
            text=text or {"format": {"type": "text"}},
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            metadata=req.metadata or {}, store=req.store, user=req.user)

    def finish(self, co: CompletionOutput, items: OutputItems, usage: ResponseUsage
               ) -> ResponseObject:
        """The finished response (stored when `store`); `co` is the choice's final output,
        `items` its output, fed to the end."""
        incomplete = co.finish_reason in ("length", "abort")
        resp = self.response("incomplete" if incomplete else "completed", items.items, usage,
                             incomplete)
        if self.req.store:
            calls = [template_tool_call({"id": i["call_id"], "type": "function", "function": {
                "name": i["name"], "arguments": i["arguments"]}})
                for i in items.items if i["type"] == "function_call"]
            said: dict[str, Any] = {"role": "assistant",
                                    "content": items.parser.result.content}
            if calls:
                said["tool_calls"] = calls
            self.store.put(self.id, StoredResponse(resp.model_dump(mode="json"),
                                                   [*self.conversation, said]))
        return resp


async def create_response(sv: Serving, store: ResponseStore, req: ResponsesRequest,
                          request: Request) -> Any:
    model = sv.check_model(req.model)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        history = prev.messages
    conversation = [*history, *input_messages(req)]
    try:
        run = await prepare_chat(sv, chat_request(req, conversation))
    except APIError as e:  # errors name the Responses' own fields
        e.param = _PARAM_NAMES.get(e.param or "", e.param)
        raise
    turn = _Turn(store, req, model, conversation)
    session = request.headers.get("x-session-id") or req.user
    spec = PromptSpec(turn.id, run.prompt_ids, run.params, session_id=session)
    outs = await sv.start(request, [spec], body=req)

    def status(co: CompletionOutput) -> str:
        return "incomplete" if co.finish_reason in ("length", "abort") else "completed"

    if not req.stream:
        (co,) = (await sv.collect(request, outs))[0].outputs
        items = OutputItems(run.choice_parser())
        items.feed(co.text, True, status(co))
        return JSONResponse(turn.finish(co, items, _usage(outs)).model_dump(mode="json"))

    seq = 0

    def event(type_: str, **fields: Any) -> str:
        # "type" first: _frame reads the SSE event name off the front of the JSON text.
        nonlocal seq
        body = {"type": type_, "sequence_number": seq, **fields}
        seq += 1
        return _json(body)

    items = OutputItems(run.choice_parser(), event)
    started = turn.response("in_progress", []).model_dump(mode="json")
    first = [event("response.created", response=started),
             event("response.in_progress", response=started)]

    def render(_: PromptSpec, __: RequestOutput, co: CompletionOutput) -> list[str]:
        out = items.feed(co.text, co.finished, status(co))
        if co.finished:
            resp = turn.finish(co, items, _usage(outs))
            done = "response.incomplete" if resp.status == "incomplete" else "response.completed"
            out.append(event(done, response=resp.model_dump(mode="json")))
        return out

    return sv.stream_response(request, outs, render, first, lambda: None, frame=_frame,
                              done=False)


def _json(body: dict[str, Any]) -> str:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


def _frame(chunk: str) -> str:
    """An SSE event named by its type, as OpenAI sends them (an error object: `error`)."""
    prefix = '{"type":"'
    name = chunk[len(prefix):chunk.index('"', len(prefix))] if chunk.startswith(prefix) \
        else "error"
    return f"event: {name}\ndata: {chunk}\n\n"


def router(sv: Serving, store: ResponseStore) -> APIRouter:
    """Under /v1, behind the API key."""
    r = APIRouter()

    @r.post("/responses")
    async def responses(req: ResponsesRequest, request: Request) -> Any:
        return await create_response(sv, store, req, request)

    @r.get("/responses/{response_id}")
    async def get_response(response_id: str) -> Any:
        item = store.get(response_id)
        if item is None:
            raise not_found(response_id)
        return JSONResponse(item.response)

    return r
