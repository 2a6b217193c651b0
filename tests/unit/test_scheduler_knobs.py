"""ferrum's scheduler knobs in kiln's scheduler (issue 43 item 7): a per-request prefill chunk, an
aggregate prefill cap in steps that decode, prefill-first until N requests decode, and admission
only when the whole prompt fits. Plain Python with test_scheduler's fake model (every output
checked token by token), then the real engine (SmolLM2): the same greedy tokens with the knobs
on as off, set through `kiln serve`'s flags."""

from __future__ import annotations

import random

import pytest
from test_scheduler import BS, Driver, expected_output, make_req, run_random_arrivals

from kiln.engine.kv_cache import KVCacheManager
from kiln.engine.scheduler import Scheduler
from kiln.settings.engine_config import SchedulerConfig


def sched(num_blocks: int = 64, budget: int = 32, max_seqs: int = 8, **knobs) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, **knobs)
    return Scheduler(cfg, KVCacheManager(num_blocks, BS), num_blocks * BS)


KNOBS = [
    {"prefill_step_chunk": 5},
    {"active_decode_prefill_chunk": 6},
    {"prefill_first_until_active": 3},
    {"sequence_fit_policy": "full-input-must-fit"},
    {"prefill_step_chunk": 7, "active_decode_prefill_chunk": 9, "prefill_first_until_active": 2,
     "sequence_fit_policy": "full-input-must-fit"},
]


@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: ",".join(k))
def test_every_request_completes_with_its_own_tokens_under_each_knob(knobs):
    run_random_arrivals(sched(num_blocks=40, budget=24, max_seqs=4, **knobs), random.Random(1),
                        24)


def test_prefill_step_chunk_caps_each_requests_prompt_tokens_per_step():
    s = sched(budget=64, prefill_step_chunk=8)
    d = Driver(s)
    s.add_request(make_req("a", 40, max_tokens=2))
    s.add_request(make_req("b", 20, max_tokens=2))
    first = d.step()
    assert [x.num_new_tokens for x in first.scheduled] == [8, 8]
    d.run()
    assert all(x.num_new_tokens <= 8 for out in d.steps for x in out.scheduled)


def test_active_decode_prefill_chunk_caps_the_prompts_of_a_step_that_decodes():
    s = sched(budget=64, active_decode_prefill_chunk=6)
    d = Driver(s)
    s.add_request(make_req("a", 4, max_tokens=20))
    d.step()  # a's prompt, alone: the whole budget
    s.add_request(make_req("b", 30, max_tokens=2))
    s.add_request(make_req("c", 30, max_tokens=2))
    out = d.step()
    decodes = [x for x in out.scheduled if x.request.request_id == "a"]
    assert decodes and decodes[0].num_new_tokens == 1
    assert sum(x.num_new_tokens for x in out.scheduled) - 1 == 6  # b and c share 6 tokens
    d.run()


def test_prefill_first_holds_decodes_until_the_cohort_catches_up():
    s = sched(budget=64, prefill_first_until_active=3)
    d = Driver(s)
    a = make_req("a", 4, max_tokens=20)
    s.add_request(a)
    d.step()
    d.step()  # a decodes alone: nobody waits
    s.add_request(make_req("b", 8, max_tokens=4))
    s.add_request(make_req("c", 8, max_tokens=4))
    out = d.step()
    assert {x.request.request_id for x in out.scheduled} == {"b", "c"}  # a sits this one out
    out = d.step()
    assert {x.request.request_id for x in out.scheduled} == {"a", "b", "c"}  # one batch
    d.run()
    assert d.outputs["a"] == expected_output(a.prompt_token_ids, 20)


def test_full_input_must_fit_admits_no_prompt_that_preemption_would_undo():
    def run(policy: str):
        # 12 blocks of 4 tokens; a decodes on while b's 44-token prompt (11 blocks) arrives.
        s = sched(num_blocks=12, budget=8, max_seqs=4, sequence_fit_policy=policy)
        d = Driver(s)
        s.add_request(make_req("a", 8, max_tokens=16))
        d.step()
        s.add_request(make_req("b", 44, max_tokens=2))
        d.run()
        return s, d

    immediate, d_imm = run("immediate-only")
    full, d_full = run("full-input-must-fit")
    assert immediate.stats.num_preemptions > 0  # b was admitted, then thrown back
    assert full.stats.num_preemptions == 0  # b waited for room, then ran through
    assert d_imm.outputs == d_full.outputs


def test_the_knobs_are_settings_and_keep_the_engines_greedy_tokens(make_engine, tmp_path):
    """Through `kiln serve`'s flags into the engine: SmolLM2's greedy tokens for a mixed batch
    are the same with every knob on (kiln's batch invariance: chunking and batching do not
    change a request's tokens)."""
    import json

    from conftest import run_to_completion

    from kiln.cli.main import main
    from kiln.sampling_params import SamplingParams

    eff = tmp_path / "eff.json"
    flags = ["--scheduler-prefill-step-chunk", "16", "--scheduler-active-decode-prefill-chunk",
             "24", "--scheduler-prefill-first-until-active", "3", "--sequence-fit-policy",
             "full-input-must-fit"]
    assert main(["serve", "smollm2", "--dry-run", "--effective-config-json", str(eff),
                 *flags]) == 0
    s = json.loads(eff.read_text())["settings"]
    assert s["scheduler_prefill_step_chunk"]["value"] == 16
    assert s["sequence_fit_policy"]["source"] == "cli"

    prompts = [list(range(5, 5 + n)) for n in (70, 9, 33, 120)]

    def tokens(**kw):
        e = make_engine(**kw)
        for i, p in enumerate(prompts):
            e.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=6))
        return run_to_completion(e)

    plain = tokens()
    knobs = tokens(scheduler_prefill_step_chunk=16, scheduler_active_decode_prefill_chunk=24,
                   scheduler_prefill_first_until_active=3,
                   sequence_fit_policy="full-input-must-fit")
    assert knobs == plain and all(len(v) == 6 for v in plain.values())
