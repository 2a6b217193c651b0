"""A KV cache that remembers, on SmolLM2: prefix caching (on == off, collisions, salts, metrics),
its flags, prefix rendezvous, and the session cache."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kiln.engine.decisions import Decision
from kiln.sampling_params import SamplingParams

SYSTEM = ("You are a careful assistant for a small bakery. Answer in one short sentence, be "
          "polite, never invent prices, and suggest the daily special when it fits. ")
QUESTIONS = [
    "When do you open?", "Do you sell rye bread?", "Is there a gluten-free cake?",
    "Can I order for Sunday?", "What is the daily special?", "Do you deliver?",
    "Are the croissants vegan?", "How much is a baguette?", "Do you take cards?",
    "Where are you located?", "Can I bring my dog?", "Do you bake wedding cakes?",
    "What time do you close?", "Is parking free?", "Do you have coffee?",
    "Are you open on holidays?", "Can I reserve a table?", "Do you sell gift cards?",
    "Is the sourdough fresh today?", "Do you have nut-free cookies?",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)


def integrity(engine) -> None:
    engine.kv.check_integrity(engine.scheduler.all_requests())


def drive(engine, check=integrity) -> dict[str, list[int]]:
    """Steps until idle, collecting every request's tokens; `check` runs after every step."""
    out: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
        check(engine)
    return out


def build_engine(runner, gguf_path, kv_hash_fn=None, **kw):
    from kiln.engine.engine import Engine
    from kiln.settings.engine_config import EngineConfig

    kw.setdefault("max_num_seqs", 32)
    kw.setdefault("max_num_batched_tokens", 512)
    return Engine(EngineConfig.of(model=str(gguf_path), dtype="float32", **kw), runner=runner,
                  kv_hash_fn=kv_hash_fn)


def run_shared(engine, prompts) -> dict[str, list[int]]:
    """The first request prefills (and publishes) the shared prefix; the others follow."""
    engine.add_request("0", prompts[0], PARAMS)
    out = {o.request_id: list(o.outputs[0].token_ids) for o in engine.step()}
    integrity(engine)
    for i, ids in enumerate(prompts[1:], 1):
        engine.add_request(str(i), ids, PARAMS)
    for rid, toks in drive(engine).items():
        out.setdefault(rid, []).extend(toks)
    return out


