"""Scheduler: token budget, fairness, max_num_seqs, abort, chunked prefill, preemption, prefix
rendezvous. Plain Python: a fake model picks each token from the tokens so far, so an output is
wrong if a token is lost, duplicated, or computed from the wrong context."""

from __future__ import annotations

import random
import zlib
from dataclasses import replace

from kiln.engine.kv_cache import KVCacheManager
from kiln.engine.request import Request, RequestStatus
from kiln.engine.scheduler import Scheduler
from kiln.sampling_params import SamplingParams
from kiln.settings.engine_config import SchedulerConfig

BS = 4


def fake_token(tokens: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) % 997) + 1


def make_sched(num_blocks: int = 64, budget: int = 32, max_seqs: int = 8,
               max_model_len: int | None = None, rendezvous_ms: int | None = None,
               clock=None, **kv_kw) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, **kv_kw)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          prefix_rendezvous_max_wait_ms=rendezvous_ms)
    mml = max_model_len or num_blocks * BS
    return Scheduler(cfg, kv, mml, clock=clock) if clock else Scheduler(cfg, kv, mml)


def make_req(rid: str, prompt: list[int] | int, max_tokens: int = 4, **kw) -> Request:
    """`prompt` as a number of tokens: distinct per request id (no accidental prefix hits)."""
    base = zlib.crc32(rid.encode()) % 1000
    ids = ([1000 + base * 50 + i for i in range(prompt)] if isinstance(prompt, int)
           else list(prompt))
    r = Request(rid, ids, SamplingParams(max_tokens=max_tokens), **kw)
    r.max_tokens = max_tokens
    return r


class Driver:
    """Runs schedule -> fake model -> update, checking the invariants at every step."""

    def __init__(self, sched: Scheduler) -> None:
        self.s = sched
        self.steps: list = []  # SchedulerOutput of each step
        self.outputs: dict[str, list[int]] = {}

    def step(self):
        s = self.s
        before = {r.request_id: r.num_computed_tokens for r in s.running}
        out = s.schedule()
        assert out.num_tokens <= s.config.max_num_batched_tokens, "token budget exceeded"
        assert len(s.running) <= s.config.max_num_seqs, "max_num_seqs exceeded"
        assert len({x.request.request_id for x in out.scheduled}) == len(out.scheduled)
        for x in out.scheduled:
            r = x.request
            assert x.num_new_tokens > 0
            assert r.num_computed_tokens + x.num_new_tokens <= r.num_tokens
            assert len(r.block_ids) * BS >= r.num_computed_tokens + x.num_new_tokens
            if r.request_id in before and r not in out.preempted:
                assert r.num_computed_tokens == before[r.request_id]
        s.kv.check_integrity(s.all_requests())
        sampled = {x.request.request_id: fake_token(x.request.all_token_ids)
                   for x in out.scheduled if x.sample}
        for r in s.update(out, sampled):
            self.outputs.setdefault(r.request_id, []).append(r.output_token_ids[-1])
        s.kv.check_integrity(s.all_requests())
        self.steps.append(out)
        return out

    def run(self, max_steps: int = 10_000) -> dict[str, list[int]]:
        for _ in range(max_steps):
            if not self.s.has_work:
                return self.outputs
            self.step()
        raise AssertionError("the scheduler made no progress")


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    out = []
    for _ in range(max_tokens):
        t = fake_token(toks)
        out.append(t)
        toks.append(t)
    return out


def run_random_arrivals(s: Scheduler, rng: random.Random, n: int) -> Driver:
    """n requests of random prompts and lengths, 0-2 arriving before each step, driven until
    all finish; every one must end at its length with its own tokens, and every block come
    back. Returns the driver (its per-step records)."""
    d = Driver(s)
    reqs = [make_req(f"r{i}", [rng.randrange(1, 50) for _ in range(rng.randrange(1, 60))],
                     max_tokens=rng.randrange(1, 12)) for i in range(n)]
    pending = list(reqs)
    while pending or s.has_work:
        for _ in range(rng.randrange(0, 3)):
            if pending:
                s.add_request(pending.pop(0))
        if s.has_work:
            d.step()
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert d.outputs[r.request_id] == expected_output(r.prompt_token_ids, r.max_tokens)
    assert s.kv.num_free_blocks == s.kv.num_blocks
    return d


def test_budget_and_max_num_seqs_hold_under_random_load_and_every_request_completes():
    run_random_arrivals(make_sched(num_blocks=48, budget=24, max_seqs=4), random.Random(0), 30)


