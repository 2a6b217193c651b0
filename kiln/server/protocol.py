"""Pydantic models of the OpenAI Chat Completions / Completions requests, responses and stream
chunks (and vLLM's /tokenize, /detokenize). What a request then asks of the engine (caps,
SamplingParams, the output constraint) is kiln/server/request_params.py.

Validation is split in two on purpose:
  * types and "we don't do that" (suffix, logit_bias, response_format types other than text,
    json_object and json_schema, non-text content parts) are pydantic validators, so FastAPI
    rejects them before any work, with `param` taken from the error location and `code` from
    the refusal (`refusal(code, message)`: unsupported_parameter, unsupported_value, ...);
  * ranges (temperature < 0, top_p outside (0, 1], n < 1, ...) are SamplingParams.validate(), the
    single source of those rules, reached through `request_params.to_sampling_params`.
Unknown request fields are ignored (as vLLM does) so newer OpenAI clients keep working.

Choices made here, documented for users:
  * `logit_bias` with any entry -> 400: silently ignoring it would change outputs unnoticed.
  * `suffix` -> 400 "suffix is not supported"; `best_of` must be None or equal to `n`.
  * structured output: `response_format` json_object / json_schema, or vLLM's `guided_json`,
    `guided_regex`, `guided_choice`, `guided_grammar` or `structured_outputs` object, on both
    endpoints, become SamplingParams.structured_outputs (request_params.structured_outputs_of);
    more than one -> 400. json_schema with strict=true forbids properties the schema does not
    list (`strict_schema`); strict false or absent is enforced all the same (as vLLM does). Whether
    the constraint compiles is checked by the server before admission (Serving.check_structured).
  * `echo` together with `logprobs` -> 400 (echoed tokens get no logprobs; `prompt_logprobs`
    has them).
  * content given as a list of parts: only "text" parts; they are joined with "\\n".
  * role "developer" is rendered as "system" (chat templates predate it).
  * `tool_choice` other than none without `tools`, or naming a function not among them -> 400;
    an assistant message's tool call `arguments` (JSON text) reach the template as an object.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
)
from pydantic_core import PydanticCustomError

# Logprobs of -inf are not JSON; vLLM clamps to this value, and so do we.
MIN_LOGPROB = -9999.0


class _Request(BaseModel):
    # NaN and infinities are JSON extensions Python's parser accepts; no field means anything
    # with them ("temperature": NaN used to be taken).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


# The codes a request's own field checks refuse with: the error body's `code` (server/errors.py
# reads it off the validation error's type), what a client and a test match instead of wording.
# A field of the wrong type or out of range stays `invalid_value`.
REFUSAL_CODES = frozenset({
    "unsupported_parameter",  # a field kiln does not do (suffix, logit_bias, structural_tag)
    "unsupported_value",  # a value of a `type` kiln does not take (an image part, web_search)
    "empty_input",  # no messages, no prompt, no input
    "request_limit_exceeded",  # more items than a request may carry (also SamplingParams' caps)
    "invalid_tool",  # a tools entry that is not a function with a name and a schema
    "invalid_tool_choice",  # tool_choice malformed, or naming a function without tools to pick
    "unknown_tool",  # a named tool_choice that is not among the tools
})


def refusal(code: str, message: str) -> PydanticCustomError:
    """What a field validator raises to refuse a request: a 400 whose `code` is `code` (one of
    REFUSAL_CODES) and whose message is `message` (taken as it is: no {field} formatting)."""
    assert code in REFUSAL_CODES, code
    return PydanticCustomError(code, message)


def type_among(what: str, allowed: tuple[str, ...], hint: str) -> Any:
    """The type of a request object's `type` field that takes only `allowed`: any other value
    fails validation (a 400) as "<what> 'x' is not supported; <hint>"."""

    def check(v: str) -> str:
        if v not in allowed:
            raise refusal("unsupported_value", f"{what} {v!r} is not supported; {hint}")
        return v

    return Annotated[str, AfterValidator(check)]


# Module-level names: pydantic reads the string annotations (from __future__) in this namespace.
_ContentPartType = type_among("content part type", ("text", "input_text"), "only 'text' parts are")
_ResponseFormatType = type_among("response_format type", ("text", "json_object", "json_schema"),
                                 "use 'text', 'json_object' or 'json_schema'")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: _ContentPartType
    text: str | None = None


class ChatMessage(BaseModel):
    # Extra keys (e.g. "reasoning_content") are kept and handed to the chat template.
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text_content(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(p.text or "" for p in self.content)

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content a plain string."""
        d: dict[str, Any] = {k: v for k, v in (self.model_extra or {}).items()}
        d["role"] = "system" if self.role == "developer" else self.role
        d["content"] = self.text_content()
        if self.role == "assistant" and d["content"] is None and not self.tool_calls:
            d["content"] = ""
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls is not None:
            d["tool_calls"] = [template_tool_call(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


def template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant's earlier tool call as templates read it: OpenAI sends `arguments` as JSON
    text, templates (Qwen's `arguments | tojson`, Llama's) expect the object (vLLM does this)."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}}


# OpenAI's documented order of a function's keys, which clients send: a template writes each tool
# with `tojson`, so the order is part of the prompt.
_FUNCTION_KEYS = ("name", "description", "parameters")


def template_tools(tools: list[dict[str, Any]] | None, tool_choice: Any = None
                   ) -> list[dict[str, Any]] | None:
    """A request's function tools as chat templates get them, whichever endpoint took them
    (chat completions, /v1/responses, /tokenize): each function's keys in OpenAI's order (name,
    description, parameters, then any others as sent), so the same tools render the same prompt
    in whatever key order a client wrote them. With tool_choice "none" there are none: the
    model must not call, so they are not advertised."""
    if not tools or tool_choice == "none":
        return None
    out = []
    for tool in tools:
        fn = tool.get("function") or {}
        ordered = {k: fn[k] for k in _FUNCTION_KEYS if k in fn}
        ordered.update({k: v for k, v in fn.items() if k not in ordered})
        out.append({**tool, "type": tool.get("type", "function"), "function": ordered})
    return out


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: OpenAI's name, description, schema and strict."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    # `schema` would shadow a BaseModel attribute: kept under another name, read by its alias.
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: _ResponseFormatType
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` request object: exactly one of its constraints."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    # `json` would shadow a BaseModel method: kept under another name, read by its alias.
    json_schema: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: Any = None

    @field_validator("structural_tag")
    @classmethod
    def _no_structural_tag(cls, v: Any) -> Any:
        if v is not None:
            raise refusal("unsupported_parameter", "structural_tag is not supported; use json, "
                          "regex, choice or grammar")
        return v


class _SamplingFields(_Request):
    """Fields shared by both endpoints: OpenAI's, then vLLM's extras."""

    model: str | None = None  # None = the primary served model
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    prompt_logprobs: int | None = None
    # Structured output (at most one of these; see `structured_outputs_of`)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsField | None = None

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise refusal("unsupported_parameter",
                          "logit_bias is not supported by kiln; remove it or send {}")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise refusal("empty_input", "messages must contain at least one message")
        return v

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(v or []):
            fn = tool.get("function")
            if tool.get("type", "function") != "function" or not isinstance(fn, dict) or \
                    not isinstance(fn.get("name"), str) or not fn["name"]:
                raise refusal("invalid_tool", f"tools[{i}] must be {{\"type\": \"function\", "
                              "\"function\": {\"name\": ..., \"parameters\": {...}}}")
            if not isinstance(fn.get("parameters", {}), dict):
                raise refusal("invalid_tool",
                              f"tools[{i}].function.parameters must be a JSON schema object")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _known_choice(cls, v: str | dict[str, Any] | None, info: ValidationInfo
                      ) -> str | dict[str, Any] | None:
        # `tools` is declared before tool_choice, so it is validated and in info.data.
        tools = info.data.get("tools") or []
        if v is None:
            return v
        if isinstance(v, str):
            if v not in ("none", "auto", "required"):
                raise refusal("invalid_tool_choice", f"tool_choice must be none, auto, required "
                              f"or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                              f"got {v!r}")
            if v != "none" and not tools:
                raise refusal("invalid_tool_choice", f"tool_choice {v!r} needs tools")
            return v
        fn = v.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if v.get("type") != "function" or not isinstance(name, str):
            raise refusal("invalid_tool_choice", "a named tool_choice is {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}")
        if name not in [t["function"]["name"] for t in tools]:
            raise refusal("unknown_tool", f"tool_choice names {name!r}, which is not among the tools")
        return v

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return template_tools(self.tools, self.tool_choice)


PromptType = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v is not None:
            raise refusal("unsupported_parameter", "suffix is not supported")
        return v

    @field_validator("prompt")
    @classmethod
    def _non_empty_prompt(cls, v: PromptType) -> PromptType:
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise refusal("empty_input", "prompt must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the batch: a string, or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatLogprobTop(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatLogprobTop):
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None
    refusal: list[ChatLogprobToken] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # vLLM's field: the model's reasoning (<think>...</think>) under --reasoning-parser
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM extra: the stop string or token id that matched


ChoiceT = TypeVar("ChoiceT")


# What every completion response and chunk holds. A subclass names its choice type, narrows
# `object`, and a response makes `usage` required; pydantic keeps an overridden field in its
# place, so the JSON keeps OpenAI's order (comments here: docstrings would enter the OpenAPI
# schema).
class _Envelope(BaseModel, Generic[ChoiceT]):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChoiceT]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: PromptLogprob}
# for the prompt's token and the k likeliest.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatCompletionResponse(_Envelope[ChatCompletionChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extra


class _Compact(BaseModel):
    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        # A delta lists only what changed: {"content": "x"}, and {} in the final chunk.
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_Compact):
    name: str | None = None
    arguments: str | None = None


# A tool call in a stream: its first delta has id, type and the name, later ones only
# argument pieces; `index` says which call of the message a piece belongs to (OpenAI's shape).
class DeltaToolCall(_Compact):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        # A delta lists only what changed: {"content": "x"}, and {} in the final chunk.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(_Envelope[ChatCompletionStreamChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extra


class CompletionResponse(_Envelope[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"
    usage: UsageInfo


# OpenAI streams completions as the same text_completion object, with usage only at the end.
# (A comment, not a docstring: a docstring would become a description in the OpenAPI schema.)
class CompletionChunk(CompletionResponse):
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kiln"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model id (vLLM's)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# --------------------------------------------------------------------------------------------
# /tokenize and /detokenize (vLLM's shapes)
# --------------------------------------------------------------------------------------------


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
