"""Speculative decoding with a draft model (kiln/engine/draft.py): greedy output identical with
and without the draft (a tiny random llama target with a smaller draft cut from it, SmolLM2
drafting for itself), rejection sampling with the draft's distribution gives the target's
(chi-square), and a draft whose vocabulary differs is refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import add_word_tokenizer, make_tiny_model
from test_spec import _chisquare_pvalue, _req

from kiln.engine.sampler import Sampler
from kiln.engine.spec import verify
from kiln.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A 4-layer random llama and its draft: the same weights cut to its first 2 layers (so the
    two agree often, and disagree often enough to roll back), both with the same tokenizer."""
    import transformers

    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_model("llama", root / "target", num_hidden_layers=4)
    add_word_tokenizer(target)
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers = 2
    model.save_pretrained(root / "draft", safe_serialization=True)
    add_word_tokenizer(root / "draft")
    return target, root / "draft"


def _engine(model, runner=None, **kw):
    from kiln.engine.engine import Engine
    from kiln.settings.engine_config import EngineConfig

    kw.setdefault("kv_cache_memory", 8 << 20)
    return Engine(EngineConfig.of(model=str(model), dtype="float32", max_num_batched_tokens=64,
                               compile=False, **kw), runner=runner)


def _generate(eng, prompts, params):
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, sp)
    out: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
        eng.kv.check_integrity(eng.scheduler.all_requests())
        if eng.drafter is not None:
            eng.drafter.kv.check_integrity(list(eng.drafter.shadows.values()))
    eng.check_idle_integrity()
    return out


def test_tiny_pair_greedy_output_is_identical_with_the_draft_model(tiny_pair):
    """Batched rows of different lengths, a prompt longer than the token budget (the draft's
    catch-up is chunked too), max_tokens inside a run of drafts."""
    target, draft = tiny_pair
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 200, n).tolist() for n in (5, 17, 80, 9)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (24, 19, 14, 7)]
    plain_eng = _engine(target)
    plain = _generate(plain_eng, prompts, params)
    eng = _engine(target, speculative_model=str(draft), num_speculative_tokens=4,
                  runner=plain_eng.runner)
    spec = _generate(eng, prompts, params)
    assert spec == plain
    st = eng.spec.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens  # both paths: accept and roll back
    assert eng.stats.steps < sum(len(v) for v in plain.values())
    # every shadow's draft blocks went back when its request finished
    eng.step()
    assert not eng.drafter.shadows and eng.drafter.kv.num_free_blocks == eng.drafter.kv.num_blocks


def test_no_drafts_while_more_requests_decode_than_disable_by_batch_size(tiny_pair):
    """--speculative-disable-by-batch-size 1 (the auto value for a draft model on CPU): while
    several requests decode, steps carry no drafts; the one left alone drafts again (its shadow
    catches up on the tokens it missed). The output is the plain engine's."""
    target, draft = tiny_pair
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 200, n).tolist() for n in (6, 11, 7)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (30, 6, 6)]
    plain_eng = _engine(target)
    plain = _generate(plain_eng, prompts, params)
    eng = _engine(target, speculative_model=str(draft), num_speculative_tokens=4,
                  speculative_disable_by_batch_size=1, runner=plain_eng.runner)
    seen: list[tuple[int, int]] = []  # (requests decoding, rows given drafts) per step
    propose = eng.spec.propose

    def recording(running):
        propose(running)
        decoding = sum(r.num_computed_tokens == r.num_tokens - 1 for r in running)
        seen.append((decoding, sum(bool(r.spec_token_ids) for r in running)))

    eng.spec.propose = recording
    assert _generate(eng, prompts, params) == plain
    assert all(drafted == 0 for decoding, drafted in seen if decoding > 1)
    assert any(decoding > 1 for decoding, _ in seen)
    assert eng.spec.stats.num_drafts > 0  # the long request, once alone