def test_running_requests_are_scheduled_before_waiting_ones():
    s = make_sched(budget=16)
    d = Driver(s)
    a = make_req("a", 5, max_tokens=8)
    s.add_request(a)
    d.step()  # a's prompt
    b = make_req("b", 40)
    s.add_request(b)
    out = d.step()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1),
                                                                               ("b", 15)]


def test_admission_is_first_come_first_served():
    s = make_sched(budget=64, max_seqs=2)
    d = Driver(s)
    for i in range(5):
        s.add_request(make_req(f"r{i}", 3 + i, max_tokens=2 + i % 2))
    admitted: list[str] = []
    while s.has_work:
        out = d.step()
        for x in out.scheduled:
            if x.request.request_id not in admitted:
                admitted.append(x.request.request_id)
    assert admitted == [f"r{i}" for i in range(5)]


def test_a_head_request_that_does_not_fit_is_not_overtaken():
    s = make_sched(num_blocks=8, budget=64)
    d = Driver(s)
    s.add_request(make_req("big", 20, max_tokens=4))  # 5-6 blocks of 8
    d.step()
    s.add_request(make_req("second-big", 20, max_tokens=2))
    s.add_request(make_req("small", 2, max_tokens=2))
    out = d.step()
    assert [x.request.request_id for x in out.scheduled] == ["big"]  # small waits its turn
    d.run()
    assert set(d.outputs) == {"big", "second-big", "small"}


def test_abort_frees_blocks_at_once_and_the_request_never_runs_again():
    s = make_sched(num_blocks=16)
    d = Driver(s)
    a, b, c = make_req("a", 10, 8), make_req("b", 10, 8), make_req("c", 10, 8)
    for r in (a, b):
        s.add_request(r)
    d.step()
    s.add_request(c)  # waiting
    assert a.block_ids and s.kv.num_free_blocks < 16
    free_before = s.kv.num_free_blocks
    held = len(a.block_ids)
    assert s.abort("a") is a
    assert a.status is RequestStatus.FINISHED_ABORTED and a.block_ids == []
    assert s.kv.num_free_blocks == free_before + held
    s.kv.check_integrity(s.all_requests())
    assert s.abort("c") is c and c not in s.waiting
    assert s.abort("nope") is None
    # Aborted between schedule and update: the update skips it.
    out = s.schedule()
    s.abort("b")
    assert s.update(out, {"b": 5}) == [] and b.output_token_ids == [fake_token(b.prompt_token_ids)]
    d.run()
    assert "a" not in d.outputs or len(d.outputs["a"]) == 1
    assert s.kv.num_free_blocks == 16


def test_long_prompt_is_prefilled_in_chunks_of_the_budget():
    s = make_sched(budget=32)
    d = Driver(s)
    r = make_req("long", 100, max_tokens=3)
    s.add_request(r)
    d.run()
    chunks = [(x.num_new_tokens, x.sample) for out in d.steps for x in out.scheduled]
    assert chunks == [(32, False), (32, False), (32, False), (4, True), (1, True), (1, True)]
    assert d.outputs["long"] == expected_output(r.prompt_token_ids, 3)
    assert s.stats.num_prefill_tokens == 99


def test_chunked_prefill_shares_the_budget_with_decodes():
    s = make_sched(budget=16)
    d = Driver(s)
    s.add_request(make_req("dec", 4, max_tokens=10))
    d.step()
    s.add_request(make_req("long", 50, max_tokens=1))
    sizes = []
    while s.has_work:
        out = d.step()
        sizes.append({x.request.request_id: x.num_new_tokens for x in out.scheduled})
    assert sizes[0] == {"dec": 1, "long": 15} and sizes[1] == {"dec": 1, "long": 15}
    assert sizes[2] == {"dec": 1, "long": 15} and sizes[3] == {"dec": 1, "long": 5}


def test_preemption_by_recompute_loses_nothing():
    prompts = {f"r{i}": [i + 1] * (6 + i) for i in range(5)}
    want = {rid: expected_output(p, 14) for rid, p in prompts.items()}
    s = make_sched(num_blocks=10, budget=64, max_seqs=8)  # 5 x ~5 blocks do not fit in 10
    for rid, p in prompts.items():
        s.add_request(make_req(rid, p, max_tokens=14))
    d = Driver(s)
    preempted = []
    while s.has_work:
        out = d.step()
        for v in out.preempted:
            assert v.status is RequestStatus.PREEMPTED and v.num_computed_tokens == 0
            assert v.block_ids == [] and v in s.waiting
            preempted.append(v.request_id)
    assert preempted, "the pool was meant to be too small"
    assert s.stats.num_preemptions == len(preempted)
    assert d.outputs == want
    assert s.kv.num_free_blocks == 10


