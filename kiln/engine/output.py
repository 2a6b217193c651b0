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

It also owns the `n` choices of a request (vLLM v1's ParentRequest and RequestOutputKind):

    add_request(id, n=3) --ParentRequest--> sequences id-0, id-1, id-2 (seed, seed+1, seed+2),
      one group to the scheduler (n=128 cannot take every slot from the requests after it)
    each step: process(sequence) -> its choice's CompletionOutput (index i)
      --take()--> one RequestOutput per request: DELTA, the choices that moved this step;
      FINAL_ONLY, once every choice finished, each whole (folded by `RequestOutput.add`)

An n=1 request runs as one sequence under its own id. The server's routes, `LLM`, `kiln run`
and the request dump read these `RequestOutput`s and nothing else: no front-end fans a request
out or accumulates its pieces itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kiln.engine.request import Request, RequestStatus, TokenLogprob
from kiln.errors import KilnError
from kiln.sampling_params import RequestOutputKind, SamplingParams
from kiln.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


@dataclass
class RequestMetrics:
    """A finished sequence's timings (monotonic seconds) and sizes, as vLLM's request-level
    histograms want them; on the last CompletionOutput of each choice."""

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
class CompletionOutput:
    """One choice of a request: what a step added to it (DELTA), or all of it (FINAL_ONLY)."""

    index: int
    text: str = ""  # stop strings cut, a possible stop's start held back
    # up to the token completing a stop string; never the EOS / stop id
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token, when logprobs were asked for
    # per logprob: where its token's text starts, counted from the choice's start
    text_offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while it runs
    stop_reason: str | int | None = None  # the stop string, or the stop_token_ids entry, that hit
    stop_token_id: int | None = None  # the EOS / stop token that ended it
    num_output_tokens: int = 0  # generated so far (what usage counts), not only these
    metrics: RequestMetrics | None = None  # on the output that finishes the choice

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, later: CompletionOutput) -> None:
        """Folds the choice's next output into this one (offsets already count from the
        choice's start; reasons, counts and metrics are the later output's)."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []  # its own list: the later output's stays as it was
            self.logprobs.extend(later.logprobs)
        self.text_offsets.extend(later.text_offsets)
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason
        self.stop_token_id, self.metrics = later.stop_token_id, later.metrics
        self.num_output_tokens = later.num_output_tokens


@dataclass
class RequestOutput:
    """What a step added to one request (DELTA: the choices that moved), or the whole request
    once every choice has finished (FINAL_ONLY)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool  # every choice has finished
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (the most any choice had)
    # params.prompt_logprobs: one per prompt token (the first None), on the request's first
    # output (its prompt is computed by then), once for all its choices
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt: str | None = None  # the prompt's text, where the caller had one (`LLM.generate`)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def add(self, later: RequestOutput) -> None:
        """Folds a later output of the same request into this one: the one way a request's
        pieces accumulate (FINAL_ONLY here, the request dump of a stream)."""
        for co in later.outputs:
            mine = next((c for c in self.outputs if c.index == co.index), None)
            if mine is None:
                mine = CompletionOutput(co.index)
                self.outputs.append(mine)
                self.outputs.sort(key=lambda c: c.index)
            mine.add(co)
        self.finished = later.finished
        self.num_cached_tokens = max(self.num_cached_tokens, later.num_cached_tokens)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs


