"""THE output processor: a request's new tokens -> what every front-end shows.

The server, the offline `LLM` and `kiln run` all read the same `RequestOutput`s, made here, so
they cannot disagree about text, stop strings, EOS or logprobs (vLLM v1 has one OutputProcessor
for the same reason). Per request and step it:

  * drops the token that ended the sequence (EOS or a `stop_token_ids` entry) from the text and
    the token ids: it is reported as `stop_token_id` (and as `stop_reason` for stop ids, as vLLM
    does);
  * detokenizes incrementally (kiln/tokenizer.py: multi-byte characters held until whole);
  * applies stop strings once `min_tokens` are out, holding back text that may start one, so a
    stop split over tokens never reaches a stream; a match cuts the text and returns True, and
    the engine then finishes the request at once (its KV blocks go back in the same step);
  * keeps for each logprob the offset of its token's text in the output (for OpenAI's
    completions `text_offset`).

Without a tokenizer (tests that drive the engine on token ids) text stays empty and stop strings
are refused when the request is added.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kiln.engine.request import Request, RequestStatus, TokenLogprob
from kiln.errors import KilnError
from kiln.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


@dataclass
class RequestMetrics:
    """A finished request's timings (monotonic seconds) and sizes, as vLLM's request-level
    histograms want them; on the last RequestOutput of each request."""

    arrival_time: float
    first_scheduled_time: float | None  # None: aborted while still waiting
    first_token_time: float | None  # None: no token came out
    finished_time: float
    inter_token_latencies: list[float]  # seconds between consecutive outputs with tokens
    num_prompt_tokens: int
    num_generation_tokens: int
    finish_reason: str

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float:
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """What one step added to one request."""

    request_id: str
    new_token_ids: list[int]  # up to the token completing a stop string; never the EOS/stop id
    new_logprobs: list[TokenLogprob] | None  # one per new token, when logprobs were asked for
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    text: str = ""  # the new text (stop strings cut, a possible stop's start held back)
    text_offsets: list[int] = field(default_factory=list)  # per new logprob: its text's start
    stop_token_id: int | None = None  # the EOS / stop token that ended it
    stop_reason: str | int | None = None  # the stop string, or the stop_token_ids entry, that hit
    metrics: RequestMetrics | None = None  # on the output that finishes the request
    # params.prompt_logprobs: one per prompt token (the first None), on the request's first
    # output (its prompt is computed by then)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class _Stream:
    detok: IncrementalDetokenizer | None
    matcher: StopStringMatcher
    emitted: int = 0  # output tokens already handed out
    first_token_time: float | None = None
    last_token_time: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_logprobs_sent: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._streams: dict[str, _Stream] = {}

    def add(self, req: Request) -> None:
        p = req.params
        if p.stop and self.tokenizer is None:
            raise KilnError("stop strings need a tokenizer, and this engine was built without "
                            "one", hint="pass stop_token_ids, or build the engine with its "
                            "tokenizer")
        detok = (IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                        skip_special_tokens=p.skip_special_tokens)
                 if self.tokenizer is not None else None)
        matcher = StopStringMatcher(p.stop, include_stop_str_in_output=p.include_stop_str_in_output)
        self._streams[req.request_id] = _Stream(detok, matcher)

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def process(self, req: Request) -> tuple[RequestOutput, bool]:
        """The output for what `req` gained since the last call, and whether a stop string
        matched (the caller then finishes the request)."""
        st = self._streams[req.request_id]
        p = req.params
        new = req.output_token_ids[st.emitted:]
        lps = req.output_logprobs[st.emitted:] if p.logprobs is not None else None
        stop_tok = None
        if req.status is RequestStatus.FINISHED_STOPPED and new:
            # The scheduler finished it on an EOS / stop token: reported, not part of the text.
            stop_tok, new = new[-1], new[:-1]
            lps = lps[:-1] if lps is not None else None
        taken: list[int] = []
        offsets: list[int] = []
        parts: list[str] = []
        stopped = False
        for tok in new:
            taken.append(tok)
            if st.detok is None:
                continue
            offsets.append(len(st.detok.text))
            piece = st.detok.step(tok)
            if st.emitted + len(taken) <= p.min_tokens:
                parts.append(piece)  # no stop string may end it before min_tokens
                continue
            emit, stopped = st.matcher.feed(piece)
            parts.append(emit)
            if stopped:
                break
        if req.is_finished and not stopped and st.detok is not None:
            emit, stopped = st.matcher.feed(st.detok.flush())
            parts.append(emit)
            if not stopped:
                parts.append(st.matcher.flush())
        st.emitted += len(taken) + (1 if stop_tok is not None else 0)
        now = time.monotonic()
        if new or stop_tok is not None:
            # A step's tokens arrive together: one interval per output, as vLLM measures it.
            if st.first_token_time is None:
                st.first_token_time = now
            else:
                st.itl.append(now - st.last_token_time)
            st.last_token_time = now
        finished = req.is_finished or stopped
        prompt_lps = None
        if p.prompt_logprobs is not None and not st.prompt_logprobs_sent:
            st.prompt_logprobs_sent = True
            prompt_lps = list(req.prompt_logprobs) or [None]  # one token: nothing to score
        if stopped:
            finish_reason: str | None = "stop"
            stop_reason: str | int | None = st.matcher.stop_reason
            # Count only what the client gets: tokens up to the one completing the stop.
            num_out = st.emitted
        else:
            finish_reason = req.status.finish_reason
            stop_reason = stop_tok if stop_tok is not None and stop_tok in p.stop_token_ids \
                else None
            num_out = req.num_output_tokens
        metrics = None
        if finished:
            self.forget(req.request_id)
            metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time,
                                     st.first_token_time, now, st.itl, req.num_prompt_tokens,
                                     num_out, finish_reason or "abort")
        return RequestOutput(
            request_id=req.request_id, new_token_ids=taken,
            new_logprobs=lps[:len(taken)] if lps is not None else None, finished=finished,
            finish_reason=finish_reason, num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=num_out, num_cached_tokens=req.num_cached_tokens,
            text="".join(parts), text_offsets=offsets if lps is not None else [],
            stop_token_id=stop_tok, stop_reason=stop_reason, metrics=metrics,
            prompt_logprobs=prompt_lps), stopped