def test_tiny_pair_sampled_rows_draft_from_q_reproducibly_and_abort_frees_draft_kv(tiny_pair):
    """Sampled rows go through the draft distribution path end to end: a seeded request gives
    the same tokens twice; an aborted request's draft blocks go back at once."""
    target, draft = tiny_pair
    eng = _engine(target, speculative_model=str(draft), num_speculative_tokens=3)
    prompt = list(range(10, 30))
    runs = []
    for _ in range(2):
        out = _generate(eng, [prompt], [SamplingParams(temperature=0.9, top_p=0.95, seed=11,
                                                       max_tokens=24, ignore_eos=True)])
        runs.append(out["0"])
    assert runs[0] == runs[1] and len(runs[0]) == 24
    assert eng.spec.stats.num_accepted_tokens > 0
    eng.add_request("x", prompt, SamplingParams(temperature=0.0, max_tokens=30))
    for _ in range(3):
        eng.step()
    assert eng.drafter.shadows
    eng.abort("x")
    eng.step()
    eng.check_idle_integrity()  # the draft pool too: nothing leaked


def test_a_draft_head_cut_to_the_first_ids_keeps_greedy_and_sampled_outputs(tiny_pair):
    """--speculative-draft-vocab: the draft scores ids 0..n-1 only; the target's tokens past n
    are never drafted (rejected there), and outputs stay the plain run's (greedy) and
    reproducible (sampled: q is zero past n, which the rejection rule allows)."""
    target, draft = tiny_pair
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, 250, n).tolist() for n in (7, 30)]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 2
    plain_eng = _engine(target)
    plain = _generate(plain_eng, prompts, params)
    assert any(t >= 128 for out in plain.values() for t in out)  # the cut matters here
    eng = _engine(target, speculative_model=str(draft), num_speculative_tokens=3,
                  speculative_draft_vocab=128, runner=plain_eng.runner)
    assert eng.drafter.vocab == 128
    drafted: list[int] = []
    propose = eng.drafter.propose

    def recording(rows, live):
        propose(rows, live)
        drafted.extend(t for req, *_ in rows for t in req.spec_token_ids)

    eng.drafter.propose = recording
    assert _generate(eng, prompts, params) == plain
    assert drafted and max(drafted) < 128
    st = eng.spec.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    sampled = SamplingParams(temperature=0.9, seed=5, max_tokens=16, ignore_eos=True)
    runs = [_generate(eng, [prompts[0]], [sampled])["0"] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 16


def test_prompt_lookup_runs_the_draft_confirms_replace_its_steps(tiny_pair):
    """--speculative-prompt-lookup: a greedy row whose own tokens predict a run, and whose
    draft model's first token agrees, drafts that run with no more draft steps; the output is
    the plain run's, and those rows stay out of the auto K's acceptance."""
    target, draft = tiny_pair
    prompts = [[5, 6, 7, 8, 9] * 8, list(range(40, 70)) * 2]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 2
    plain_eng = _engine(target)
    plain = _generate(plain_eng, prompts, params)
    eng = _engine(target, speculative_model=str(draft), speculative_prompt_lookup=6,
                  runner=plain_eng.runner)
    hinted: list[list[int]] = []
    propose = eng.drafter.propose

    def recording(rows, live):
        propose(rows, live)
        hinted.extend(req.spec_token_ids for req, *_ in rows
                      if req.request_id in eng.drafter.last_hinted)

    eng.drafter.propose = recording
    assert _generate(eng, prompts, params) == plain
    assert hinted and max(len(h) for h in hinted) > 1
    off = _engine(target, speculative_model=str(draft), speculative_prompt_lookup=0,
                  runner=plain_eng.runner)
    assert _generate(off, prompts, params) == plain
    assert not off.drafter.last_hinted


def test_head_rows_give_the_whole_heads_first_logits():
    """kiln.layers.quant.apply.head_rows on each head layout: the cut head's logits are the
    whole head's first n (the same storage, the same kernel); a cut inside a tile of rows is
    refused (None)."""
    from kiln.layers import kernels
    from kiln.layers.kernels import reference
    from kiln.layers.linear import Linear
    from kiln.layers.quant import gguf_blocks
    from kiln.layers.quant.apply import head_rows
    from kiln.layers.quant.linear import Int8Linear

    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g)
    heads = [Int8Linear.from_float(w, None, torch.float32)]
    lin = Linear(256, 96)
    lin.weight.data.copy_(w)
    heads.append(lin)
    if kernels.available():
        heads.append(gguf_blocks.KQuantLinear([reference.random_blocks(96, 256, "Q8_0", g)], None,
                                         torch.float32))
    x = torch.randn(3, 256, generator=g)
    for head in heads:
        cut = head_rows(head, 48)
        assert cut is not None, type(head).__name__
        torch.testing.assert_close(cut(x), head(x)[:, :48], rtol=1e-6, atol=1e-5)
        assert head_rows(head, 96) is None
    if kernels.available():
        assert head_rows(heads[-1], 44) is None  # inside a tile of 8 rows


