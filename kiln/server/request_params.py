"""What a validated request asks of the engine: the server's caps on one request (RequestLimits,
check_limits), its output constraint (structured_outputs_of, strict_schema) and its
SamplingParams (to_sampling_params).

Ranges (temperature < 0, top_p outside (0, 1], n < 1, ...) are SamplingParams.validate(), the
single source of those rules, reached through `to_sampling_params`; the pydantic models in
protocol.py check only types and what kiln refuses outright.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)
from kiln.server.protocol import ChatCompletionRequest, CompletionRequest


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


# The code of a request over one of the server's caps (--max-n, --max-stop-*): the request is
# valid OpenAI, this server refuses its size.
LIMIT = "request_limit_exceeded"


def check_limits(req: ChatCompletionRequest | CompletionRequest, limits: RequestLimits) -> None:
    """Raises SamplingParamsError naming the field (and the flag) a request goes over; cheap,
    so routes call it before tokenizing anything."""
    best_of = getattr(req, "best_of", None)
    for name, value in (("n", req.n), ("best_of", best_of)):
        if value is not None and value > limits.max_n:
            raise SamplingParamsError(
                name, f"{name} is {value}; this server allows at most {limits.max_n} sequences "
                "per request (--max-n)", code=LIMIT)
    if isinstance(req, CompletionRequest):
        # A batch of prompts starts n sequences for each.
        num_prompts = len(req.prompts())
        if num_prompts * req.n > limits.max_n:
            raise SamplingParamsError(
                "prompt", f"{num_prompts} prompts x n={req.n} is {num_prompts * req.n} "
                f"sequences; this server allows at most {limits.max_n} per request (--max-n)",
                code=LIMIT)
    stops = req.stop_list()
    if len(stops) > limits.max_stop_sequences:
        raise SamplingParamsError(
            "stop", f"{len(stops)} stop sequences; this server allows at most "
            f"{limits.max_stop_sequences} (--max-stop-sequences)", code=LIMIT)
    longest = max(map(len, stops), default=0)
    if longest > limits.max_stop_length:
        raise SamplingParamsError(
            "stop", f"a stop sequence of {longest} characters; this server allows at most "
            f"{limits.max_stop_length} (--max-stop-length)", code=LIMIT)
    if len(req.stop_token_ids or []) > limits.max_stop_sequences:
        raise SamplingParamsError(
            "stop_token_ids", f"{len(req.stop_token_ids or [])} stop token ids; this server "
            f"allows at most {limits.max_stop_sequences} (--max-stop-sequences)", code=LIMIT)


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
                f"json_object, regex, choice, grammar; got {params.kinds() or 'none'}",
                "conflicting_constraints")
        found.append((params, "structured_outputs"))
    if len(found) > 1:
        raise SamplingParamsError(found[1][1], f"{found[0][1]} and {found[1][1]} both constrain "
                                  "the output; give one", "conflicting_constraints")
    return found[0] if found else None


def _context_error(param: str, max_model_len: int, prompt_len: int, max_tokens: int | None,
                   tokens_param: str = "max_tokens") -> None:
    what = "messages" if param == "messages" else "prompt"
    if max_tokens is None:
        raise SamplingParamsError(
            param,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{what} resulted in {prompt_len} tokens, leaving no room for the completion. "
            f"Please reduce the length of the {what}.", code="context_length_exceeded",
        )
    raise SamplingParamsError(
        tokens_param if prompt_len < max_model_len else param,
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the {what}, {max_tokens} in the "
        f"completion). Please reduce the length of the {what} or completion.",
        code="context_length_exceeded",
    )


def to_sampling_params(
    req: ChatCompletionRequest | CompletionRequest, max_model_len: int, prompt_len: int,
) -> SamplingParams:
    """Translate a validated request into SamplingParams for one prompt of `prompt_len` tokens.

    Raises SamplingParamsError(param, message) for anything out of range, including a prompt plus
    max_tokens that does not fit `max_model_len` (vLLM's message, with both numbers). The
    server's caps are `check_limits`, which routes call once per request, before tokenizing.
    """
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
            # A stream shows each step's new text; a JSON answer needs each choice whole.
            output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
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
