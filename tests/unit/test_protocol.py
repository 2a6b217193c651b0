"""OpenAI request/response models and their translation into SamplingParams."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from kiln.sampling_params import SamplingParamsError
from kiln.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionStreamChoice,
    CompletionRequest,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
)
from kiln.server.request_params import to_sampling_params

USER = [{"role": "user", "content": "hi"}]


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **kw})


def completion(**kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **kw})


def bad_param(req: ChatCompletionRequest | CompletionRequest, prompt_len: int = 10) -> str:
    with pytest.raises(SamplingParamsError) as info:
        to_sampling_params(req, 100, prompt_len)
    return info.value.param


def error_body(model: type, body: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI error a request body the model refuses gets (server/errors.py's mapping of
    FastAPI's validation error, whose locations start at "body")."""
    from fastapi.exceptions import RequestValidationError

    from kiln.server.errors import validation_error

    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    return validation_error(RequestValidationError(errors)).body()["error"]


def invalid_field(model: type, body: dict[str, Any]) -> tuple[str, str]:
    """(param, code) of the error a refused body gets: the field named, and the refusal's code
    (invalid_value for a value of the wrong type)."""
    err = error_body(model, body)
    return err["param"], err["code"]


# -- request -> SamplingParams ------------------------------------------------------------------


def test_chat_defaults_fill_the_context() -> None:
    p = to_sampling_params(chat(), max_model_len=100, prompt_len=30)
    assert p.max_tokens == 70
    assert (p.temperature, p.top_p, p.top_k, p.n, p.logprobs) == (1.0, 1.0, 0, 1, None)


def test_completion_default_max_tokens_is_16() -> None:
    assert to_sampling_params(completion(), 100, 5).max_tokens == 16


def test_all_sampling_fields_reach_sampling_params() -> None:
    req = chat(
        temperature=0.5,
        top_p=0.9,
        n=3,
        stop="END",
        max_tokens=20,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        seed=7,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        ignore_eos=True,
        min_tokens=2,
        stop_token_ids=[5, 6],
        skip_special_tokens=False,
        logprobs=True,
        top_logprobs=4,
    )
    p = to_sampling_params(req, 100, 10)
    assert (p.temperature, p.top_p, p.n, p.stop, p.max_tokens) == (0.5, 0.9, 3, ["END"], 20)
    assert (p.presence_penalty, p.frequency_penalty, p.seed) == (0.5, -0.5, 7)
    assert (p.top_k, p.min_p, p.repetition_penalty) == (40, 0.05, 1.1)
    assert (p.ignore_eos, p.min_tokens, p.stop_token_ids) == (True, 2, [5, 6])
    assert (p.skip_special_tokens, p.logprobs) == (False, 4)


def test_logprobs_true_without_top_logprobs_means_zero_alternatives() -> None:
    assert to_sampling_params(chat(logprobs=True), 100, 10).logprobs == 0


def test_max_completion_tokens_wins_and_is_named_in_errors() -> None:
    assert to_sampling_params(chat(max_tokens=5, max_completion_tokens=9), 100, 10).max_tokens == 9
    assert bad_param(chat(max_completion_tokens=0)) == "max_completion_tokens"


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("temperature", -0.1, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("n", 0, "n"),
        ("max_tokens", -1, "max_tokens"),
        ("max_tokens", 0, "max_tokens"),
        ("presence_penalty", 3.0, "presence_penalty"),
        ("min_tokens", -1, "min_tokens"),
    ],
)
def test_out_of_range_values_name_their_parameter(field: str, value: Any, param: str) -> None:
    assert bad_param(chat(**{field: value})) == param
    assert bad_param(completion(**{field: value})) == param


def test_top_logprobs_rules() -> None:
    assert bad_param(chat(top_logprobs=2)) == "top_logprobs"  # needs logprobs=true
    assert bad_param(chat(logprobs=True, top_logprobs=21)) == "top_logprobs"
    assert bad_param(completion(logprobs=21)) == "logprobs"


def test_prompt_plus_max_tokens_over_context_reports_both_numbers() -> None:
    with pytest.raises(SamplingParamsError) as info:
        to_sampling_params(chat(max_tokens=50), max_model_len=100, prompt_len=60)
    msg = str(info.value)
    assert info.value.param == "max_tokens"
    assert "maximum context length is 100 tokens" in msg
    assert "110 tokens (60 in the messages, 50 in the completion)" in msg


def test_prompt_alone_over_context_names_the_prompt() -> None:
    assert bad_param(chat(), prompt_len=100) == "messages"
    assert bad_param(completion(max_tokens=5), prompt_len=120) == "prompt"


def test_best_of_must_equal_n() -> None:
    assert to_sampling_params(completion(best_of=2, n=2), 100, 5).n == 2
    assert bad_param(completion(best_of=3, n=2)) == "best_of"


def test_echo_with_logprobs_is_rejected() -> None:
    assert bad_param(completion(echo=True, logprobs=1)) == "echo"


# -- request validation -------------------------------------------------------------------------


def test_empty_messages_are_rejected_on_messages() -> None:
    assert invalid_field(ChatCompletionRequest, {"messages": []}) == ("messages", "empty_input")


