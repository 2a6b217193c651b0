"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the chat path.

    input items --> chat messages (+ the stored conversation of previous_response_id, and
      `instructions` as the first system message) --> Serving.chat_prompt (the chat template)
      --> one engine request --> a `response` object, or its stream of typed SSE events

Finished responses are kept in memory (`ResponseStore`, least recently used go first, at most
--responses-store-size) with the conversation that led to them, so a later request can continue
it by `previous_response_id` (its `instructions` are not carried over, as at OpenAI).
"""

from __future__ import annotations

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

from kiln.sampling_params import SamplingParams
from kiln.server.chat_output import plan_tools
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
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from kiln.server.serving import ChoiceEvent, ChoiceSpec, Serving
from kiln.server.tool_parsers import ToolCallStream

# Tool calls: (the generated text, the request's tools in chat's shape) -> the text left for the
# message and the calls found, each (name, arguments JSON). By default the chat endpoint's parser
# (`_tool_extractor`); without one, every output is a message.
ToolCallExtractor = Callable[[str, list[dict[str, Any]]], tuple[str, list[tuple[str, str]]]]

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


def _sampling_params(sv: Serving, req: ResponsesRequest, messages: list[dict[str, Any]],
                     prompt_len: int) -> SamplingParams:
    """The chat endpoint's translation (ranges, context length, caps), text.format going in as
    its response_format (so `strict` means what it means there)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
        raise APIError(400, "text.format of type json_schema needs a `schema`",
                       param="text", code="invalid_value")
    response_format = None if fmt is None else ResponseFormat(
        type=fmt.type, json_schema=JsonSchemaFormat(
            name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict)
        if fmt.type == "json_schema" else None)
    try:
        chat = ChatCompletionRequest(
            messages=messages, model=req.model, temperature=req.temperature, top_p=req.top_p,
            max_completion_tokens=req.max_output_tokens, seed=req.seed, top_k=req.top_k,
            min_p=req.min_p, repetition_penalty=req.repetition_penalty, user=req.user,
            response_format=response_format)
    except ValidationError as e:  # the fields were validated already; a 400 all the same
        raise APIError(400, f"invalid request: {e.errors()[0].get('msg')}",
                       code="invalid_value") from e
    try:
        sv.check_limits(chat)
        return sv.params_for(chat, prompt_len)
    except APIError as e:
        e.param = _PARAM_NAMES.get(e.param or "", e.param)
        raise


def _usage(prompt_len: int, ev: ChoiceEvent) -> ResponseUsage:
    return ResponseUsage(input_tokens=prompt_len,
                         input_tokens_details=InputTokensDetails(cached_tokens=ev.num_cached_tokens),
                         output_tokens=ev.num_output_tokens,
                         output_tokens_details=OutputTokensDetails(),
                         total_tokens=prompt_len + ev.num_output_tokens)


