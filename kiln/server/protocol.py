"""Pydantic models of the OpenAI Chat Completions / Completions requests, responses and stream
chunks, plus the translation of a request into SamplingParams.

Validation is split in two on purpose:
  * types and "we don't do that" (suffix, logit_bias, response_format types other than text,
    json_object and json_schema, non-text content parts) are pydantic validators, so FastAPI rejects them before any work, with `param` taken
    from the error location;
  * ranges (temperature < 0, top_p outside (0, 1], n < 1, ...) are SamplingParams.validate(), the
    single source of those rules, reached through `to_sampling_params`.
Unknown request fields are ignored (as vLLM does) so newer OpenAI clients keep working.

Choices made here, documented for users:
  * `logit_bias` with any entry -> 400: silently ignoring it would change outputs unnoticed.
  * `suffix` -> 400 "suffix is not supported"; `best_of` must be None or equal to `n`.
  * structured output: `response_format` json_object / json_schema, or vLLM's `guided_json`,
    `guided_regex`, `guided_choice`, `guided_grammar` or `structured_outputs` object, on both
    endpoints, become SamplingParams.structured_outputs (`structured_outputs_of`); more than
    one -> 400. json_schema with strict=true forbids properties the schema does not list
    (`strict_schema`); strict false or absent is enforced all the same (as vLLM does). Whether
    the constraint compiles is checked by the server before admission (Serving.check_structured).
  * `echo` together with `logprobs` -> 400 (echoed tokens get no logprobs; `prompt_logprobs` has them).
  * content given as a list of parts: only "text" parts; they are joined with "\\n".
  * role "developer" is rendered as "system" (chat templates predate it).
  * `tool_choice` other than none without `tools`, or naming a function not among them -> 400;
    an assistant message's tool call `arguments` (JSON text) reach the template as an object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from kiln.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams

# Logprobs of -inf are not JSON; vLLM clamps to this value, and so do we.
MIN_LOGPROB = -9999.0


class _Request(BaseModel):
    # NaN and infinities are JSON extensions Python's parser accepts; no field means anything
    # with them ("temperature": NaN used to be taken).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


@dataclass(frozen=True)
class RequestLimits:
    """Caps on one request (the settings max_n, max_stop_sequences, max_stop_length,
    max_request_body_bytes, max_header_bytes)."""

    max_n: int = 128
    max_stop_sequences: int = 64
    max_stop_length: int = 1024
    max_body_bytes: int = 32 << 20
    max_header_bytes: int = 64 << 10

    @classmethod
    def from_settings(cls, s: Any) -> RequestLimits:
        return cls(s["max_n"], s["max_stop_sequences"], s["max_stop_length"],
                   s["max_request_body_bytes"], s["max_header_bytes"])


def check_limits(req: ChatCompletionRequest | CompletionRequest, limits: RequestLimits) -> None:
    """Raises SamplingParamsError naming the field (and the flag) a request goes over; cheap,
    so routes call it before tokenizing anything."""
    best_of = getattr(req, "best_of", None)
    for name, value in (("n", req.n), ("best_of", best_of)):
        if value is not None and value > limits.max_n:
            raise SamplingParamsError(
                name, f"{name} is {value}; this server allows at most {limits.max_n} sequences "
                "per request (--max-n)")
    if isinstance(req, CompletionRequest):
        # A batch of prompts starts n sequences for each.
        num_prompts = len(req.prompts())
        if num_prompts * req.n > limits.max_n:
            raise SamplingParamsError(
                "prompt", f"{num_prompts} prompts x n={req.n} is {num_prompts * req.n} "
                f"sequences; this server allows at most {limits.max_n} per request (--max-n)")
    stops = req.stop_list()
    if len(stops) > limits.max_stop_sequences:
        raise SamplingParamsError(
            "stop", f"{len(stops)} stop sequences; this server allows at most "
            f"{limits.max_stop_sequences} (--max-stop-sequences)")
    longest = max(map(len, stops), default=0)
    if longest > limits.max_stop_length:
        raise SamplingParamsError(
            "stop", f"a stop sequence of {longest} characters; this server allows at most "
            f"{limits.max_stop_length} (--max-stop-length)")
    if len(req.stop_token_ids or []) > limits.max_stop_sequences:
        raise SamplingParamsError(
            "stop_token_ids", f"{len(req.stop_token_ids or [])} stop token ids; this server "
            f"allows at most {limits.max_stop_sequences} (--max-stop-sequences)")


class StreamOptions(_Request):
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None

    @field_validator("type")
    @classmethod
    def _only_text(cls, v: str) -> str:
        if v not in ("text", "input_text"):
            raise ValueError(f"content part type {v!r} is not supported; only 'text' parts are")
        return v


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
    type: str
    json_schema: JsonSchemaFormat | None = None

    @field_validator("type")
    @classmethod
    def _known_type(cls, v: str) -> str:
        if v not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format type {v!r} is not supported; use 'text', "
                             "'json_object' or 'json_schema'")
        return v


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
            raise ValueError("structural_tag is not supported; use json, regex, choice or "
                             "grammar")
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
            raise ValueError("logit_bias is not supported by kiln; remove it or send {}")
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
            raise ValueError("messages must contain at least one message")
        return v

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(v or []):
            fn = tool.get("function")
            if tool.get("type", "function") != "function" or not isinstance(fn, dict) or \
                    not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                                 "{\"name\": ..., \"parameters\": {...}}}")
            if not isinstance(fn.get("parameters", {}), dict):
                # pydantic turns ValueError (not TypeError) into a 400
                raise ValueError(  # noqa: TRY004
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
                raise ValueError(f"tool_choice must be none, auto, required or "
                                 f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                                 f"got {v!r}")
            if v != "none" and not tools:
                raise ValueError(f"tool_choice {v!r} needs tools")
            return v
        fn = v.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if v.get("type") != "function" or not isinstance(name, str):
            raise ValueError("a named tool_choice is {\"type\": \"function\", \"function\": "
                             "{\"name\": ...}}")
        if name not in [t["function"]["name"] for t in tools]:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        return v

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        # tool_choice "none" means the model must not call tools: don't advertise them.
        if not self.tools or self.tool_choice == "none":
            return None
        return self.tools


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
            raise ValueError("suffix is not supported")
        return v

    @field_validator("prompt")
    @classmethod
    def _non_empty_prompt(cls, v: PromptType) -> PromptType:
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the batch: a string, or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


def strict_schema(schema: Any) -> Any:
    """A copy of `schema` in which every object schema that does not say whether other
    properties are allowed forbids them: OpenAI's strict mode (which requires
    `"additionalProperties": false` of every object) made of a schema that omits it. Subschemas
    under properties, items, combinators and definitions are visited; `const`, `enum`,
    `default` and `examples` values are data, left alone."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in ("const", "enum", "default", "examples"):
            out[k] = v
        elif k in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            out[k] = ({name: strict_schema(s) for name, s in v.items()} if isinstance(v, dict)
                      else v)
        else:
            out[k] = strict_schema(v)
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and not any(k in out for k in ("additionalProperties", "patternProperties",
                                                   "unevaluatedProperties")):
        out["additionalProperties"] = False
    return out


