"""Speculative decoding (kiln/engine/spec.py): n-gram drafting, rollback of rejected drafts in the
scheduler and KV pool, greedy output identical with and without speculation on SmolLM2 (engine,
offline LLM, real server through the openai client), and rejection sampling's output
distribution equal to the target's (chi-square)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_scheduler import Driver, expected_output, fake_token, make_req, make_sched

from kiln.engine.request import Request
from kiln.engine.sampler import Sampler
from kiln.engine.spec import (
    CostFit,
    SpecConfig,
    Speculator,
    best_k,
    ngram_propose,
    sample_with_drafts,
    verify,
)
from kiln.sampling_params import SamplingParams

# --------------------------------------------------------------------------- n-gram lookup


def test_ngram_takes_the_longest_suffix_and_its_latest_earlier_occurrence():
    t = np.array([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3])
    # suffix [1, 2, 3] occurred at 0 -> the 4 tokens after it
    assert ngram_propose(t, 4, 1, 3) == [4, 9, 2, 3]
    # only length 2 allowed: [2, 3] last occurred at 5 -> [5, 7, 1]
    assert ngram_propose(t, 3, 2, 2) == [5, 7, 1]
    # nothing repeats: no draft; k larger than what follows: cut at the end
    assert ngram_propose(np.array([1, 2, 3, 4]), 3, 1, 3) == []
    assert ngram_propose(np.array([5, 6, 5]), 4, 1, 2) == [6, 5]


# --------------------------------------------------------------------------- scheduler + KV


class SpecDriver(Driver):
    """The scheduler test's fake model with drafts: each step every decoding request gets k
    drafts, right or wrong at random; the 'model' accepts the ones equal to what it would
    have generated, then adds its own token. Outputs must equal the plain run's."""

    def __init__(self, sched, rng: random.Random, k: int = 3) -> None:
        super().__init__(sched)
        self.rng, self.k = rng, k
        self.accepted = 0

    def step(self):
        s = self.s
        for r in s.running:
            r.spec_token_ids = []
            if r.num_computed_tokens == r.num_tokens - 1:
                toks, drafts = list(r.all_token_ids), []
                for _ in range(self.rng.randrange(0, self.k + 1)):
                    t = fake_token(toks) if self.rng.random() < 0.7 else 5000
                    drafts.append(t)
                    toks.append(t)
                r.spec_token_ids = drafts
        out = s.schedule()
        assert out.num_tokens <= s.config.max_num_batched_tokens
        for x in out.scheduled:
            r = x.request
            assert r.num_computed_tokens + x.num_new_tokens <= r.num_tokens + len(x.spec_token_ids)
            assert len(r.block_ids) * s.kv.block_size >= r.num_computed_tokens + x.num_new_tokens
        s.kv.check_integrity(s.all_requests())
        sampled = {}
        for x in out.scheduled:
            if not x.sample:
                continue
            toks, got = list(x.request.all_token_ids), []
            for d in [*x.spec_token_ids, None]:
                t = fake_token(toks)
                got.append(t)
                toks.append(t)
                if t != d:
                    break
            self.accepted += len(got) - 1
            sampled[x.request.request_id] = got
        before = {r.request_id: r.num_output_tokens for r in s.running}
        for r in s.update(out, sampled):
            new = r.output_token_ids[before.get(r.request_id, 0):]
            self.outputs.setdefault(r.request_id, []).extend(new)
            # KV reaches every token but the last; no block is held past the tokens
            if not r.is_finished:
                assert r.num_computed_tokens == r.num_tokens - 1
                n_blocks = len(r.block_ids)
                assert (s.kv.blocks_needed(r.num_computed_tokens) <= n_blocks
                        <= s.kv.blocks_needed(r.num_tokens))
        s.kv.check_integrity(s.all_requests())
        self.steps.append(out)
        return out


@pytest.mark.parametrize("num_blocks", [64, 10])  # 10: preemption with drafts in flight
def test_drafts_roll_back_and_outputs_equal_the_plain_run(num_blocks):
    rng = random.Random(num_blocks)
    s = make_sched(num_blocks=num_blocks, budget=16, max_seqs=4)
    d = SpecDriver(s, rng)
    reqs = [make_req(f"r{i}", rng.randrange(1, 12), max_tokens=rng.randrange(1, 14))
            for i in range(12)]
    for r in reqs:
        s.add_request(r)
    out = d.run()
    for r in reqs:
        assert out[r.request_id] == expected_output(r.prompt_token_ids, r.max_tokens)
    assert d.accepted > 0
    assert s.kv.num_free_blocks == num_blocks
    s.kv.check_integrity([])