def test_the_most_recent_running_request_is_preempted_first():
    s = make_sched(num_blocks=6, budget=64)
    d = Driver(s)
    old, new = make_req("old", 12, max_tokens=8), make_req("new", 12, max_tokens=8)
    s.add_request(old)
    s.add_request(new)
    d.step()  # 3 blocks each: the pool is full
    out = d.step()  # both need a 4th block
    assert [v.request_id for v in out.preempted] == ["new"]
    assert [x.request.request_id for x in out.scheduled] == ["old"]
    d.run()
    assert d.outputs["new"] == expected_output(new.prompt_token_ids, 8)


def test_a_request_with_many_sequences_does_not_starve_the_next_request():
    """n=12 long sequences of one API request fill every slot; a one-sequence request that
    arrives later runs from the next step and finishes while the big one is far from done;
    every output is still exactly right (the preempted sequences were recomputed)."""
    s = make_sched(num_blocks=256, budget=64, max_seqs=4)
    d = Driver(s)
    big = [make_req(f"big-{i}", 6, max_tokens=40, group="big") for i in range(12)]
    for r in big:
        s.add_request(r)
    for _ in range(3):
        d.step()
    assert len(s.running) == 4 and all(r.group == "big" for r in s.running)
    small = make_req("small", 5, max_tokens=3)
    s.add_request(small)
    out = d.step()
    assert small in [x.request for x in out.scheduled]  # at once, not after 12 x 40 tokens
    assert len(out.preempted) == 1 and out.preempted[0].group == "big"
    while not small.is_finished:
        d.step()
    assert sum(not r.is_finished for r in big) >= 8
    d.run()
    assert d.outputs["small"] == expected_output(small.prompt_token_ids, 3)
    for r in big:
        assert d.outputs[r.request_id] == expected_output(r.prompt_token_ids, 40)
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_single_sequence_requests_never_preempt_each_other_for_fairness():
    s = make_sched(num_blocks=256, budget=64, max_seqs=2)
    d = Driver(s)
    for i in range(4):
        s.add_request(make_req(f"r{i}", 4, max_tokens=6))
    while s.has_work:
        assert not d.step().preempted


def test_short_blocks_preempt_the_group_running_the_most():
    s = make_sched(num_blocks=9, budget=64, max_seqs=8)
    d = Driver(s)
    for i in range(2):
        s.add_request(make_req(f"big-{i}", 8, max_tokens=8, group="big"))
    solo = make_req("solo", 8, max_tokens=8)  # the newest: it used to be the victim
    s.add_request(solo)
    out = d.step()
    while not out.preempted:  # 3 x 3 blocks fill the pool; the 4th blocks do not fit
        out = d.step()
    assert [v.request_id for v in out.preempted] == ["big-1"]
    d.run()
    assert d.outputs["solo"] == expected_output(solo.prompt_token_ids, 8)


def test_a_request_alone_in_a_full_pool_always_fits():
    s = make_sched(num_blocks=4, budget=8)  # max_model_len = pool capacity = 16
    s.add_request(make_req("r", 6, max_tokens=10))
    d = Driver(s)
    d.run()
    assert len(d.outputs["r"]) == 10 and s.stats.num_preemptions == 0


# --------------------------------------------------------------------------- prefix rendezvous


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_identical_prompts_arriving_together_prefill_once_with_rendezvous():
    def computed(rendezvous_ms):
        s = make_sched(num_blocks=64, budget=100, rendezvous_ms=rendezvous_ms, clock=Clock())
        prompt = list(range(1, 41))
        a, b = make_req("a", prompt, max_tokens=3), make_req("b", prompt, max_tokens=3)
        s.add_request(a)
        s.add_request(b)
        d = Driver(s)
        first = d.step()
        d.run()
        assert d.outputs["a"] == d.outputs["b"] == expected_output(a.prompt_token_ids, 3)
        return s, first, b

    s, first, b = computed(None)
    assert len(first.scheduled) == 2 and s.stats.num_prefill_tokens == 2 * 39
    s, first, b = computed(10_000)
    assert [x.request.request_id for x in first.scheduled] == ["a"]  # b waits for a's blocks
    assert b.num_cached_tokens == 36  # (40 - 1) // 4 blocks came from a
    assert s.stats.num_prefill_tokens == 39 + 3
    assert s.stats.num_rendezvous_waits == 1 and s.stats.num_rendezvous_timeouts == 0