class _Turn:
    """One /v1/responses request: its ids, conversation and the response object it becomes."""

    def __init__(self, sv: Serving, store: ResponseStore, req: ResponsesRequest, model: str,
                 conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 prompt_len: int, extract: ToolCallExtractor | None) -> None:
        self.sv, self.store, self.req, self.model = sv, store, req, model
        self.conversation = conversation
        self.tools = tools
        self.prompt_len = prompt_len
        self.extract = extract
        self.id = f"resp_{uuid.uuid4().hex}"
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def response(self, status: str, output: list[OutputItem], usage: ResponseUsage | None = None,
                 incomplete: bool = False) -> ResponseObject:
        req = self.req
        text = req.text.model_dump(mode="json", by_alias=True) if req.text else None
        return ResponseObject(
            id=self.id, created_at=self.created, status=status, model=self.model, output=output,
            usage=usage, instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id, temperature=req.temperature,
            top_p=req.top_p, tools=[t.model_dump(mode="json") for t in req.tools or []],
            tool_choice=req.tool_choice or "auto",
            parallel_tool_calls=req.parallel_tool_calls is not False,
            text=text or {"format": {"type": "text"}},
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            metadata=req.metadata or {}, store=req.store, user=req.user)

    def message(self, text: str, status: str) -> OutputMessage:
        return OutputMessage(id=self.msg_id, status=status, content=[OutputText(text=text)])

    def finish(self, ev: ChoiceEvent) -> ResponseObject:
        """The finished response (stored when `store`); `ev` is the choice's joined output."""
        incomplete = ev.finish_reason in ("length", "abort")
        status = "incomplete" if incomplete else "completed"
        text, calls = ev.text, []
        if self.tools and self.extract is not None:
            text, calls = self.extract(ev.text, self.tools)
        output: list[OutputItem] = []
        if text or not calls:
            output.append(self.message(text, status))
        for name, arguments in calls:
            output.append(OutputFunctionCall(id=f"fc_{uuid.uuid4().hex}",
                                             call_id=f"call_{uuid.uuid4().hex[:24]}", name=name,
                                             arguments=arguments))
        resp = self.response(status, output, _usage(self.prompt_len, ev), incomplete)
        if self.req.store:
            said: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                said["tool_calls"] = [template_tool_call({"id": c.call_id, "type": "function",
                                                          "function": {"name": c.name,
                                                                       "arguments": c.arguments}})
                                      for c in output if isinstance(c, OutputFunctionCall)]
            self.store.put(self.id, StoredResponse(resp.model_dump(mode="json"),
                                                   [*self.conversation, said]))
        return resp


async def create_response(sv: Serving, store: ResponseStore, req: ResponsesRequest,
                          request: Request, extract: ToolCallExtractor | None = None) -> Any:
    model = sv.check_model(req.model)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        history = prev.messages
    conversation = [*history, *input_messages(req)]
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []
                ) + conversation
    tools = ([t.chat_tool() for t in req.tools]
             if req.tools and req.tool_choice != "none" else None)
    prompt_ids = sv.chat_prompt(messages, tools=tools, param="input")
    params = _sampling_params(sv, req, messages, len(prompt_ids))
    if tools and extract is None:
        extract = _tool_extractor(sv, req, tools, params)
    await sv.check_structured(None, params, "tool_choice" if tools and req.tool_choice not in (
        None, "auto", "none") else "text")
    turn = _Turn(sv, store, req, model, conversation, tools, len(prompt_ids), extract)
    session = request.headers.get("x-session-id") or req.user
    spec = ChoiceSpec(turn.id, 0, prompt_ids, params, session_id=session)
    fan = await sv.start(request, [spec], body=req)

    if not req.stream:
        outs = await sv.collect(request, fan)
        return JSONResponse(turn.finish(outs[0]).model_dump(mode="json"))

    seq = 0
    parts: list[str] = []

    def event(type_: str, **fields: Any) -> str:
        # "type" first: _frame reads the SSE event name off the front of the JSON text.
        nonlocal seq
        body = {"type": type_, "sequence_number": seq, **fields}
        seq += 1
        return _json(body)

    def where(**extra: Any) -> dict[str, Any]:
        return {"item_id": turn.msg_id, "output_index": 0, "content_index": 0, **extra}

    started = turn.response("in_progress", []).model_dump(mode="json")
    first = [event("response.created", response=started),
             event("response.in_progress", response=started),
             event("response.output_item.added", output_index=0,
                   item=OutputMessage(id=turn.msg_id, status="in_progress", content=[]
                                      ).model_dump(mode="json")),
             event("response.content_part.added", **where(part=OutputText(text="").model_dump()))]

    def render(ev: ChoiceEvent) -> list[str]:
        out: list[str] = []
        if ev.text:
            parts.append(ev.text)
            out.append(event("response.output_text.delta", **where(delta=ev.text, logprobs=[])))
        if not ev.finished:
            return out
        joined = ChoiceEvent(index=0, text="".join(parts), finish_reason=ev.finish_reason,
                             num_prompt_tokens=ev.num_prompt_tokens,
                             num_output_tokens=ev.num_output_tokens,
                             num_cached_tokens=ev.num_cached_tokens)
        resp = turn.finish(joined)
        text = joined.text
        message = next((o for o in resp.output if isinstance(o, OutputMessage)),
                       turn.message(text, resp.status))
        out += [event("response.output_text.done", **where(text=text, logprobs=[])),
                event("response.content_part.done",
                      **where(part=OutputText(text=text).model_dump())),
                event("response.output_item.done", output_index=0,
                      item=message.model_dump(mode="json"))]
        # Tool calls found in the finished text follow the message as their own items.
        for i, item in enumerate(o for o in resp.output if isinstance(o, OutputFunctionCall)):
            dumped = item.model_dump(mode="json")
            out += [event("response.output_item.added", output_index=i + 1, item=dumped),
                    event("response.output_item.done", output_index=i + 1, item=dumped)]
        done = "response.incomplete" if resp.status == "incomplete" else "response.completed"
        out.append(event(done, response=resp.model_dump(mode="json")))
        return out

    return sv.stream_response(request, fan, render, first, lambda _: None, frame=_frame,
                              done=False)