def test_a_stop_token_among_accepted_drafts_ends_the_request_there():
    s = make_sched()
    r = make_req("a", 5, max_tokens=10)
    s.add_request(r)
    s.update(s.schedule(), {"a": 7})  # prefill
    r.spec_token_ids = [8, 9, 10]
    r.params.stop_token_ids = [9]
    out = s.schedule()
    assert out.scheduled[0].num_new_tokens == 4 and out.scheduled[0].spec_token_ids == [8, 9, 10]
    s.update(out, {"a": [8, 9, 10, 11]})  # all accepted, but 9 stops it
    assert r.output_token_ids == [7, 8, 9] and r.is_finished
    assert s.kv.num_free_blocks == s.kv.num_blocks
    s.kv.check_integrity([])


# --------------------------------------------------------------------------- rejection sampling


def _req(rid: str, **kw) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(**kw))


def _chisquare_pvalue(observed, expected) -> float:
    """Pearson's chi-square goodness of fit: P(X >= stat) for k-1 degrees of freedom, the
    regularized upper incomplete gamma Q(df/2, stat/2) (torch has it; scipy is not a dependency)."""
    obs = torch.as_tensor(observed, dtype=torch.float64)
    exp = torch.as_tensor(expected, dtype=torch.float64)
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor((obs.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


@pytest.mark.parametrize("kw", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5},
                                {"temperature": 1.3, "top_p": 0.8}])