def test_vocab_mismatch_is_a_one_line_error_before_any_weights_load(tiny_pair, gguf_path):
    from kiln.errors import ConfigError

    target, _ = tiny_pair
    with pytest.raises(ConfigError) as e:
        _engine(target, speculative_model=str(gguf_path))
    text = e.value.message
    assert e.value.code == "spec.draft_vocab_mismatch" and "\n" not in text
    assert str(gguf_path) in text


def test_draft_method_needs_a_draft_model_and_ngram_none(tiny_pair):
    from kiln.errors import ConfigError

    target, draft = tiny_pair
    with pytest.raises(ConfigError, match="--speculative-model") as e:
        _engine(target, speculative_method="draft")
    assert e.value.code == "spec.draft_needs_model"
    with pytest.raises(ConfigError) as e:
        _engine(target, speculative_method="ngram", speculative_model=str(draft))
    assert e.value.code == "spec.ngram_with_model"
    for method in (None, "ngram"):  # a head cut with no draft model to cut
        with pytest.raises(ConfigError, match="--speculative-draft-vocab") as e:
            _engine(target, speculative_method=method, speculative_draft_vocab=1024)
        assert e.value.code == "spec.draft_vocab_without_draft"


# --------------------------------------------------------------------------- rejection sampling


@pytest.mark.parametrize("kw", [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 5}])
def test_rejection_sampling_with_draft_probabilities_gives_the_targets_distribution(kw):
    """The draft proposes d ~ q (a distribution unlike the target's p); verify accepts with
    min(1, p/q) and else draws from norm(max(p - q, 0)). The first emitted token must be
    distributed as p (chi-square, p > 1e-4), and the acceptance rate is sum(min(p, q))."""
    V, N = 8, 6000
    torch.manual_seed(0)
    row = torch.randn(V) * 1.5
    sampler = Sampler(V, torch.device("cpu"), seed=3)
    params = SamplingParams(**kw)
    p = Sampler.probs(row.unsqueeze(0), [params])[0].double()
    q = torch.softmax(torch.randn(V) * 1.5, dim=-1)  # the draft's: overlaps p, unlike it
    gen = torch.Generator().manual_seed(5)
    d = torch.multinomial(q, N, replacement=True, generator=gen).tolist()
    reqs = [_req(f"r{i}", **kw) for i in range(N)]
    drafts = [[t] for t in d]
    probs = [q.unsqueeze(0) for _ in range(N)]
    tokens, _ = verify(sampler, row.repeat(2 * N, 1), reqs, drafts, probs)
    counts = np.bincount([t[0] for t in tokens], minlength=V)
    keep = p.numpy() > 0
    assert counts[~keep].sum() == 0, "a token outside the target's filtered distribution"
    expected = p.numpy()[keep] / p.numpy()[keep].sum() * N
    assert _chisquare_pvalue(counts[keep], expected) > 1e-4, (counts, expected)
    accepted = sum(len(t) > 1 for t in tokens) / N
    rate = torch.minimum(p, q.double()).sum().item()
    assert abs(accepted - rate) < 5 * (0.25 / N) ** 0.5


# --------------------------------------------------------------------------- SmolLM2, real weights


