"""Structured output (engine/structured.py): the grammar mask on the engine, then end to end with
the openai client against a real `kiln serve` on SmolLM2.

The 20 schemas ask for nested objects, arrays (of objects, of arrays), enums, required and
optional fields, numbers, integers, booleans, null, patterns, $ref and anyOf. Requests are
greedy with frequency_penalty 0.5: SmolLM2-135M, greedy alone, can repeat itself inside a
string until max_tokens, and a cut string is not valid JSON however well the grammar held.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import pytest
import torch

from kiln.engine.structured import (
    StructuredOutputError,
    StructuredOutputs,
    apply_bitmasks,
    canonical,
    fill_bitmasks,
)
from kiln.sampling_params import SamplingParams
from kiln.sampling_params import StructuredOutputsParams as SO
from kiln.server.request_params import strict_schema

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]},
    "book": {"type": "object", "properties": {
        "title": {"type": "string"}, "author": {"type": "string"},
        "year": {"type": "integer", "minimum": 1400, "maximum": 2030}},
        "required": ["title", "author", "year"]},
    "weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "temperature_c": {"type": "number"},
        "sky": {"enum": ["sunny", "cloudy", "rainy", "snowy"]}},
        "required": ["city", "temperature_c", "sky"]},
    "todo": {"type": "object", "properties": {
        "task": {"type": "string"}, "done": {"type": "boolean"},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["task", "done", "priority"]},
    "shopping": {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4}},
        "required": ["items"]},
    "point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
              "required": ["x", "y"]},
    "address": {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "city", "zip"]},
    "employee": {"type": "object", "properties": {
        "name": {"type": "string"},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "country": {"type": "string"}},
            "required": ["city", "country"]}},
        "required": ["name", "address"]},
    "order": {"type": "object", "properties": {
        "order_id": {"type": "integer"},
        "lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"]}}},
        "required": ["order_id", "lines"]},
    "color": {"type": "object", "properties": {
        "name": {"enum": ["red", "green", "blue"]},
        "rgb": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255},
                "minItems": 3, "maxItems": 3}},
        "required": ["name", "rgb"]},
    "flags": {"type": "object", "properties": {
        "enabled": {"type": "boolean"}, "verbose": {"type": "boolean"},
        "level": {"enum": ["debug", "info", "warn"]}},
        "required": ["enabled", "verbose", "level"]},
    "movie": {"type": "object", "properties": {
        "title": {"type": "string"}, "rating": {"type": "number", "minimum": 0, "maximum": 10},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action", "horror"]},
                   "maxItems": 3}},
        "required": ["title", "rating", "genres"]},
    "optional_fields": {"type": "object", "properties": {
        "id": {"type": "integer"}, "nickname": {"type": "string"}, "email": {"type": "string"}},
        "required": ["id"]},
    "matrix": {"type": "object", "properties": {
        "rows": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}}},
        "required": ["rows"]},
    "nullable": {"type": "object", "properties": {
        "name": {"type": "string"}, "middle_name": {"type": ["string", "null"]}},
        "required": ["name", "middle_name"]},
    "event": {"type": "object", "properties": {
        "name": {"type": "string"},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "attendees": {"type": "integer", "minimum": 0}},
        "required": ["name", "date", "attendees"]},
    "company": {"type": "object", "properties": {
        "name": {"type": "string"},
        "ceo": {"type": "object", "properties": {
            "name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]},
        "public": {"type": "boolean"}},
        "required": ["name", "ceo", "public"]},
    "refs": {"type": "object", "$defs": {"pet": {"type": "object", "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]}, "name": {"type": "string"}},
        "required": ["kind", "name"]}},
        "properties": {"owner": {"type": "string"},
                       "pets": {"type": "array", "items": {"$ref": "#/$defs/pet"},
                                "minItems": 1, "maxItems": 2}},
        "required": ["owner", "pets"]},
    "union": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "unit": {"enum": ["kg", "lb"]}},
        "required": ["value", "unit"]},
    "deep": {"type": "object", "properties": {
        "a": {"type": "object", "properties": {
            "b": {"type": "object", "properties": {
                "c": {"type": "object", "properties": {"d": {"type": "integer"}},
                      "required": ["d"]}},
                "required": ["c"]}},
            "required": ["b"]}},
        "required": ["a"]},
}
MAX_TOKENS = 160  # the longest greedy answer to these is ~80 tokens
GREEDY = {"temperature": 0, "frequency_penalty": 0.5}


def ask(name: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Give an example {name.replace('_', ' ')} as JSON."}]


def allowed(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    bits = (bitmask[row].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.flatten()[:vocab]).flatten().tolist())


# --------------------------------------------------------------------------- the mask alone


def test_the_mask_changes_only_constrained_rows_and_only_blocked_tokens() -> None:
    torch.manual_seed(0)
    V = 1000
    before = torch.randn(4, V)
    kept = before.clone()
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, (V + 31) // 32), dtype=torch.int32)
    logits = apply_bitmasks(before, bitmask, [1, 3])
    assert torch.equal(before, kept)  # a new tensor; the caller's is left alone
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    for i, row in enumerate((1, 3)):
        ok = allowed(bitmask, i, V)
        keep = torch.tensor([t in ok for t in range(V)])
        assert torch.equal(logits[row][keep], before[row][keep])  # the same bits
        assert torch.isneginf(logits[row][~keep]).all()
    want = torch.randn(2, V)
    every = apply_bitmasks(want, bitmask, [0, 1])  # all rows: one add over the tensor
    for i in range(2):
        ok = allowed(bitmask, i, V)
        assert all((every[i, t] == want[i, t]) == (t in ok) for t in range(0, V, 7))


@pytest.fixture(scope="module")
def grammars(smollm2_tokenizer) -> StructuredOutputs:
    return StructuredOutputs(smollm2_tokenizer, 49152)


def test_compile_is_cached_per_canonical_value_and_errors_name_the_field(grammars) -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    n = grammars.compiles
    first = grammars.compile(SO(json=schema))
    assert grammars.compile(SO(json=json.dumps(schema))) is first  # text or dict: one entry
    assert grammars.compiles == n + 1
    # Property order orders the output, so it is part of the key.
    reordered = {"type": "object", "properties": dict(reversed(schema["properties"].items()))}
    assert canonical(SO(json=reordered)) != canonical(SO(json=schema))
    # (constraint, its code, what of it the compiler's diagnosis names: the part to fix)
    schema, regex, grammar, choice = ("invalid_json_schema", "invalid_regex", "invalid_grammar",
                                      "invalid_choice")
    bad = [(SO(json={"type": "nope"}), schema, "nope"), (SO(json="{not json"), schema, ""),
           (SO(json={"not": {"type": "string"}}), schema, "not"), (SO(regex="(ab"), regex, "(ab"),
           (SO(grammar="start: foo"), grammar, "foo"), (SO(grammar='root ::= "a" | b'), grammar, "b"),
           (SO(choice=[]), choice, ""), (SO(choice=["a", 1]), choice, "")]  # type: ignore[list-item]
    for so, code, names in bad:
        with pytest.raises(StructuredOutputError) as e:
            grammars.compile(so, "guided_x")
        assert (e.value.param, e.value.code) == ("guided_x", code) and names in str(e.value), e.value


def test_a_complete_grammar_allows_only_eos_and_stops(grammars, smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    m = grammars.matcher(SO(choice=["yes", "no"]))
    first = allowed(fill_bitmasks([m], 49152), 0, 49152)
    assert tok.encode("yes", add_special_tokens=False)[0] in first
    assert not first & tok.eos_token_ids  # "" is not a choice
    for t in tok.encode("yes", add_special_tokens=False):
        assert m.accept(t)
    assert m.done
    assert allowed(fill_bitmasks([m], 49152), 0, 49152) == tok.eos_token_ids


def test_strict_schema_forbids_unlisted_properties_everywhere() -> None:
    s = strict_schema({"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"type": "array", "items": {"type": "object", "properties": {}}},
        "c": {"type": "object", "additionalProperties": {"type": "integer"}},
        "d": {"const": {"type": "object"}}},
        "$defs": {"p": {"type": "object", "properties": {"q": {}}}}})
    assert s["additionalProperties"] is False
    assert s["properties"]["a"]["additionalProperties"] is False
    assert s["properties"]["b"]["items"]["additionalProperties"] is False
    assert s["properties"]["c"]["additionalProperties"] == {"type": "integer"}
    assert s["properties"]["d"] == {"const": {"type": "object"}}  # data, not a schema
    assert s["$defs"]["p"]["additionalProperties"] is False


def test_a_padded_model_vocabulary_never_allows_the_padding(smollm2_tokenizer) -> None:
    V = 49152 + 100  # the model's logits wider than the tokenizer's vocabulary
    m = StructuredOutputs(smollm2_tokenizer, V).matcher(SO(regex="[a-z]+"))
    ok = allowed(fill_bitmasks([m], V), 0, V)
    assert ok and max(ok) < 49152


# --------------------------------------------------------------------------- on the engine


@pytest.fixture
def engine(smollm2_runner, smollm2_tokenizer, gguf_path):
    from kiln.engine.engine import Engine
    from kiln.settings.engine_config import EngineConfig

    def make(**kw):
        kw.setdefault("max_num_seqs", 32)
        kw.setdefault("max_num_batched_tokens", 512)
        cfg = EngineConfig.of(model=str(gguf_path), dtype="float32", **kw)
        return Engine(cfg, runner=smollm2_runner, tokenizer=smollm2_tokenizer)

    return make


def _run(eng) -> dict[str, tuple[str, list[int], str | None, list]]:
    out: dict[str, Any] = {}
    while eng.has_unfinished:
        for o in eng.step():
            text, ids, _, lps = out.get(o.request_id, ("", [], None, []))
            out[o.request_id] = (text + o.outputs[0].text, ids + o.outputs[0].token_ids,
                                 o.outputs[0].finish_reason, lps + (o.outputs[0].logprobs or []))
    return out


def test_the_sampler_masks_constrained_rows_and_leaves_the_others_bit_identical(grammars):
    from kiln.engine.request import Request
    from kiln.engine.sampler import Sampler

    torch.manual_seed(1)
    V = 49152
    logits = torch.randn(6, V) * 3
    kinds = [None, SO(regex="[0-9]+"), None, SO(choice=["alpha", "beta"]), None, SO(regex="x")]
    temps = [0.0, 0.0, 0.8, 0.8, 0.8, 0.0]

    def reqs(constrained: bool) -> list[Request]:
        out = []
        for i, (so, t) in enumerate(zip(kinds, temps)):
            r = Request(str(i), [1, 2], SamplingParams(temperature=t, seed=i, logprobs=3))
            if constrained and so is not None:
                r.grammar = grammars.matcher(so)
            out.append(r)
        return out

    before = logits.clone()
    plain = Sampler(V, torch.device("cpu"))(logits, reqs(False))
    masked = Sampler(V, torch.device("cpu"))(logits, reqs(True))
    assert torch.equal(logits, before)  # the caller's logits are left alone
    for i in (0, 2, 4):
        assert masked.token_ids[i] == plain.token_ids[i]
        a, b = masked.logprobs[i], plain.logprobs[i]
        assert (a.token_id, a.logprob, a.top) == (b.token_id, b.logprob, b.top)
    check = reqs(True)
    bitmask = fill_bitmasks([check[i].grammar for i in (1, 3, 5)], V)
    for row, i in enumerate((1, 3, 5)):
        ok = allowed(bitmask, row, V)
        assert masked.token_ids[i] in ok
        # Logprobs of the masked distribution: allowed tokens only, summing to one.
        assert {t for t, _ in masked.logprobs[i].top} <= ok
        lp = torch.log_softmax(before[i].masked_fill(
            ~torch.isin(torch.arange(V), torch.tensor(sorted(ok))), float("-inf")), dim=-1)
        assert masked.logprobs[i].logprob == pytest.approx(lp[masked.token_ids[i]].item())
    assert masked.token_ids[5] == grammars.tokenizer.encode("x", add_special_tokens=False)[0]


def test_constrained_and_free_requests_in_one_batch(engine, smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompts = [tok.apply_chat_template(ask(n)) for n in ("person", "book", "movie")]
    free = SamplingParams(temperature=0, max_tokens=12)
    alone = engine()
    for i, p in enumerate(prompts):
        alone.add_request(f"free{i}", p, free)
    want = _run(alone)
    eng = engine()
    for i, p in enumerate(prompts):
        eng.add_request(f"free{i}", p, free)
        eng.add_request(f"re{i}", p, SamplingParams(
            temperature=0.7, seed=i, max_tokens=20, logprobs=3,
            structured_outputs=SO(regex=r"[0-9]{3}-[a-z]{2,4}")))
        eng.add_request(f"ch{i}", p, SamplingParams(
            temperature=0, max_tokens=20, ignore_eos=True,
            structured_outputs=SO(choice=["alpha", "beta", "gamma delta"]),))
    got = _run(eng)
    for i in range(3):
        assert got[f"free{i}"][1:3] == want[f"free{i}"][1:3]  # tokens and finish reason
        text, _, reason, lps = got[f"re{i}"]
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text) and reason == "stop", text
        assert len(lps) == len(got[f"re{i}"][1]) and all(lp.logprob > -1e9 for lp in lps)
        text, _, reason, _ = got[f"ch{i}"]
        # ignore_eos: the grammar ends it all the same, once the choice is complete.
        assert text in ("alpha", "beta", "gamma delta") and reason == "stop", text


def test_preempted_constrained_requests_stay_valid(engine, smollm2_tokenizer):
    tok = smollm2_tokenizer
    # 7 blocks of 16: two 37-token prompts are admitted (3 blocks each), and both need a 4th
    # block ~10 tokens in: one is preempted, and recomputed later with its output so far.
    eng = engine(kv_max_blocks=7, enable_prefix_caching=False)
    names = ["person", "point", "flags", "deep", "matrix"]
    for n in names:
        eng.add_request(n, tok.apply_chat_template(ask(n)), SamplingParams(
            **GREEDY, max_tokens=50, structured_outputs=SO(json=strict_schema(SCHEMAS[n]))))
    got = _run(eng)
    assert eng.metrics()["num_preemptions"] > 0, "the pool was meant to be too small"
    for n in names:
        text, _, reason, _ = got[n]
        assert reason == "stop", (n, text)
        jsonschema.validate(json.loads(text), SCHEMAS[n])


def test_engine_refuses_an_invalid_constraint_at_admission(engine):
    eng = engine()
    with pytest.raises(StructuredOutputError) as e:
        eng.add_request("x", [1, 2, 3], SamplingParams(structured_outputs=SO(regex="[")))
    assert (e.value.param, e.value.code) == ("structured_outputs", "invalid_regex")
    assert not eng.has_unfinished


def test_offline_llm_n2_each_choice_its_own_matcher():
    from kiln import LLM

    llm = LLM(dtype="float32", compile=False, kv_cache_memory=32 << 20, max_model_len=512,
              max_num_batched_tokens=256)
    # Strict (no other properties): a sampled answer cannot wander on past max_tokens.
    out = llm.chat(ask("point"), SamplingParams(
        n=2, temperature=1.0, seed=3, max_tokens=100,
        structured_outputs=SO(json=strict_schema(SCHEMAS["point"]))))
    assert len(out[0].outputs) == 2
    for c in out[0].outputs:
        jsonschema.validate(json.loads(c.text), SCHEMAS["point"])


# --------------------------------------------------------------------------- through the server


@pytest.fixture(scope="module")
def server(tmp_path_factory, gguf_path):
    from test_server import _serve

    yield from _serve(tmp_path_factory.mktemp("structured"), gguf_path, "--max-num-seqs", "16")


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _json_schema_request(client, name: str, stream: bool) -> tuple[str, str]:
    fmt = {"type": "json_schema",
           "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    kw = dict(model="smol", messages=ask(name), max_tokens=MAX_TOKENS, response_format=fmt,
              **GREEDY)
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    return text, reason


@pytest.mark.slow
def test_twenty_json_schemas_streamed_and_not_sixteen_at_once(client):
    jobs = [(name, stream) for stream in (False, True) for name in SCHEMAS]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda j: _json_schema_request(client, *j), jobs))
    by_job = dict(zip(jobs, results))
    for (name, stream), (text, reason) in by_job.items():
        assert reason == "stop", (name, stream, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
        assert by_job[(name, not stream)][0] == text  # greedy: streaming changes nothing


@pytest.mark.slow
def test_json_object_regex_choice_grammar_and_n(client):
    r = client.chat.completions.create(
        model="smol", messages=ask("person"), max_tokens=MAX_TOKENS,
        response_format={"type": "json_object"}, **GREEDY)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(
        model="smol", prompt="My phone number is", max_tokens=20, temperature=0,
        extra_body={"guided_regex": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", r.choices[0].text), r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Is the sea wet?"}], max_tokens=10,
        temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    # GBNF (vLLM's EBNF) and Lark, by the old extra and by the structured_outputs object.
    gbnf = 'root ::= "The answer is " [0-9]+ "."'
    lark = 'start: "The answer is " NUM "."\nNUM: /[0-9]+/'
    for body in ({"guided_grammar": gbnf}, {"structured_outputs": {"grammar": lark}}):
        r = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "What is 2+2?"}],
            max_tokens=20, temperature=0, extra_body=body)
        assert re.fullmatch(r"The answer is [0-9]+\.", r.choices[0].message.content), body
    # n=2, sampled, streamed: each choice its own matcher, both valid.
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(
            model="smol", messages=ask("weather"), max_tokens=MAX_TOKENS, n=2, seed=7,
            temperature=0.8, frequency_penalty=0.5, stream=True,
            extra_body={"guided_json": SCHEMAS["weather"]}):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMAS["weather"])


@pytest.mark.slow
def test_invalid_constraints_are_400_naming_the_field_and_the_server_goes_on(server, client):
    def post(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30,
                          headers={"Authorization": "Bearer sk-kiln-test"},
                          json={"model": "smol", "messages": ask("x"), "max_tokens": 4, **body})

    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
         "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
    ]
    for body, param in cases:
        resp = post(body)
        assert resp.status_code == 400, (body, resp.text)
        err = resp.json()["error"]
        assert err["param"] == param and err["type"] == "BadRequestError", (body, err)
    # Completions take the same fields.
    resp = httpx.post(f"{server.base_url}/v1/completions", timeout=30,
                      headers={"Authorization": "Bearer sk-kiln-test"},
                      json={"model": "smol", "prompt": "x", "guided_regex": "("})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "guided_regex"
    r = client.chat.completions.create(model="smol", messages=ask("point"), max_tokens=40,
                                       extra_body={"guided_json": SCHEMAS["point"]}, **GREEDY)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS["point"])
    assert server.health()["status"] == "ok"