def test_rejection_sampling_gives_the_targets_distribution(kw):
    """Tiny vocabulary, fixed logits: the first token verify emits (the draft when accepted,
    else a draw from the residual) must be distributed as the sampler's own distribution, for
    a likely draft, an unlikely one and one the filters remove. Chi-square, p > 1e-4."""
    V, N = 8, 4000
    torch.manual_seed(0)
    row = torch.randn(V) * 1.5
    sampler = Sampler(V, torch.device("cpu"), seed=1)
    params = SamplingParams(**kw)
    probs = Sampler.probs(row.unsqueeze(0), [params])[0].double()
    reqs = [_req(f"r{i}", **kw) for i in range(N)]
    for draft in (int(probs.argmax()), int(probs.argmin()), int(torch.argsort(probs)[V // 2])):
        drafts = [[draft, 0] for _ in range(N)]
        logits = row.repeat(3 * N, 1)
        tokens, _ = verify(sampler, logits, reqs, drafts)
        counts = np.bincount([t[0] for t in tokens], minlength=V)
        keep = probs.numpy() > 0
        assert counts[~keep].sum() == 0, "a token outside the filtered distribution"
        expected = probs.numpy()[keep] / probs.numpy()[keep].sum() * N
        assert _chisquare_pvalue(counts[keep], expected) > 1e-4, (draft, counts, expected)
        # how often the draft was accepted is p(draft)
        accepted = sum(len(t) > 1 or t[0] == draft for t in tokens)
        assert abs(accepted / N - probs[draft].item()) < 5 * (0.25 / N) ** 0.5 + 1e-9


def test_greedy_verification_accepts_the_matching_prefix_and_reports_logprobs():
    V = 6
    logits = torch.full((4, V), -5.0)
    for i, t in enumerate([3, 1, 4, 2]):  # the argmax of each row
        logits[i, t] = 5.0
    sampler = Sampler(V, torch.device("cpu"))
    r = _req("a", temperature=0.0, logprobs=2)
    sampled, lps = sample_with_drafts(sampler, logits, [r], [[3, 1, 0]])
    assert sampled == {"a": [3, 1, 4]}  # two drafts hold, the third is replaced by the argmax
    assert [lp.token_id for lp in lps["a"]] == [3, 1, 4]
    assert all(lp.top[0][0] == lp.token_id and lp.logprob > -0.01 for lp in lps["a"])


def test_auto_k_follows_the_acceptance():
    spec = Speculator(SpecConfig("ngram", None), 1000)
    for _ in range(200):
        spec.record(4, 4)  # everything accepted: the longest K
    assert spec.k == 8
    for _ in range(400):
        spec.record(4, 0)  # nothing accepted: K falls to 1
    assert spec.k == 1
    assert spec.stats.num_drafts == 600 and spec.stats.num_accepted_tokens == 800


def test_auto_k_weighs_the_measured_cost():
    """With step costs measured, auto K maximizes tokens per second, not the accepted run."""
    fit = CostFit()
    assert fit.line() is None
    for k in (2, 3, 1, 2, 3, 1):  # seconds = 0.05 + 0.03 K, the dither's spread of K
        fit.add(k, 0.05 + 0.03 * k)
    c0, c1 = fit.line()
    assert abs(c0 - 0.05) < 1e-9 and abs(c1 - 0.03) < 1e-9
    # drafts that cost nothing: the longest K; costly ones at a = 0.85: K = 2, not the run of ~6
    assert best_k(0.85, (1.0, 0.0)) == 8
    assert best_k(0.85, (0.058, 0.036)) == 2
    assert best_k(0.85, None) == 6
    spec = Speculator(SpecConfig("ngram", None), 1000)
    for _ in range(100):
        spec.record(4, 3)  # a = 0.75 (3 accepted, 1 rejection per row)
    assert spec.k == 3  # no cost line yet: the run a / (1 - a)
    for k in (1, 2, 3, 4, 1, 2, 3, 4):
        spec.observe_step(k, 0.1 + 0.1 * k)  # a draft costs as much as the step itself
    assert spec.k == 1
    spec_fixed = Speculator(SpecConfig("ngram", 4), 1000)
    spec_fixed.observe_step(4, 1.0)
    assert spec_fixed.k == 4 and spec_fixed.cost.line() is None


# --------------------------------------------------------------------------- SmolLM2, real weights

CODE = '''def area(width, height):
    """Return the area of a rectangle."""
    return width * height


def perimeter(width, height):
    """Return the perimeter of a rectangle."""
    return 2 * (width + height)
'''
PASSAGE = ("The river Kiln runs from the northern hills to the sea. Along the river Kiln there "
           "are three old mills, and each mill on the river Kiln once ground wheat for the town.")
PROMPTS = [
    [{"role": "user", "content": "Rename `width` to `w` in this code and show all of it:\n\n"
      + CODE}],
    [{"role": "user", "content": "Summarise this passage, quoting it:\n\n" + PASSAGE}],
]


@pytest.fixture(scope="module")
def chat_ids(smollm2_tokenizer) -> list[list[int]]:
    return [smollm2_tokenizer.apply_chat_template(m) for m in PROMPTS]


def _run(runner, tokenizer, ids, params_list, **kw):
    from kiln.engine.engine import Engine
    from kiln.settings.engine_config import EngineConfig

    eng = Engine(EngineConfig.of(model=str(runner.config.model), dtype="float32", max_num_seqs=32,
                              max_num_batched_tokens=512, **kw), runner=runner,
                 tokenizer=tokenizer)
    outs = {}
    for i, (p, params) in enumerate(zip(ids, params_list)):
        eng.add_request(str(i), p, params)

    def check(e):
        e.kv.check_integrity(e.scheduler.all_requests())

    while eng.has_unfinished:
        for o in eng.step():
            acc = outs.setdefault(o.request_id, {"ids": [], "text": "", "lps": [], "fin": None})
            acc["ids"] += o.outputs[0].token_ids
            acc["text"] += o.outputs[0].text
            acc["lps"] += [lp.logprob for lp in o.outputs[0].logprobs or []]
            acc["fin"] = o.outputs[0].finish_reason
        check(eng)
    eng.check_idle_integrity()
    return outs, eng


def test_greedy_output_is_identical_with_ngram_speculation(smollm2_runner, smollm2_tokenizer,
                                                           chat_ids):
    """Code editing and quoting a passage (text that repeats), batched, with a stop string,
    logprobs and max_tokens ending inside a run of accepted drafts."""
    from kiln.sampling_params import StructuredOutputsParams

    ids = [chat_ids[0], chat_ids[1], chat_ids[0], chat_ids[1], chat_ids[0]]
    params = [SamplingParams(temperature=0.0, max_tokens=48, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=40, stop=["mills"]),
              SamplingParams(temperature=0.0, max_tokens=29),
              # rows that never draft: a grammar, a penalty
              SamplingParams(temperature=0.0, max_tokens=12,
                             structured_outputs=StructuredOutputsParams(regex="[A-Za-z ]+")),
              SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3)]
    plain, _ = _run(smollm2_runner, smollm2_tokenizer, ids, params)
    spec, eng = _run(smollm2_runner, smollm2_tokenizer, ids, params, speculative_method="ngram",
                     num_speculative_tokens=4)
    for rid in plain:
        assert spec[rid]["ids"] == plain[rid]["ids"], rid
        assert spec[rid]["text"] == plain[rid]["text"], rid
        assert spec[rid]["fin"] == plain[rid]["fin"], rid
        np.testing.assert_allclose(spec[rid]["lps"], plain[rid]["lps"], atol=1e-3)
    m = eng.metrics()
    assert m["spec_num_drafts"] > 0 and m["spec_num_accepted_tokens"] > 0
    # accepted drafts mean fewer steps than tokens
    assert eng.stats.steps < sum(len(v["ids"]) for v in plain.values())


@pytest.mark.heavy  # make test's budget: the distribution test above checks the rule
def test_sampled_output_with_speculation_is_well_formed(smollm2_runner, smollm2_tokenizer,
                                                        chat_ids):
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=7)]
    out, eng = _run(smollm2_runner, smollm2_tokenizer, chat_ids[:1], params,
                    speculative_method="ngram", num_speculative_tokens="auto")
    assert len(out["0"]["ids"]) == 24 or out["0"]["fin"] == "stop"
    assert eng.metrics()["spec_num_draft_tokens"] > 0


