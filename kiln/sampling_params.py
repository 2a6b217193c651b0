"""SamplingParams: how one sequence picks its next tokens.

Field names and meanings follow vLLM's SamplingParams (and so the OpenAI API plus vLLM's extras),
so a user moving between the two finds the same knobs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from kiln.errors import KilnError


class RequestOutputKind(str, enum.Enum):
    """How a request's outputs come back (vLLM's RequestOutputKind; the engine's output processor
    makes them, kiln/engine/output.py): DELTA, one output per step carrying what the step added
    to each choice that moved (streams); FINAL_ONLY, one output when every choice has finished,
    carrying each choice whole (a JSON answer, `LLM.generate`)."""

    DELTA = "delta"
    FINAL_ONLY = "final_only"


class SamplingParamsError(KilnError):
    """A sampling field is out of range. `param` names the field (it becomes the OpenAI `param`),
    `code` the OpenAI error code (context_length_exceeded, request_limit_exceeded, ...)."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message, code=code)
        self.param = param


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's `structured_outputs`): exactly one of `json` (a
    JSON schema, as a dict or its text), `json_object` (any JSON object), `regex`, `choice` (one
    of these strings) or `grammar` (EBNF/Lark text). The engine compiles it once per distinct
    value (cached) and masks the logits of the constrained rows each step."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def kinds(self) -> list[str]:
        return [k for k, v in (("json", self.json is not None), ("json_object", self.json_object),
                               ("regex", self.regex is not None),
                               ("choice", self.choice is not None),
                               ("grammar", self.grammar is not None)) if v]


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token (0 = only the sampled one)
    # vLLM's: logprobs of each prompt token (the first has none), with this many top tokens;
    # the whole prompt is computed then (no prefix-cache hit could give its rows' logits)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # None = unconstrained
    # The LoRA adapter (its loaded name, kiln/engine/lora.py) this request runs; None: the base
    lora: str | None = None
    output_kind: RequestOutputKind = RequestOutputKind.DELTA

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise SamplingParamsError(param, msg)

        if self.n < 1:
            bad("n", f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            bad("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad("top_k", f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            bad(
                "frequency_penalty",
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            )
        if self.repetition_penalty <= 0:
            bad(
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", f"prompt_logprobs must be in [0, 20], got "
                f"{self.prompt_logprobs}")
        so = self.structured_outputs
        if so is not None and len(so.kinds()) != 1:
            bad("structured_outputs", "structured_outputs takes exactly one of json, json_object, "
                f"regex, choice, grammar; got {so.kinds() or 'none'}")

    def for_choice(self, index: int) -> SamplingParams:
        """Parameters of choice `index` of an n>1 request: one sequence each, distinct seeds
        (the engine's output processor fans a request out with it, kiln/engine/output.py)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)
