"""Token-budget scheduler: continuous batching with chunked prefill and preemption by recompute.

Every step each request is given the tokens it still lacks (`num_tokens - num_computed_tokens`),
capped by what is left of the step's token budget. Running requests go first (so decodes are never
starved by a long prompt), then waiting requests join while there is budget, blocks and a free
sequence slot. When blocks run out, the most recently arrived running request is preempted: its
blocks are freed and it waits again, to be recomputed from scratch (prompt + what it generated so
far), so nothing is ever lost. Plain Python, no torch.

Fairness between API requests: the sequences of one request (its n choices, its prompts) are a
group. Waiting requests are admitted in order of how many sequences their group runs (fewest
first, then arrival), and when every slot is taken while a group runs nothing, the newest sequence
of the group running the most (two or more) gives up its slot (preempted, recomputed later, its
full blocks found again in the prefix cache). Blocks run short: the victim is taken from the group
running the most too. So `n=128` with `max_tokens` up to the context cannot make a request that
comes after it wait for all of it: the newcomer runs from the next step. With one sequence per
request (the usual case) this is plain first come, first served.

ferrum's scheduler knobs (each off unless set; SchedulerConfig, kiln/settings/engine_config.py):
`prefill_step_chunk` caps the tokens one prefilling request gets per step;
`active_decode_prefill_chunk` caps the prefill tokens of all requests together in a step that also
decodes (decode latency); `prefill_first_until_active` holds decodes back while fewer than N
requests decode and prompts wait (the cohort prefills together, then decodes as one batch);
`sequence_fit_policy` "full-input-must-fit" admits a request only when its whole prompt's blocks are
free (no admission that preemption would undo halfway), "immediate-only" (the default) when its
first chunk's are.

Prefix rendezvous (off unless `prefix_rendezvous_max_wait_ms` is set): a waiting request whose
next uncached prefix block is being prefilled right now by a running request stays in the waiting
queue, for at most that many milliseconds in all, until those blocks are published; requests
behind it are admitted meanwhile. Two identical long prompts that arrive together then prefill
once instead of twice.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.engine.kv_cache import KVCacheManager
from kiln.engine.request import Request, RequestStatus, TokenLogprob
from kiln.settings.engine_config import SchedulerConfig


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens
    sample: bool  # this chunk reaches the end of the sequence: a token is sampled
    # Draft tokens computed after the sequence's last one (the tail of num_new_tokens): the
    # step verifies them (engine/spec.py). Empty without speculative decoding.
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_prefill_tokens: int = 0  # tokens computed that were not the last of the sequence
    num_generated_tokens: int = 0
    num_rendezvous_waits: int = 0  # requests that waited for another's prefill
    num_rendezvous_timeouts: int = 0  # of those, admitted because the wait ran out


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`config`: EngineConfig's scheduler group as it is; `max_model_len`: the context
        loading decided (a request that reaches it ends)."""
        self.config = config
        self.max_model_len = max_model_len
        self.kv = kv
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    # ------------------------------------------------------------------ intake

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        req.status = RequestStatus.WAITING
        if req.session_id is not None and self.kv.sessions is not None:
            self.kv.sessions.touch(req.session_id)
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        """Frees the request's blocks at once; it is never scheduled again."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req)
        req.status = RequestStatus.FINISHED_ABORTED
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._make_room(out)
        cfg = self.config
        decoding = [r for r in self.running if _decodes(r)]
        # Prefill first: while fewer than N requests decode and prompts wait for a slot, the
        # decodes sit this step out so the waiting cohort prefills and joins them.
        hold = (cfg.prefill_first_until_active is not None and self.waiting
                and len(decoding) < cfg.prefill_first_until_active
                and len(self.running) < cfg.max_num_seqs)
        out_held = self._schedule(out, skip_decodes=bool(hold))
        if hold and out_held.empty:  # nothing could prefill (no blocks): decode after all
            out_held = self._schedule(out, skip_decodes=False)
        return out_held

    def _schedule(self, out: SchedulerOutput, skip_decodes: bool) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        kv_preempted = False
        # The prefill tokens a step that decodes may add (all requests together).
        mixed = cfg.active_decode_prefill_chunk is not None and not skip_decodes and any(
            _decodes(r) for r in self.running)
        prefill_left = cfg.active_decode_prefill_chunk if mixed else None

        def prefill_cap(n: int) -> int:
            if cfg.prefill_step_chunk is not None:
                n = min(n, cfg.prefill_step_chunk)
            return n if prefill_left is None else min(n, prefill_left)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            prefill = not _decodes(req)
            if skip_decodes and not prefill:
                i += 1
                continue
            # Drafted tokens are just more tokens the request lacks (cut first by the budget).
            n = min(req.num_tokens + len(req.spec_token_ids) - req.num_computed_tokens, budget)
            if prefill:
                n = prefill_cap(n)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate(req, n):
                victim = self._victim(i)
                self._preempt(victim)
                out.preempted.append(victim)
                kv_preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req preempted itself: the blocks are short, nothing more this step
            num_spec = req.num_computed_tokens + n - req.num_tokens
            out.scheduled.append(ScheduledRequest(req, n, num_spec >= 0,
                                                  req.spec_token_ids[:max(num_spec, 0)]))
            scheduled_ids.add(req.request_id)
            budget -= n
            if prefill and prefill_left is not None:
                prefill_left -= n
            i += 1

        # Requests preempted this step wait until the next one: re-admitting them now would
        # just thrash against the blocks we freed for the running ones.
        rendezvous = (self.config.prefix_rendezvous_max_wait_ms is not None
                      and self.kv.enable_prefix_caching)
        in_flight = self._blocks_in_flight() if rendezvous and self.waiting else set()
        admitted: list[int] = []
        for idx in self._admission_order() if not kv_preempted else []:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs or \
                    (prefill_left is not None and prefill_left <= 0):
                break
            req = self.waiting[idx]
            # Prompt logprobs need every prompt row's logits: no cached prefix (as in vLLM),
            # so nothing to wait for either.
            whole = req.params.prompt_logprobs is not None
            hits = (self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0
                    and not whole else [])
            verdict = "go"
            if rendezvous and not whole:
                verdict = self._rendezvous(req, len(hits), in_flight)
                if verdict == "wait":
                    continue  # stays in line; the requests behind it may go
            num_computed = len(hits) * self.kv.block_size
            if cfg.sequence_fit_policy == "full-input-must-fit":
                # Its whole prompt's blocks, beyond the hits, must be free now: first come,
                # first served, so the requests behind it wait too.
                free = self.kv.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0)
                if self.kv.blocks_needed(req.num_tokens) - len(hits) > free:
                    break
            n = prefill_cap(min(req.num_tokens - num_computed, budget))
            if n <= 0:
                break
            req_computed_before = req.num_computed_tokens
            req.num_computed_tokens = num_computed
            if not self.kv.allocate(req, n, hits):
                req.num_computed_tokens = req_computed_before
                break
            admitted.append(idx)
            if rendezvous:
                in_flight.update(self._uncached_hashes(req))
                if verdict == "timeout":
                    self.stats.num_rendezvous_timeouts += 1
            if req.num_preemptions == 0:
                self.kv.record_prefix_query(req.num_tokens, num_computed)
                req.num_cached_tokens = num_computed
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, num_computed + n == req.num_tokens))
            budget -= n
            if prefill_left is not None:
                prefill_left -= n
        for idx in sorted(admitted, reverse=True):
            del self.waiting[idx]
        return out

    # ------------------------------------------------------------------ fairness

    def _admission_order(self) -> list[int]:
        """Indices into `waiting`: requests whose group runs fewer sequences first, arrival
        order among equals (plain FCFS when every request is one sequence)."""
        counts = Counter(r.group_key for r in self.running)
        order = range(len(self.waiting))
        if not counts:
            return list(order)
        return sorted(order, key=lambda i: counts.get(self.waiting[i].group_key, 0))

    def _victim(self, start: int) -> Request:
        """Whom to preempt when blocks run short, among running[start:] (those not yet given
        tokens this step): the newest sequence of the group running the most; with one
        sequence per request, the newest."""
        counts = Counter(r.group_key for r in self.running)
        candidates = self.running[start:]
        top = max(counts[r.group_key] for r in candidates)
        return next(r for r in reversed(candidates) if counts[r.group_key] == top)

    def _make_room(self, out: SchedulerOutput) -> None:
        """Every slot taken and a waiting group runs nothing: for each such group (in arrival
        order) the newest sequence of the group running the most, if it runs two or more, gives
        up its slot. No ping-pong: a preempted sequence's group still runs one or more."""
        if len(self.running) < self.config.max_num_seqs or not self.waiting:
            return
        counts = Counter(r.group_key for r in self.running)
        if max(counts.values()) < 2:
            return
        starved: dict[str, None] = {}  # groups, in arrival order
        for req in self.waiting:
            if counts.get(req.group_key, 0) == 0:
                starved[req.group_key] = None
                if len(starved) >= self.config.max_num_seqs:
                    break
        for g in starved:
            top_group, top = counts.most_common(1)[0]
            if top < 2:
                break
            victim = next(r for r in reversed(self.running) if r.group_key == top_group)
            self._preempt(victim)
            out.preempted.append(victim)
            counts[top_group] -= 1
            counts[g] += 1  # its slot, taken when it is admitted below

    # ------------------------------------------------------------------ prefix rendezvous

    def _uncached_hashes(self, req: Request) -> list[int]:
        """Hashes of the request's full blocks its KV does not cover yet: they are published
        once computed."""
        self.kv.update_block_hashes(req)
        return req.block_hashes[req.num_computed_tokens // self.kv.block_size:]

    def _blocks_in_flight(self) -> set[int]:
        hashes: set[int] = set()
        for r in self.running:
            if r.num_computed_tokens < r.num_tokens - 1:  # still prefilling
                hashes.update(self._uncached_hashes(r))
        return hashes

    def _rendezvous(self, req: Request, num_hits: int, in_flight: set[int]) -> str:
        """"wait" if `req` should stay waiting: the block after its cached prefix is being
        computed by a running request, and its wait (counted from the first) has not run out;
        "timeout" if it would wait but may not any more; "go" otherwise."""
        max_wait = self.config.prefix_rendezvous_max_wait_ms
        assert max_wait is not None
        if num_hits >= (req.num_tokens - 1) // self.kv.block_size:
            return "go"  # nothing more to find: the last token is always computed
        if req.block_hashes[num_hits] not in in_flight:
            return "go"
        now = self.clock()
        if req.rendezvous_since is None:
            req.rendezvous_since = now
            self.stats.num_rendezvous_waits += 1
        return "wait" if (now - req.rendezvous_since) * 1000.0 < max_wait else "timeout"


    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.spec_draft_probs = None
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ results

    def update(self, out: SchedulerOutput, sampled: dict[str, int | list[int]],
               logprobs: dict[str, TokenLogprob | list[TokenLogprob]] | None = None,
               prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] | None = None
               ) -> list[Request]:
        """Advances the scheduled requests by what the model computed; appends sampled tokens and
        finishes requests that hit a stop. Returns the requests that got a token or finished.
        A row that verified drafts gets a list: the drafts accepted, then the token sampled
        after them (engine/spec.py); the rejected drafts' KV is rolled back.
        `prompt_logprobs`: request id -> (first prompt position scored, its logprobs)."""
        touched: list[Request] = []
        for s in out.scheduled:
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted between schedule and update
            if prompt_logprobs and req.request_id in prompt_logprobs:
                _add_prompt_logprobs(req, *prompt_logprobs[req.request_id])
            req.num_computed_tokens += s.num_new_tokens
            if not s.sample:
                self.stats.num_prefill_tokens += s.num_new_tokens
                self.kv.cache_full_blocks(req)
                continue
            num_spec = len(s.spec_token_ids)
            self.stats.num_prefill_tokens += s.num_new_tokens - 1 - num_spec
            got = sampled[req.request_id]
            tokens = got if isinstance(got, list) else [got]
            lps = logprobs.get(req.request_id) if logprobs is not None else None
            lp_list = lps if isinstance(lps, list) else [lps] if lps is not None else []
            if num_spec:
                # The drafts past the accepted ones were computed on a wrong guess: their KV
                # is stale, and the blocks that only they reached go back.
                req.num_computed_tokens -= num_spec - (len(tokens) - 1)
                self.kv.trim(req, req.num_tokens + len(tokens))
            self.kv.cache_full_blocks(req)  # before appending: only computed tokens are cached
            status = None
            for j, token in enumerate(tokens):
                req.output_token_ids.append(token)
                if j < len(lp_list):
                    req.output_logprobs.append(lp_list[j])
                self.stats.num_generated_tokens += 1
                status = self._check_stop(req, token)
                if req.grammar is not None:
                    req.grammar.accept(token)
                    if req.grammar.done and status is not RequestStatus.FINISHED_STOPPED:
                        # Complete: nothing but EOS could follow, so it ends now, token kept.
                        status = RequestStatus.FINISHED_GRAMMAR
                if status is not None:
                    break  # the tokens after a stop are dropped
            req.spec_token_ids = []
            if status is not None:
                if num_spec:  # publish the accepted drafts' blocks before they are freed
                    req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
                    self.kv.cache_full_blocks(req)
                self.finish(req, status)
            touched.append(req)
        return touched

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.params
        n_out = req.num_output_tokens
        if n_out >= p.min_tokens:
            if token in p.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if not p.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Ends a running request (a stop, or a stop string the output processor found) and
        frees its blocks."""
        req.status = status
        self.running.remove(req)
        self.requests.pop(req.request_id, None)
        if req.session_id is not None and self.kv.sessions is not None:
            # Pin this turn's prefix before the request lets go of its blocks.
            self.kv.sessions.remember(req.session_id, req)
        self.kv.free(req)

    def all_requests(self) -> list[Request]:
        return list(self.running) + list(self.waiting)


def _add_prompt_logprobs(req: Request, first: int, lps: list[TokenLogprob]) -> None:
    """Each prompt position once: a preempted request recomputes its prompt, and the positions
    it already scored are skipped."""
    if not req.prompt_logprobs:
        req.prompt_logprobs.append(None)  # the first prompt token has nothing before it
    for p, lp in enumerate(lps, start=first):
        if p == len(req.prompt_logprobs):
            req.prompt_logprobs.append(lp)


def _decodes(req: Request) -> bool:
    """Its prompt (and any recomputed output) is in the KV cache: it needs one token a step
    (plus drafts); otherwise it is prefilling."""
    return req.num_tokens - req.num_computed_tokens <= 1