def _tool_extractor(sv: Serving, req: ResponsesRequest, tools: list[dict[str, Any]],
                    params: SamplingParams) -> ToolCallExtractor | None:
    """The chat endpoint's tool handling (kiln/server/chat_output.py) for a Responses request:
    tool_choice required / a function constrains the output (the request's structured
    outputs), and the same parser reads the calls out of the finished text."""
    choice = req.tool_choice
    if isinstance(choice, dict):  # Responses' flat {"type": "function", "name": ...}
        name = choice.get("name") or (choice.get("function") or {}).get("name")
        if choice.get("type") != "function" or not any(
                t["function"]["name"] == name for t in tools):
            raise APIError(400, f"tool_choice {choice!r} names no function among the request's "
                           "tools", param="tool_choice", code="invalid_value")
        choice = {"type": "function", "function": {"name": name}}
    elif choice not in (None, "auto", "none", "required"):
        raise APIError(400, f"tool_choice must be auto, none, required or a function, got "
                       f"{choice!r}", param="tool_choice", code="invalid_value")
    plan = plan_tools(tools, choice, req.parallel_tool_calls, sv.chat)
    if plan.structured is not None:
        params.structured_outputs = plan.structured
    parser = plan.parser
    if parser is None:
        return None

    def extract(text: str, _: list[dict[str, Any]]) -> tuple[str, list[tuple[str, str]]]:
        stream = ToolCallStream(parser, plan.max_calls)
        stream.update(text, True)
        assert stream.final is not None
        calls = [(c["function"]["name"], c["function"]["arguments"])
                 for c in stream.tool_calls()]
        return stream.final.content, calls

    return extract


def _json(body: dict[str, Any]) -> str:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


def _frame(chunk: str) -> str:
    """An SSE event named by its type, as OpenAI sends them (an error object: `error`)."""
    prefix = '{"type":"'
    name = chunk[len(prefix):chunk.index('"', len(prefix))] if chunk.startswith(prefix) \
        else "error"
    return f"event: {name}\ndata: {chunk}\n\n"


def router(sv: Serving, store: ResponseStore, extract: ToolCallExtractor | None = None
           ) -> APIRouter:
    """Under /v1, behind the API key."""
    r = APIRouter()

    @r.post("/responses")
    async def responses(req: ResponsesRequest, request: Request) -> Any:
        return await create_response(sv, store, req, request, extract)

    @r.get("/responses/{response_id}")
    async def get_response(response_id: str) -> Any:
        item = store.get(response_id)
        if item is None:
            raise not_found(response_id)
        return JSONResponse(item.response)

    return r