@pytest.mark.heavy  # a second SmolLM2 load and ~100 s of decoding on a loaded 2-core machine
def test_smollm2_drafting_for_itself_is_identical_and_accepts_nearly_everything(
        smollm2_runner, smollm2_tokenizer, gguf_path):
    """The same model as draft: greedy output equal to the plain engine's, and ~every draft
    accepted (the two differ only by the float noise of a batched step)."""
    from kiln.engine.engine import Engine
    from kiln.settings.engine_config import EngineConfig

    msgs = [[{"role": "user", "content": "Write a haiku about kilns."}],
            [{"role": "user", "content": "List three prime numbers and explain why."}]]
    prompts = [smollm2_tokenizer.apply_chat_template(m) for m in msgs]
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in (24, 16)]
    cfg = {"model": str(gguf_path), "dtype": "float32", "max_num_seqs": 32,
           "max_num_batched_tokens": 512}
    plain = _generate(Engine(EngineConfig.of(**cfg), runner=smollm2_runner,
                             tokenizer=smollm2_tokenizer), prompts, params)
    eng = Engine(EngineConfig.of(**cfg, speculative_model=str(gguf_path),
                              num_speculative_tokens=4, kv_cache_memory=64 << 20,
                              max_model_len=2048, compile=False),
                 runner=smollm2_runner, tokenizer=smollm2_tokenizer)
    spec = _generate(eng, prompts, params)
    assert spec == plain
    st = eng.spec.stats
    assert st.num_draft_tokens > 0 and st.acceptance_rate > 0.9, st


def test_qwen_05b_drafting_for_15b_is_identical(qwen_coder_gguf, qwen_coder_15b_gguf):
    """The real pair (heavy: two K-quant loads): greedy output of Qwen2.5-Coder 1.5B with the
    0.5B drafting equals the 1.5B's alone, with most drafts accepted."""
    from kiln.engine.engine import Engine
    from kiln.settings.engine_config import EngineConfig
    from kiln.tokenizer import load_tokenizer

    tok = load_tokenizer(qwen_coder_15b_gguf)
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in
               ("Write a Python function that reverses a string.",
                "Explain what a hash map is in two sentences.")]
    params = [SamplingParams(temperature=0.0, max_tokens=24) for _ in prompts]
    cfg = {"model": str(qwen_coder_15b_gguf), "max_model_len": 1024, "compile": False,
           "quantization": "int4"}
    plain_eng = Engine(EngineConfig.of(**cfg), tokenizer=tok)
    plain = _generate(plain_eng, prompts, params)
    eng = Engine(EngineConfig.of(**cfg, speculative_model=str(qwen_coder_gguf),
                              num_speculative_tokens=4), runner=plain_eng.runner, tokenizer=tok)
    assert _generate(eng, prompts, params) == plain
    assert eng.spec.stats.acceptance_rate > 0.5, eng.spec.stats


# --------------------------------------------------------------------------- startup


def test_dry_run_resolves_the_draft_and_takes_vllms_speculative_config(capsys, tmp_path,
                                                                       gguf_path):
    """--speculative-model is resolved like MODEL (the setting becomes the path, with its
    provenance); vLLM's --speculative-config JSON sets the same settings; a missing draft is
    the model-not-found error."""
    import json

    from kiln.cli.main import main

    eff = tmp_path / "eff.json"
    folder = gguf_path.parent
    assert main(["serve", str(gguf_path), "--dry-run", "--speculative-model", str(folder),
                 "--effective-config-json", str(eff)]) == 0
    got = json.loads(eff.read_text())["settings"]["speculative_model"]
    assert got["value"] == str(gguf_path) and got["source"] == "cli"
    assert str(folder) in got["reason"]
    assert main(["serve", str(gguf_path), "--dry-run", "--speculative-config",
                 json.dumps({"model": str(gguf_path), "num_speculative_tokens": 3,
                             "method": "draft_model"}),
                 "--effective-config-json", str(eff)]) == 0
    s = json.loads(eff.read_text())["settings"]
    assert s["speculative_method"]["value"] == "draft"
    assert s["num_speculative_tokens"]["value"] == 3
    assert "--speculative-config" in s["speculative_model"]["reason"]
    capsys.readouterr()
    assert main(["serve", str(gguf_path), "--dry-run", "--speculative-model",
                 str(tmp_path / "nope.gguf")]) != 0
    assert "nope.gguf" in capsys.readouterr().err
