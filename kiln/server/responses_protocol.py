"""Pydantic models of OpenAI's Responses API (POST /v1/responses, its stream events, GET by id).

The request is turned into a chat completion request (routes/responses.py), so everything a chat
completion validates, renders and samples is shared. What is accepted:

  * `input`: a string (one user message) or a list of items: messages (roles user, system,
    developer, assistant; content a string or input_text / output_text parts), `function_call`
    items (the model's earlier calls, rendered as an assistant message with tool_calls) and
    `function_call_output` items (rendered as `role: tool` messages);
  * `tools`: function tools in the Responses' flat shape {type, name, description, parameters};
    other tool types (web_search, file_search, ...) are a 400: kiln runs no hosted tools;
  * `text.format`: text, json_schema or json_object (passed on as SamplingParams'
    structured_outputs).
Unknown fields are ignored, as for the other endpoints.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kiln.server.protocol import _Request, refusal, type_among

# Module-level names: pydantic reads the string annotations (from __future__) in this namespace.
_InputPartType = type_among("content part type", ("input_text", "output_text", "text"),
                            "only input_text and output_text parts are")
_ToolType = type_among("tool type", ("function",), "kiln runs no hosted tools, only function tools")


class InputTextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: _InputPartType
    text: str = ""


class InputMessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputTextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    """A call the model made earlier (sent back so the conversation shows it)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputTextPart]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.text for p in self.output)


InputItem = InputMessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionToolParam(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: _ToolType
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict[str, Any]:
        """The chat completions' nested shape, which chat templates expect: the same function a
        chat request would send (`strict` kept as sent; protocol.template_tools orders the keys
        for the template)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters or {"type": "object", "properties": {}}
        if self.strict is not None:
            fn["strict"] = self.strict
        return {"type": "function", "function": fn}


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_schema", "json_object"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    model: str | None = None  # None = the primary served model
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionToolParam] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM extras, the same knobs as on the other endpoints
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @field_validator("input")
    @classmethod
    def _non_empty(cls, v: str | list[InputItem]) -> str | list[InputItem]:
        if isinstance(v, list) and not v:
            raise refusal("empty_input", "input must contain at least one item")
        return v


# -- the response ------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """What the model wrote between its reasoning tags (--reasoning-parser), as OpenAI's
    reasoning item carries it: the text in `content`, no summary."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Annotated[OutputReasoning | OutputMessage | OutputFunctionCall,
                       Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool = True
    user: str | None = None


# The stream: every event carries its type and a sequence number; which other fields it has
# depends on the type (OpenAI's ResponseStreamEvent union), so they are optional here.
class ResponseStreamEvent(BaseModel):
    type: Literal["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added", "response.output_text.delta",
                  "response.output_text.done", "response.content_part.done",
                  "response.reasoning_text.delta", "response.reasoning_text.done",
                  "response.function_call_arguments.delta",
                  "response.function_call_arguments.done",
                  "response.output_item.done", "response.completed", "response.incomplete"]
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    content_index: int | None = None
    item_id: str | None = None
    item: OutputItem | None = None
    part: OutputText | ReasoningText | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None
    logprobs: list[dict[str, Any]] | None = None
