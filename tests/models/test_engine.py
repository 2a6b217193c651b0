"""Engine on SmolLM2 (fp32, CPU): batch invariance, preemption under a tiny KV pool, chunked
prefill, abort, and the offline `kiln.LLM` API."""

from __future__ import annotations

import pytest
from conftest import run_to_completion

from kiln.sampling_params import SamplingParams

PROMPTS = [  # 8 to 17 tokens: with 8 new tokens most cross a 16-token block boundary
    "The capital of France is a city known for",
    "def fibonacci(n):\n    \"\"\"Return the n-th number",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are red, yellow and",
    "Water boils at one hundred degrees Celsius when",
    "My favourite food is a warm bowl of noodle soup with",
    "In 1492, Columbus sailed across the Atlantic Ocean and",
    "The quick brown fox jumps over the lazy dog, and then",
    "import numpy as np\nimport pandas as pd\n\ndef load(path):\n",
    "The largest planet in the solar system is Jupiter, which",
    "Photosynthesis is the process by which green plants",
    "A haiku about autumn leaves falling on a quiet pond:",
    "The best way to learn to code is to build small",
    "Dear Sir or Madam, I am writing to apply for the",
    "The recipe calls for two cups of flour, one egg and",
    "SELECT name, email FROM users WHERE created_at >",
]
NEW_TOKENS = 8
# min_tokens = max_tokens: every request generates exactly NEW_TOKENS (EOS is masked).
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer) -> list[list[int]]:
    return [smollm2_tokenizer.encode(p) for p in PROMPTS]


def build_engine(runner, gguf_path, **kw):
    from kiln.engine.engine import Engine
    from kiln.settings.engine_config import EngineConfig

    kw.setdefault("max_num_seqs", 32)
    kw.setdefault("max_num_batched_tokens", 512)
    return Engine(EngineConfig.of(model=str(gguf_path), dtype="float32", **kw), runner=runner)


def integrity(engine) -> None:
    engine.kv.check_integrity(engine.scheduler.all_requests())


@pytest.fixture(scope="module")
def one_by_one(smollm2_runner, gguf_path, prompt_ids) -> dict[str, list[int]]:
    """The reference: each prompt alone in the engine, no prefix caching."""
    eng = build_engine(smollm2_runner, gguf_path, enable_prefix_caching=False)
    out: dict[str, list[int]] = {}
    for i, ids in enumerate(prompt_ids):
        eng.add_request(str(i), ids, GREEDY)
        out.update(run_to_completion(eng))
    assert all(len(v) == NEW_TOKENS for v in out.values())
    return out


def test_batch_of_16_gives_the_tokens_of_one_by_one(make_engine, prompt_ids, one_by_one):
    eng = make_engine()
    for i, ids in enumerate(prompt_ids):
        eng.add_request(str(i), ids, GREEDY)
    first = eng.step()
    assert len(eng.scheduler.running) == 16 and len(first) == 16  # all prefilled in one step
    out = {o.request_id: list(o.outputs[0].token_ids) for o in first}
    for rid, toks in run_to_completion(eng, check=integrity).items():
        out[rid] += toks
    assert out == one_by_one


def test_tiny_kv_pool_preempts_and_still_completes_every_request(make_engine, prompt_ids,
                                                                  one_by_one):
    eng = make_engine(kv_max_blocks=4)  # 64 token slots for 8 requests of 16-25 tokens
    for i, ids in enumerate(prompt_ids[:8]):
        eng.add_request(str(i), ids, GREEDY)
    finished: dict[str, str] = {}
    out: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
            if o.finished:
                finished[o.request_id] = o.outputs[0].finish_reason
        integrity(eng)
    assert eng.metrics()["num_preemptions"] > 0, "the pool was meant to be too small"
    assert finished == {str(i): "length" for i in range(8)}
    assert out == {str(i): one_by_one[str(i)] for i in range(8)}
    assert eng.kv.num_free_blocks == eng.kv.num_blocks == 4


def test_long_prompt_with_a_small_token_budget_gives_the_same_output(make_engine,
                                                                    smollm2_tokenizer):
    text = " ".join(PROMPTS) + " Summary of the above:"
    ids = smollm2_tokenizer.encode(text)[:160]
    assert len(ids) == 160
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4)
    outs, steps = [], []
    for budget in (512, 48):
        eng = make_engine(max_num_batched_tokens=budget, enable_prefix_caching=False)
        eng.add_request("long", ids, params)
        outs.append(run_to_completion(eng, check=integrity)["long"])
        steps.append(eng.metrics()["steps"])
    assert outs[0] == outs[1]
    assert steps == [4, 4 + 3]  # 160 tokens in chunks of 48: 4 steps, the last samples


def test_abort_mid_generation_frees_blocks_at_once(make_engine, prompt_ids, one_by_one):
    eng = make_engine(enable_prefix_caching=False)
    for i in range(4):
        eng.add_request(str(i), prompt_ids[i], GREEDY)
    outs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}

    def collect(outputs) -> None:
        for o in outputs:
            outs.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
            if o.finished:
                reasons[o.request_id] = o.outputs[0].finish_reason

    for _ in range(3):
        collect(eng.step())
    held = {r.request_id: len(r.block_ids) for r in eng.scheduler.running}
    free = eng.kv.num_free_blocks
    assert eng.abort("1") and eng.abort("3")
    assert not eng.abort("1")  # already gone
    assert eng.kv.num_free_blocks == free + held["1"] + held["3"]
    integrity(eng)
    while eng.has_unfinished or eng.outputs_pending:
        collect(eng.step())
    assert reasons == {"0": "length", "1": "abort", "2": "length", "3": "abort"}
    assert outs["0"] == one_by_one["0"] and outs["2"] == one_by_one["2"]
    assert outs["1"] == one_by_one["1"][:3] and outs["3"] == one_by_one["3"][:3]
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_seeded_sampling_is_reproducible_in_the_engine(make_engine, prompt_ids):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=4, min_tokens=4)
    runs = []
    for others in (0, 3):
        eng = make_engine()
        eng.add_request("me", prompt_ids[2], params)
        for i in range(others):
            eng.add_request(f"o{i}", prompt_ids[5 + i], SamplingParams(temperature=1.0,
                                                                        max_tokens=4))
        runs.append(run_to_completion(eng)["me"])
    assert runs[0] == runs[1]


