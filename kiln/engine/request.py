"""Request: one sequence the engine is generating, and how far its KV cache reaches.

The single counter `num_computed_tokens` is the whole story of a request's progress: the scheduler
gives it `num_tokens - num_computed_tokens` more tokens each step (capped by the budget). A fresh
prompt, a chunked prefill, a prefix-cache hit and a decode step are all the same rule.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kiln.engine.structured import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to recompute its KV from scratch
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token
    FINISHED_GRAMMAR = "finished_grammar"  # its grammar is complete (the last token is text)
    FINISHED_LENGTH = "finished_length"  # max_tokens or the context length
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")

    @property
    def finish_reason(self) -> str | None:
        return {"finished_stopped": "stop", "finished_grammar": "stop",
                "finished_length": "length", "finished_aborted": "abort"}.get(self.value)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first
    rank: int | None = None  # 1 + how many tokens were likelier (prompt logprobs report it)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None  # extra key of the prefix-cache hashes: no sharing across salts
    # LoRA adapter id (kiln/engine/lora.py; 0: the base model), also a prefix-cache extra key
    lora_id: int = 0
    session_id: str | None = None  # conversation: the session cache pins its prefix between turns
    # The API request it belongs to (its n choices, its prompts): the scheduler shares sequence
    # slots fairly between groups. None: a group of its own.
    group: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # When the scheduler first gave it tokens (the end of its queue time, for /metrics).
    first_scheduled_time: float | None = None

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # params.prompt_logprobs: entry p scores prompt token p given the ones before; [0] is None
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first schedule
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of full blocks, in order
    # Serial of the cached block holding each leading full block (see kv_cache.py); None ends
    # it (a hash collision). Reset when the request's blocks are freed.
    cached_chain: list[int | None] = field(default_factory=list)
    rendezvous_since: float | None = None  # when it began waiting for another's prefill
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    max_tokens: int = 0  # resolved by the engine: params.max_tokens capped by the context
    # params.structured_outputs' matcher (engine/structured.py), made at admission; None:
    # unconstrained, and the sampler's only cost for such a row is testing this for None.
    grammar: GrammarMatcher | None = None
    # Speculative decoding (engine/spec.py): tokens drafted after the last one, not yet checked.
    # The scheduler computes them with the rest (they are just more tokens the request lacks);
    # the step's verification keeps the ones the model agrees with and rolls the others back.
    spec_token_ids: list[int] = field(default_factory=list)
    # A draft model's distributions those drafts were drawn from, [len(spec_token_ids), vocab]
    # (engine/draft.py), for rejection sampling; None: deterministic drafts (n-gram, greedy).
    spec_draft_probs: Any = None

    @property
    def group_key(self) -> str:
        return self.group or self.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def is_finished(self) -> bool:
        return self.status.finished