class ParentRequest:
    """A request as the engine runs it: its choices' sequences, and what of their outputs
    has not been handed out yet."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 group: str | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        # The scheduler shares sequence slots fairly between groups: a request's choices are
        # one (or the caller's, e.g. a completions request's prompts).
        self.group = group if group is not None or params.n == 1 else request_id
        self.unfinished: set[str] = set()
        self.cached = 0
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.prompt_logprobs_sent = False
        self.step: list[CompletionOutput] = []  # DELTA: this step's, not handed out yet
        self.whole: RequestOutput | None = None  # FINAL_ONLY: every choice so far
        if params.output_kind is RequestOutputKind.FINAL_ONLY:
            lps = params.logprobs is not None
            self.whole = RequestOutput(request_id, prompt_token_ids, [
                CompletionOutput(i, logprobs=[] if lps else None) for i in range(params.n)],
                finished=False)

    def children(self) -> list[tuple[str, SamplingParams]]:
        """(sequence id, its params) per choice: the request itself when n == 1, else
        `{id}-{i}` with its own seed."""
        if self.params.n == 1:
            return [(self.request_id, self.params)]
        return [(f"{self.request_id}-{i}", self.params.for_choice(i))
                for i in range(self.params.n)]

    def record(self, seq_id: str, co: CompletionOutput, num_cached: int,
               prompt_logprobs: list[TokenLogprob | None] | None) -> None:
        self.cached = max(self.cached, num_cached)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = prompt_logprobs
        if co.finished:
            self.unfinished.discard(seq_id)
        if self.whole is not None:
            self.whole.outputs[co.index].add(co)
        else:
            self.step.append(co)

    def take(self) -> RequestOutput | None:
        """The output to hand out now, if any (see RequestOutputKind)."""
        finished = not self.unfinished
        if self.whole is not None:
            if not finished:
                return None
            out = self.whole
            out.finished, out.num_cached_tokens = True, self.cached
            out.prompt_logprobs = self.prompt_logprobs
            return out
        if not self.step:
            return None
        prompt_lps = None
        if self.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            self.prompt_logprobs_sent = True
            prompt_lps = self.prompt_logprobs
        out = RequestOutput(self.request_id, self.prompt_token_ids, self.step, finished,
                            self.cached, prompt_lps)
        self.step = []
        return out


@dataclass
class _Sequence:
    parent: ParentRequest
    index: int  # its choice
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
        self._seqs: dict[str, _Sequence] = {}
        self._parents: dict[str, ParentRequest] = {}
        self._moved: dict[str, ParentRequest] = {}  # with outputs since the last take, in order

    def add(self, parent: ParentRequest, reqs: list[Request]) -> None:
        """Registers a request and its sequences (`reqs`, one per choice, in choice order)."""
        p = parent.params
        if p.stop and self.tokenizer is None:
            raise KilnError("stop strings need a tokenizer, and this engine was built without "
                            "one", hint="pass stop_token_ids, or build the engine with its "
                            "tokenizer")
        for i, req in enumerate(reqs):
            detok = (IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                            skip_special_tokens=p.skip_special_tokens)
                     if self.tokenizer is not None else None)
            matcher = StopStringMatcher(p.stop,
                                        include_stop_str_in_output=p.include_stop_str_in_output)
            self._seqs[req.request_id] = _Sequence(parent, i, detok, matcher)
        parent.unfinished = {r.request_id for r in reqs}
        self._parents[parent.request_id] = parent

    def has(self, request_id: str) -> bool:
        return request_id in self._parents

    def sequences(self, request_id: str) -> list[str]:
        """The ids of the request's sequences still running ([]: none, or no such request)."""
        parent = self._parents.get(request_id)
        return sorted(parent.unfinished) if parent is not None else []

    def parent_of(self, seq_id: str) -> str | None:
        seq = self._seqs.get(seq_id)
        return seq.parent.request_id if seq is not None else None

    def drop(self, request_id: str) -> None:
        """Forgets a request and its sequences without an output (its step failed)."""
        parent = self._parents.pop(request_id, None)
        self._moved.pop(request_id, None)
        if parent is not None:
            for sid in parent.unfinished:
                self._seqs.pop(sid, None)

    @property
    def has_pending(self) -> bool:
        """Outputs are waiting for `take` (an abort's, between steps)."""
        return bool(self._moved)

    def take(self) -> list[RequestOutput]:
        """The requests' outputs made since the last call (see RequestOutputKind)."""
        outputs = []
        for rid, parent in self._moved.items():
            out = parent.take()
            if out is not None:
                outputs.append(out)
            if not parent.unfinished:
                self._parents.pop(rid, None)
        self._moved = {}
        return outputs

    def process(self, req: Request) -> bool:
        """Turns what sequence `req` gained since the last call into its choice's output (handed
        out by `take`); True when a stop string matched (the caller then finishes it)."""
        st = self._seqs[req.request_id]
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
            self._seqs.pop(req.request_id, None)
            metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time,
                                     st.first_token_time, now, st.itl, req.num_prompt_tokens,
                                     num_out, finish_reason or "abort")
        co = CompletionOutput(
            st.index, text="".join(parts), token_ids=taken,
            logprobs=lps[:len(taken)] if lps is not None else None,
            text_offsets=offsets if lps is not None else [],
            finish_reason=(finish_reason or "abort") if finished else None,
            stop_reason=stop_reason, stop_token_id=stop_tok, num_output_tokens=num_out,
            metrics=metrics)
        st.parent.record(req.request_id, co, req.num_cached_tokens, prompt_lps)
        self._moved[st.parent.request_id] = st.parent
        return stopped