def test_unknown_role_is_rejected() -> None:
    param, _ = invalid_field(ChatCompletionRequest, {"messages": [{"role": "bot", "content": "x"}]})
    assert param == "messages"


def test_wrong_types_are_rejected_on_their_field() -> None:
    assert invalid_field(ChatCompletionRequest, {"messages": USER, "temperature": "hot"})[0] == (
        "temperature"
    )
    assert invalid_field(ChatCompletionRequest, {"messages": USER, "n": 1.5})[0] == "n"
    assert invalid_field(CompletionRequest, {"prompt": {"a": 1}})[0] == "prompt"


UNSUPPORTED = "unsupported_parameter"


@pytest.mark.parametrize(("model", "body", "refused"), [
    (CompletionRequest, {"prompt": "x", "suffix": "y"}, ("suffix", UNSUPPORTED)),
    (ChatCompletionRequest, {"messages": USER, "logit_bias": {"5": 1}}, ("logit_bias", UNSUPPORTED)),
    (ChatCompletionRequest, {"messages": USER, "response_format": {"type": "yaml"}},
     ("response_format", "unsupported_value")),
    (CompletionRequest, {"prompt": "x", "structured_outputs": {"structural_tag": {"a": 1}}},
     ("structured_outputs", UNSUPPORTED)),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, ("messages", "unsupported_value")),
])
def test_unsupported_features_are_refused_with_their_code(model: type, body: dict[str, Any],
                                                          refused: tuple[str, str]) -> None:
    assert invalid_field(model, body) == refused


def test_harmless_variants_are_accepted() -> None:
    req = chat(logit_bias={}, response_format={"type": "text"}, some_future_field=1)
    assert req.logit_bias == {}
    assert not hasattr(req, "some_future_field")


def test_stream_options_include_usage_only_when_streaming() -> None:
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert not chat(stream=False, stream_options={"include_usage": True}).include_usage
    assert not chat(stream=True).include_usage


def test_messages_become_template_dicts() -> None:
    req = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ]
    )
    msgs = req.template_messages()
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[1] == {"role": "user", "content": "a\nb"}
    assert msgs[2]["tool_calls"][0]["id"] == "c1" and msgs[2]["content"] is None
    assert msgs[3] == {"role": "tool", "content": "42", "tool_call_id": "c1"}


def test_tools_are_hidden_from_the_template_when_tool_choice_is_none() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert chat(tools=tools).template_tools() == tools
    assert chat(tools=tools, tool_choice="none").template_tools() is None


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_forms(prompt: Any, expected: list[Any]) -> None:
    assert completion(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt", [[], [[]], [[1], []]])
def test_empty_completion_prompts_are_rejected(prompt: Any) -> None:
    assert invalid_field(CompletionRequest, {"prompt": prompt}) == ("prompt", "empty_input")


def test_embedding_and_responses_inputs_are_refused_with_their_code() -> None:
    from kiln.server.embeddings_protocol import MAX_EMBEDDING_INPUTS, EmbeddingRequest
    from kiln.server.responses_protocol import ResponsesRequest

    for empty in ("", [], ["a", ""]):
        assert invalid_field(EmbeddingRequest, {"input": empty}) == ("input", "empty_input")
    many = ["a"] * (MAX_EMBEDDING_INPUTS + 1)
    assert invalid_field(EmbeddingRequest, {"input": many}) == ("input", "request_limit_exceeded")
    assert invalid_field(ResponsesRequest, {"input": []}) == ("input", "empty_input")
    tool = {"input": "hi", "tools": [{"type": "web_search"}]}
    assert invalid_field(ResponsesRequest, tool) == ("tools", "unsupported_value")


def test_a_refusal_names_what_it_refused() -> None:
    """A union (content: a string, or a list of parts) reports the refusal, not "not a string"."""
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    err = error_body(ChatCompletionRequest, {"messages": image})
    assert (err["param"], err["code"]) == ("messages", "unsupported_value")
    assert "'image_url'" in err["message"] and "string" not in err["message"]
    assert invalid_field(ChatCompletionRequest, {"messages": USER, "temperature": "hot"}) == (
        "temperature", "invalid_value")


# -- responses ----------------------------------------------------------------------------------


def test_stream_chunk_delta_lists_only_what_changed() -> None:
    chunk = ChatCompletionChunk(
        id="c",
        created=1,
        model="m",
        choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content="x"))],
    )
    data = json.loads(chunk.model_dump_json())
    assert data["object"] == "chat.completion.chunk"
    assert data["choices"][0]["delta"] == {"content": "x"}
    assert data["choices"][0]["finish_reason"] is None
    final = ChatCompletionStreamChoice(index=0, delta=DeltaMessage(), finish_reason="stop")
    assert json.loads(final.model_dump_json())["delta"] == {}


def test_error_response_shape() -> None:
    body = ErrorResponse(
        error=ErrorInfo(message="m", type="BadRequestError", param="n", code="invalid_value")
    ).model_dump()
    assert body == {
        "error": {"message": "m", "type": "BadRequestError", "param": "n", "code": "invalid_value"}
    }