# --------------------------------------------------------------------------- front-ends


@pytest.fixture(scope="module")
def plain_answers(smollm2_runner, smollm2_tokenizer, chat_ids) -> dict[str, str]:
    """The engine without speculation: the greedy text each front-end must reproduce."""
    params = [SamplingParams(temperature=0.0, max_tokens=40) for _ in chat_ids]
    out, _ = _run(smollm2_runner, smollm2_tokenizer, chat_ids, params)
    return {rid: o["text"] for rid, o in out.items()}


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory, gguf_path):
    from test_server import _serve

    yield from _serve(tmp_path_factory.mktemp("spec"), gguf_path, "--speculative-method",
                      "ngram", "--num-speculative-tokens", "auto")


@pytest.mark.heavy  # a server start and ~200 generated tokens: over the default run's budget
def test_server_greedy_answers_equal_the_plain_engine_and_metrics_count_drafts(
        spec_server, plain_answers):
    import httpx
    from test_server import NAMES

    client = spec_server.client()
    for rid, messages in zip(("0", "1"), PROMPTS):
        r = client.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=40,
                                           temperature=0)
        assert r.choices[0].message.content == plain_answers[rid], rid
    stream = client.chat.completions.create(model=NAMES[0], messages=PROMPTS[0], max_tokens=40,
                                            temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == plain_answers["0"]
    metrics = httpx.get(f"{spec_server.base_url}/metrics", timeout=10).text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode")}
    assert values["vllm:spec_decode_num_drafts_total"] > 0
    assert 0 < values["vllm:spec_decode_num_accepted_tokens_total"] <= values[
        "vllm:spec_decode_num_draft_tokens_total"]
    # kiln bench reads the same counters (per level: the difference of two scrapes)
    import asyncio

    from kiln.bench.client import spec_counters, spec_delta

    async def scrape():
        async with httpx.AsyncClient() as http:
            return await spec_counters(http, spec_server.base_url + "/v1", None)

    now = asyncio.run(scrape())
    assert now is not None and now["drafts"] == values["vllm:spec_decode_num_drafts_total"]
    zero = {k: 0.0 for k in now}
    d = spec_delta(zero, now)
    assert d["acceptance_rate"] == now["accepted_tokens"] / now["draft_tokens"]
    assert d["tokens_per_step"] > 1.0
    eff = spec_server.effective_config.read_text()
    assert '"num_speculative_tokens"' in eff


@pytest.mark.heavy
def test_offline_llm_with_ngram_gives_the_plain_greedy_text(gguf_path, plain_answers):
    from kiln import LLM

    llm = LLM(str(gguf_path), dtype="float32", compile=False, kv_cache_memory=64 << 20,
              max_model_len=1024, speculative_method="ngram", num_speculative_tokens=4)
    for rid, messages in zip(("0", "1"), PROMPTS):
        out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=40))
        assert out[0].outputs[0].text == plain_answers[rid], rid
    assert llm.engine.metrics()["spec_num_accepted_tokens"] > 0


def test_kiln_engine_refuses_a_method_it_does_not_have(gguf_path, smollm2_runner):
    from kiln.engine.engine import Engine
    from kiln.errors import ConfigError
    from kiln.settings.engine_config import EngineConfig

    with pytest.raises(ConfigError) as e:
        Engine(EngineConfig.of(model=str(gguf_path), dtype="float32", speculative_method="eagle"),
               runner=smollm2_runner)
    assert e.value.code == "spec.unknown_method" and "'eagle'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        Engine(EngineConfig.of(model=str(gguf_path), dtype="float32", num_speculative_tokens=3),
               runner=smollm2_runner)
    assert e.value.code == "spec.tokens_without_method"
    assert "--speculative-method ngram" in str(e.value)  # the way out