def structured_outputs_of(req: ChatCompletionRequest | CompletionRequest
                          ) -> tuple[StructuredOutputsParams, str] | None:
    """The request's output constraint and the field that gave it (the `param` of its errors),
    from `response_format`, vLLM's `guided_*` extras or its `structured_outputs` object; None
    when unconstrained. More than one constraint is a 400."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append((StructuredOutputsParams(json_object=True), "response_format"))
    elif rf is not None and rf.type == "json_schema":
        js = rf.json_schema
        if js is None:
            raise SamplingParamsError("response_format", "response_format of type 'json_schema' "
                                      "needs a json_schema object with the schema")
        if js.json_schema is None:  # no schema: any JSON object
            found.append((StructuredOutputsParams(json_object=True), "response_format"))
        else:
            schema = strict_schema(js.json_schema) if js.strict else js.json_schema
            found.append((StructuredOutputsParams(json=schema), "response_format"))
    if req.guided_json is not None:
        found.append((StructuredOutputsParams(json=req.guided_json), "guided_json"))
    if req.guided_regex is not None:
        found.append((StructuredOutputsParams(regex=req.guided_regex), "guided_regex"))
    if req.guided_choice is not None:
        found.append((StructuredOutputsParams(choice=req.guided_choice), "guided_choice"))
    if req.guided_grammar is not None:
        found.append((StructuredOutputsParams(grammar=req.guided_grammar), "guided_grammar"))
    so = req.structured_outputs
    if so is not None:
        params = StructuredOutputsParams(json=so.json_schema, json_object=bool(so.json_object),
                                         regex=so.regex, choice=so.choice, grammar=so.grammar)
        if len(params.kinds()) != 1:
            raise SamplingParamsError(
                "structured_outputs", "structured_outputs takes exactly one of json, "
                f"json_object, regex, choice, grammar; got {params.kinds() or 'none'}")
        found.append((params, "structured_outputs"))
    if len(found) > 1:
        raise SamplingParamsError(found[1][1], f"{found[0][1]} and {found[1][1]} both constrain "
                                  "the output; give one")
    return found[0] if found else None


def _context_error(param: str, max_model_len: int, prompt_len: int, max_tokens: int | None,
                   tokens_param: str = "max_tokens") -> None:
    what = "messages" if param == "messages" else "prompt"
    if max_tokens is None:
        raise SamplingParamsError(
            param,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{what} resulted in {prompt_len} tokens, leaving no room for the completion. "
            f"Please reduce the length of the {what}.",
        )
    raise SamplingParamsError(
        tokens_param if prompt_len < max_model_len else param,
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the {what}, {max_tokens} in the "
        f"completion). Please reduce the length of the {what} or completion.",
    )


def to_sampling_params(
    req: ChatCompletionRequest | CompletionRequest, max_model_len: int, prompt_len: int,
    limits: RequestLimits | None = None,
) -> SamplingParams:
    """Translate a validated request into SamplingParams for one prompt of `prompt_len` tokens.

    Raises SamplingParamsError(param, message) for anything out of range, including a prompt plus
    max_tokens that does not fit `max_model_len` (vLLM's message, with both numbers), and
    anything over the server's `limits`.
    """
    check_limits(req, limits or RequestLimits())
    is_chat = isinstance(req, ChatCompletionRequest)
    prompt_param = "messages" if is_chat else "prompt"

    max_tokens_param = "max_tokens"
    if is_chat:
        max_tokens: int | None = req.max_tokens
        if req.max_completion_tokens is not None:
            max_tokens, max_tokens_param = req.max_completion_tokens, "max_completion_tokens"
        if req.top_logprobs is not None and not req.logprobs:
            raise SamplingParamsError("top_logprobs", "top_logprobs requires logprobs=true")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        logprobs_param = "top_logprobs"
        if req.stream and req.prompt_logprobs is not None:
            raise SamplingParamsError(
                "prompt_logprobs", "prompt_logprobs is not supported with stream=true on chat "
                "completions: ask without streaming, or on /v1/completions")
    else:
        # OpenAI's legacy completions default is 16 tokens.
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        logprobs = req.logprobs
        logprobs_param = "logprobs"
        if req.best_of is not None and req.best_of != req.n:
            raise SamplingParamsError(
                "best_of", f"best_of must equal n ({req.n}) or be omitted, got {req.best_of}"
            )
        if req.echo and req.logprobs is not None:
            raise SamplingParamsError(
                "echo", "echo with logprobs is not supported (no prompt logprobs)"
            )

    structured = structured_outputs_of(req)
    try:
        params = SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop_list(),
            stop_token_ids=list(req.stop_token_ids or []),
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            prompt_logprobs=req.prompt_logprobs,
            structured_outputs=structured[0] if structured else None,
        )
    except SamplingParamsError as e:
        renames = {"max_tokens": max_tokens_param, "logprobs": logprobs_param}
        raise SamplingParamsError(renames.get(e.param, e.param), str(e)) from e

    if prompt_len >= max_model_len:
        _context_error(prompt_param, max_model_len, prompt_len, None)
    if params.max_tokens is None:
        params.max_tokens = max_model_len - prompt_len
        params.validate()
    elif prompt_len + params.max_tokens > max_model_len:
        _context_error(prompt_param, max_model_len, prompt_len, params.max_tokens,
                       max_tokens_param)
    return params


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


# --------------------------------------------------------------------------- embeddings, rerank

# OpenAI's cap on the inputs of one embeddings request.
MAX_EMBEDDING_INPUTS = 2048
EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_Request):
    """POST /v1/embeddings (OpenAI's shape; `truncate_prompt_tokens` is vLLM's extra)."""

    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # Keep only the last N tokens of a longer input (vLLM's); without it a long input is a 400.
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)

    @field_validator("input")
    @classmethod
    def _non_empty(cls, v: EmbeddingInput) -> EmbeddingInput:
        items = [v] if isinstance(v, str) else v
        if not items or any(not x for x in items if isinstance(x, str | list)):
            raise ValueError("input must not be empty (nor hold an empty string or list)")
        if len(items) > MAX_EMBEDDING_INPUTS and not all(isinstance(x, int) for x in items):
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request")
        return v

    def inputs(self) -> list[str | list[int]]:
        """Each input: a string, or a list of token ids."""
        v = self.input
        if isinstance(v, str):
            return [v]
        if all(isinstance(x, int) for x in v):
            return [list(v)]  # type: ignore[arg-type]
        return list(v)  # type: ignore[arg-type]


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    # float: the vector; base64: its little-endian float32 bytes (OpenAI's encoding).
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class RerankDocument(BaseModel):
    text: str


class RerankRequest(_Request):
    """POST /v1/rerank, /rerank (Jina / Cohere shape, as vLLM and llama-server take it)."""

    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str | RerankDocument] = Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int = 0


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage
    # How the scores were made: kiln ranks by the cosine similarity of embeddings (a
    # bi-encoder), not with a cross-encoder.
    scoring: str = "cosine similarity of the query's and each document's embeddings"
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