def test_stop_token_and_prompt_validation(make_engine, prompt_ids, one_by_one):
    from kiln.engine.engine import PromptTooLongError
    from kiln.errors import KilnError

    eng = make_engine()
    stop_at = one_by_one["0"][3]
    eng.add_request("s", prompt_ids[0], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                       stop_token_ids=[stop_at]))
    outs = []
    while eng.has_unfinished:
        outs.extend(eng.step())
    last = outs[-1].outputs[0]
    assert last.finish_reason == "stop" and last.stop_token_id == stop_at
    got = [t for o in outs for t in o.outputs[0].token_ids]
    assert got == one_by_one["0"][:one_by_one["0"].index(stop_at)]
    with pytest.raises(PromptTooLongError):
        eng.add_request("long", [1] * eng.max_model_len, GREEDY)
    with pytest.raises(KilnError):
        eng.add_request("empty", [], GREEDY)
    with pytest.raises(KilnError):
        eng.add_request("oov", [10**9], GREEDY)


def test_n_choices_fan_out_in_the_engine_as_one_group_delta_and_final_alike(make_engine,
                                                                          prompt_ids, tmp_path):
    """n=3: the output processor runs `{id}-{i}` sequences (seed + i) as one scheduler group;
    DELTA outputs folded by RequestOutput.add (and by the request dump) equal the FINAL_ONLY
    output; aborting the request aborts every choice."""
    import json
    from dataclasses import replace
    from types import SimpleNamespace

    from kiln.engine.output import RequestOutput
    from kiln.errors import KilnError
    from kiln.obs.dump import RequestDumper
    from kiln.sampling_params import RequestOutputKind

    eng = make_engine(enable_prefix_caching=False)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, min_tokens=6,
                            logprobs=0)
    ids = prompt_ids[2]
    eng.add_request("d", ids, params)
    eng.add_request("f", ids, replace(params, output_kind=RequestOutputKind.FINAL_ONLY))
    seqs = eng.scheduler.requests.values()
    assert sorted((r.request_id, r.group, r.params.seed, r.params.n) for r in seqs) == [
        (f"{rid}-{i}", rid, 11 + i, 1) for rid in "df" for i in range(3)]
    with pytest.raises(KilnError):
        eng.add_request("d", ids, params)  # the request's id is taken while it runs
    delta = RequestOutput("d", ids, [], finished=False)
    spec = SimpleNamespace(request_id="d", prompt_ids=ids, params=params, first_index=0)
    dump = RequestDumper(tmp_path, "sha256:x").begin("completions", {"n": 3}, [spec])
    finals = []
    while eng.has_unfinished:
        for o in eng.step():
            if o.request_id == "d":
                assert not delta.finished and all(c.index in (0, 1, 2) for c in o.outputs)
                delta.add(o)
                dump.add(0, o)
            else:
                finals.append(o)
    (final,) = finals  # FINAL_ONLY: one output, when every choice finished
    assert final.finished and delta.finished
    assert [c.index for c in final.outputs] == [c.index for c in delta.outputs] == [0, 1, 2]
    for f, d in zip(final.outputs, delta.outputs, strict=True):
        assert (f.token_ids, f.text, f.finish_reason) == (d.token_ids, d.text, "length")
        assert len(f.token_ids) == len(f.logprobs) == f.num_output_tokens == 6
        assert f.metrics is not None and f.metrics.num_generation_tokens == 6
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1  # each choice its own seed
    bundle = json.loads(dump.write().read_text())
    assert [(c["index"], c["request_id"], c["sampling_params"]["seed"], c["output_token_ids"],
             c["text"], c["finish_reason"]) for c in bundle["choices"]] == [
        (i, f"d-{i}", 11 + i, f.token_ids, f.text, "length")
        for i, f in enumerate(final.outputs)]
    integrity(eng)

    eng.add_request("a", ids, params)
    eng.step()
    assert eng.abort("a") and not eng.abort("a")
    assert eng.kv.num_free_blocks == eng.kv.num_blocks and eng.outputs_pending
    (out,) = eng.step()
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3


# --------------------------------------------------------------------------- offline LLM API


@pytest.fixture(scope="module")
def llm():
    from kiln import LLM

    return LLM(dtype="float32", compile=False, kv_cache_memory=32 << 20, max_model_len=512,
               max_num_batched_tokens=256)


CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"}]


def test_llm_chat_answers_paris_and_stop_strings_cut_the_text(llm):
    out = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=16))
    full = out[0].outputs[0].text
    assert len(out) == 1 and "Paris" in full, full
    cut = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=16, stop=["Paris"]))
    text = cut[0].outputs[0].text
    assert text == full[:full.index("Paris")] and "Paris" not in text


def test_llm_generate_n_choices(llm):
    out = llm.generate(["Once upon a time", "The sky is"],
                       SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, min_tokens=6))
    assert [o.prompt for o in out] == ["Once upon a time", "The sky is"]
    for o in out:
        assert [c.index for c in o.outputs] == [0, 1, 2]
        assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in o.outputs)
        assert len({tuple(c.token_ids) for c in o.outputs}) > 1  # each choice its own seed