@pytest.fixture(scope="module")
def shared_prompts(smollm2_tokenizer) -> list[list[int]]:
    return [smollm2_tokenizer.encode(SYSTEM + q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def without_cache(smollm2_runner, gguf_path, shared_prompts) -> dict[str, list[int]]:
    eng = build_engine(smollm2_runner, gguf_path, enable_prefix_caching=False)
    out = run_shared(eng, shared_prompts)
    m = eng.metrics()
    assert m["prefix_cache_hits_tokens"] == 0
    return out


def test_prefix_caching_gives_the_same_greedy_output_for_20_shared_prefix_requests(
        smollm2_runner, gguf_path, shared_prompts, without_cache):
    eng = build_engine(smollm2_runner, gguf_path)
    assert run_shared(eng, shared_prompts) == without_cache
    m = eng.metrics()
    shared = len(shared_prompts[0]) - 8  # the system prompt's tokens, roughly
    assert m["prefix_cache_queries_tokens"] == sum(len(p) for p in shared_prompts)
    assert m["prefix_cache_hits_tokens"] >= 19 * (shared // 16) * 16
    assert eng.kv.num_free_blocks == eng.kv.num_blocks  # everything released, still cached


@pytest.mark.parametrize("name,hash_fn", [
    ("all-equal", lambda parent, tokens, extra: 0),
    ("mod-3", lambda parent, tokens, extra: hash((parent, tokens, extra)) % 3),
])
def test_forced_hash_collisions_never_reuse_a_wrong_block(smollm2_runner, gguf_path,
                                                          shared_prompts, without_cache, name,
                                                          hash_fn):
    eng = build_engine(smollm2_runner, gguf_path, kv_hash_fn=hash_fn)
    prompts = shared_prompts[:6]
    assert run_shared(eng, prompts) == {str(i): without_cache[str(i)] for i in range(6)}
    assert eng.metrics()["prefix_cache_hits_tokens"] >= 16  # the first block is still shared


def test_cache_salt_isolates_tenants(make_engine, shared_prompts):
    eng = make_engine()
    ids = shared_prompts[0]
    results = {}
    for rid, salt in (("a1", "alice"), ("b1", "bob"), ("plain", None), ("a2", "alice")):
        eng.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=2),
                        cache_salt=salt)
        while eng.has_unfinished:
            for o in eng.step():
                if o.finished:
                    results[rid] = o.num_cached_tokens
            integrity(eng)
    assert results["a1"] == results["b1"] == results["plain"] == 0
    assert results["a2"] == (len(ids) - 1) // 16 * 16


def test_multi_turn_chats_match_with_prefix_caching_on_and_off(make_engine, smollm2_tokenizer):
    tok = smollm2_tokenizer
    users = [["Hi! What is bread made of?", "And how long does it bake?"],
             ["Name a fruit.", "What color is it?"]]
    runs = {}
    for on in (False, True):
        eng = make_engine(enable_prefix_caching=on)
        convs = [[{"role": "system", "content": SYSTEM}] for _ in users]
        replies, cached, first_len = [], [], {}
        for turn in range(2):
            for c, conv in enumerate(convs):
                conv.append({"role": "user", "content": users[c][turn]})
                ids = tok.apply_chat_template(conv)
                first_len.setdefault(c, len(ids))
                eng.add_request(f"{c}-{turn}", ids, SamplingParams(temperature=0.0, max_tokens=6))
            outs: dict[str, list[int]] = {}
            while eng.has_unfinished:
                for o in eng.step():
                    outs.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
                    if o.finished:
                        cached.append((o.request_id, o.num_cached_tokens))
                integrity(eng)
            for c, conv in enumerate(convs):
                reply = tok.decode(outs[f"{c}-{turn}"], skip_special_tokens=True)
                replies.append(reply)
                conv.append({"role": "assistant", "content": reply})
        runs[on] = (replies, dict(cached))
    assert runs[True][0] == runs[False][0]
    assert all(n == 0 for n in runs[False][1].values())
    # Turn 2 finds turn 1's prompt (the system prompt and the first question) in the cache.
    for c in range(2):
        assert runs[True][1][f"{c}-1"] >= first_len[c] // 16 * 16


# --------------------------------------------------------------------------- flags


def parse(*argv):
    from kiln.settings.resolve import resolve_settings
    from kiln.settings.sources import add_setting_arguments, cli_values

    parser = argparse.ArgumentParser()
    add_setting_arguments(parser)
    return resolve_settings(cli=cli_values(parser.parse_args(list(argv))))


def test_prefix_caching_flags_and_their_aliases():
    assert parse()["enable_prefix_caching"] is True
    assert parse("--disable-prefix-cache")["enable_prefix_caching"] is False
    assert parse("--no-enable-prefix-caching")["enable_prefix_caching"] is False
    assert parse("--enable-prefix-cache", "--enable-prefix-caching")["enable_prefix_caching"]


def test_conflicting_prefix_caching_spellings_are_rejected():
    from kiln.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        parse("--enable-prefix-caching", "--disable-prefix-cache")
    assert e.value.code == "config.conflicting_flags" and "enable_prefix_caching" in str(e.value)
    with pytest.raises(ConfigError, match="--enable-prefix-cache and --no-enable-prefix-caching"):
        parse("--no-enable-prefix-caching", "--enable-prefix-cache")


def test_prefix_rendezvous_and_session_cache_settings():
    from kiln.errors import ConfigError
    from kiln.settings.engine_config import EngineConfig

    s = parse()
    cfg = EngineConfig.from_settings(s, model="m")
    assert cfg.scheduler.prefix_rendezvous_max_wait_ms is None
    assert cfg.cache.session_cache == "off"
    s = parse("--prefix-rendezvous-max-wait-ms", "250", "--session-cache", "memory",
              "--session-cache-max-entries", "8", "--session-cache-max-tokens", "4096")
    cfg = EngineConfig.from_settings(s, model="m")
    assert (cfg.scheduler.prefix_rendezvous_max_wait_ms, cfg.cache.session_cache,
            cfg.cache.session_cache_max_entries, cfg.cache.session_cache_max_tokens) == (
        250, "memory", 8, 4096)
    with pytest.raises(ConfigError) as e:
        parse("--prefix-rendezvous-max-wait-ms", "0")
    assert e.value.code == "config.invalid_value"
    assert e.value.message.fields["flag"] == "--prefix-rendezvous-max-wait-ms"
    from kiln.settings.resolve import resolve_settings

    with pytest.raises(ConfigError) as e:
        resolve_settings(env={"session_cache": ("disk", "KILN_SESSION_CACHE")})
    assert e.value.code == "config.invalid_choice"
    assert e.value.hint.fields["choices"] == "off, memory"


# --------------------------------------------------------------------------- rendezvous


def test_two_identical_long_prompts_sent_together_prefill_once(make_engine, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(SYSTEM * 8)[:200]
    assert len(ids) == 200
    params = SamplingParams(temperature=0.0, max_tokens=3, min_tokens=3)
    prefilled, outs = {}, {}
    for wait_ms in (None, 60_000):
        eng = make_engine(prefix_rendezvous_max_wait_ms=wait_ms, max_num_batched_tokens=1024)
        eng.add_request("a", ids, params)
        eng.add_request("b", ids, params)
        outs[wait_ms] = drive(eng)
        m = eng.metrics()
        prefilled[wait_ms] = m["prefill_tokens"]
        if wait_ms:
            assert m["prefix_rendezvous_waits"] == 1 and m["prefix_rendezvous_timeouts"] == 0
    assert outs[None]["a"] == outs[None]["b"] == outs[60_000]["a"] == outs[60_000]["b"]
    assert prefilled[None] == 2 * 199  # both prompts computed in full
    assert prefilled[60_000] == 199 + (200 - 192 - 1)  # b computes its last 8 tokens only


# --------------------------------------------------------------------------- session cache


def test_session_turn_2_hits_turn_1_after_traffic_that_evicts_it(make_engine,
                                                                smollm2_tokenizer):
    tok = smollm2_tokenizer
    conv = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Tell me one fact about the moon."}]
    turn1 = tok.apply_chat_template(conv)
    traffic = [tok.encode(f"Story {i}: " + SYSTEM)[:60] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    seen = {}
    for mode in ("off", "memory"):
        # 12 blocks of 16 tokens; each traffic request takes 4 of them.
        eng = make_engine(kv_max_blocks=12, session_cache=mode, session_cache_max_entries=4)
        eng.add_request("t1", turn1, params, session_id="user-42")
        reply = drive(eng)["t1"]
        for i, ids in enumerate(traffic):  # one at a time: never more than the free blocks
            eng.add_request(f"x{i}", ids, SamplingParams(temperature=0.0, max_tokens=1))
            drive(eng)
        conv2 = conv + [{"role": "assistant", "content": tok.decode(reply,
                                                                    skip_special_tokens=True)},
                        {"role": "user", "content": "And one more?"}]
        eng.add_request("t2", tok.apply_chat_template(conv2), params, session_id="user-42")
        cached, out = 0, []
        while eng.has_unfinished:
            for o in eng.step():
                out.extend(o.outputs[0].token_ids)
                cached = o.num_cached_tokens
            integrity(eng)
        seen[mode] = (cached, out, eng.metrics())
    assert seen["off"][0] == 0  # the traffic evicted turn 1
    assert seen["memory"][0] >= len(turn1) // 16 * 16  # pinned: at least turn 1's prompt
    assert seen["memory"][1] == seen["off"][1]
    m = seen["memory"][2]
    assert m["session_cache_entries"] == 1 and m["session_cache_pinned_blocks"] >= 2
    assert m["session_cache_released"] == 0


def test_cascade_decode_over_a_shared_prefix_matches_no_sharing(smollm2_runner, gguf_path,
                                                                smollm2_tokenizer, monkeypatch):
    """8 requests whose prompts share a ~10-block prefix: with prefix caching their decode rows
    share those physical blocks and attend to them once (cascade); the greedy tokens equal a run
    without prefix caching, where nothing is shared."""
    long_system = SYSTEM * 4
    prompts = [smollm2_tokenizer.encode(long_system + q) for q in QUESTIONS[:8]]
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
    runner = smollm2_runner
    seen: list[int] = []
    original = type(runner)._shared_prefix_blocks

    def spy(self, decodes):
        n = original(self, decodes)
        seen.append(n)
        return n

    monkeypatch.setattr(type(runner), "_shared_prefix_blocks", spy)
    # The shared runner is batch-invariant (no cascade): this test is about the other mode.
    for layer in runner.model.attention_layers():
        monkeypatch.setattr(layer.kv, "invariant", False)
    monkeypatch.setattr(runner, "decisions", dataclasses.replace(
        runner.decisions,
        cascade=Decision(True, "test: --no-batch-invariant's cascade", "cascade.on")))

    def run(**kw) -> dict[str, list[int]]:
        eng = build_engine(runner, gguf_path, **kw)
        eng.add_request("0", prompts[0], params)
        out = {o.request_id: list(o.outputs[0].token_ids) for o in eng.step()}
        for i, ids in enumerate(prompts[1:], 1):
            eng.add_request(str(i), ids, params)
        for rid, toks in drive(eng).items():
            out.setdefault(rid, []).extend(toks)
        return out

    plain = run(enable_prefix_caching=False)
    assert not any(seen), "no shared blocks without prefix caching"
    cascaded = run()
    shared_blocks = (len(smollm2_tokenizer.encode(long_system)) - 16) // 16
    assert max(seen) >= shared_blocks >= 4  # the cascade path ran
    assert cascaded == plain


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cascade_attention_equals_attention_over_the_whole_context(dtype):
    import torch

    from kiln.layers.attention import Attention

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    att = Attention(num_heads=9, num_kv_heads=3, head_dim=64)
    b, p, n = 5, 48, 20
    q = torch.randn(b, 9, 64, dtype=dt)
    sk, sv = torch.randn(p, 3, 64, dtype=dt), torch.randn(p, 3, 64, dtype=dt)
    ck, cv = torch.randn(b, n, 3, 64, dtype=dt), torch.randn(b, n, 3, 64, dtype=dt)
    lens = torch.tensor([1, 5, 20, 13, 8])
    mask = (torch.arange(n)[None, :] < lens[:, None])[:, None, None, :]
    got = att._cascade(q, sk, sv, ck, cv, mask).float()
    fused = att._cascade_fused(q, sk, sv, ck, cv, mask).float()  # compiled steps' form
    whole_k = torch.cat([sk.expand(b, p, 3, 64), ck], dim=1)
    whole_v = torch.cat([sv.expand(b, p, 3, 64), cv], dim=1)
    whole_mask = torch.cat([torch.ones(b, 1, 1, p, dtype=torch.bool), mask], dim=-1)
    want = att._decode(q.float(), whole_k.float(), whole_v.float(), whole_mask)
    tol = 1e-5 if dtype == "float32" else 3e-2
    assert (got - want).abs().max().item() < tol
    assert (fused - want).abs().max().item() < tol