def test_a_rendezvous_does_not_block_the_requests_behind_it():
    s = make_sched(num_blocks=64, budget=40, rendezvous_ms=10_000, clock=Clock())
    d = Driver(s)
    prompt = list(range(1, 61))
    s.add_request(make_req("a", prompt, max_tokens=2))
    d.step()  # a prefills its first 40 tokens
    twin = make_req("twin", prompt, max_tokens=2)
    s.add_request(twin)
    s.add_request(make_req("other", 4, max_tokens=2))
    out = d.step()  # a's last 20 tokens; twin waits for blocks 10-14, other goes past it
    ids = [x.request.request_id for x in out.scheduled]
    assert ids == ["a", "other"] and [r.request_id for r in s.waiting] == ["twin"]
    out = d.step()
    assert ("twin", 4) in [(x.request.request_id, x.num_new_tokens) for x in out.scheduled]
    d.run()
    assert twin.num_cached_tokens == 56 and d.outputs["twin"] == d.outputs["a"]
    assert s.requests == {} and s.stats.num_rendezvous_timeouts == 0


def test_a_rendezvous_gives_up_after_the_max_wait():
    clock = Clock()
    s = make_sched(num_blocks=64, budget=16, rendezvous_ms=50, clock=clock)
    prompt = list(range(1, 81))
    s.add_request(make_req("a", prompt, max_tokens=1))
    Driver(s).step()  # a is prefilling: its blocks 4.. are in flight
    twin = make_req("twin", prompt, max_tokens=1)
    hits = s.kv.find_cached_prefix(twin)
    in_flight = s._blocks_in_flight()
    assert len(hits) == 4 and twin.block_hashes[4] in in_flight
    assert s._rendezvous(twin, len(hits), in_flight) == "wait"
    clock.t = 0.049
    assert s._rendezvous(twin, len(hits), in_flight) == "wait"
    clock.t = 0.050
    assert s._rendezvous(twin, len(hits), in_flight) == "timeout"
    assert s._rendezvous(twin, len(hits), set()) == "go"  # nothing in flight: no wait at all
    assert s.stats.num_rendezvous_waits == 1
    # Given up: admitted (and counted) as soon as there is room, although a still prefills.
    s.add_request(twin)
    s.config = replace(s.config, max_num_batched_tokens=100)
    out = Driver(s).step()
    assert [x.request.request_id for x in out.scheduled] == ["a", "twin"]
    assert s.stats.num_rendezvous_timeouts == 1


def test_rendezvous_is_off_without_prefix_caching():
    s = make_sched(budget=100, rendezvous_ms=10_000, clock=Clock(), enable_prefix_caching=False)
    s.add_request(make_req("a", 40))
    s.add_request(make_req("b", 40))
    assert len(Driver(s).step().scheduled) == 2


# --------------------------------------------------------------------------- session cache


def run_conversation(session_entries: int) -> tuple[Scheduler, Request]:
    s = make_sched(num_blocks=16, budget=64, session_max_entries=session_entries)
    d = Driver(s)
    t1 = make_req("t1", 12, max_tokens=3, session_id="conv")
    s.add_request(t1)
    d.run()
    # Traffic, one request at a time, that cycles through every unpinned block.
    for i in range(4):
        s.add_request(make_req(f"o{i}", 22, max_tokens=2))
        d.run()
    t2 = make_req("t2", t1.all_token_ids + [77, 78], max_tokens=2, session_id="conv")
    s.add_request(t2)
    d.run()
    return s, t2


def test_finished_session_turn_stays_pinned_and_the_next_turn_hits_it():
    s, t2 = run_conversation(session_entries=0)  # no session cache: the traffic evicted turn 1
    assert t2.num_cached_tokens == 0
    s, t2 = run_conversation(session_entries=4)
    assert t2.num_cached_tokens == 12  # 14 computed tokens of turn 1: 3 full blocks
    assert len(s.kv.sessions) == 1 and s.kv.sessions.num_pinned_blocks == 4  # turn 2 now
    s.kv.check_integrity([])  # only the pins hold blocks
    d = Driver(s)
    t3 = make_req("t3", t2.all_token_ids + [5], max_tokens=4, session_id="other")
    s.add_request(t3)
    d.step()
    s.abort("t3")
    assert "other" not in s.kv.sessions.entries  # an aborted turn is not kept
    s.kv.check_integrity([])
