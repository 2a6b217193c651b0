"""POST /v1/responses and the small endpoints (/tokenize, /detokenize, /v1/models/{id},
prompt_logprobs, interleaved system coalescing), end to end: a real `kiln serve` of the shipped
SmolLM2 (fp32, greedy, short answers) driven by the official openai client."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_server import API_KEY, NAMES, Server, _serve

from kiln.server.errors import APIError
from kiln.server.routes.responses import ResponseStore, StoredResponse
from kiln.server.serving import Serving
from kiln.tokenizer import Tokenizer, coalesce_system_messages

QUESTION = "What is the capital of France?"
SECOND = "And of Italy?"
STREAM_TYPES = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added"]
END_TYPES = ["response.output_text.done", "response.content_part.done",
             "response.output_item.done", "response.completed"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> Iterator[Server]:
    yield from _serve(tmp_path_factory.mktemp("responses"), gguf_path,
                      "--enable-interleaved-system-coalescing")


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return server.client()


def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"})


def _count(server: Server, messages: list[dict[str, Any]]) -> int:
    """Prompt tokens of `messages` as the chat template renders them (through /tokenize)."""
    r = _post(server, "/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["count"]


@pytest.fixture(scope="module")
def first_turn(client: Any) -> Any:
    return client.responses.create(model=NAMES[0], input=QUESTION, max_output_tokens=24,
                                   temperature=0)


# -- /v1/responses ---------------------------------------------------------------------------


@pytest.mark.slow
def test_create_answers_with_a_message_and_usage(server: Server, first_turn: Any) -> None:
    r = first_turn
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert [o.type for o in r.output] == ["message"]
    assert r.output[0].content[0].type == "output_text"
    assert "Paris" in r.output_text
    assert r.usage.input_tokens == _count(server, [{"role": "user", "content": QUESTION}])
    assert 0 < r.usage.output_tokens <= 24
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


@pytest.mark.slow
def test_streamed_events_come_in_order_and_add_up_to_the_answer(client: Any,
                                                                first_turn: Any) -> None:
    events = list(client.responses.create(model=NAMES[0], input=QUESTION, max_output_tokens=24,
                                          temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:4] == STREAM_TYPES and types[-4:] == END_TYPES
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == events[-4].text == first_turn.output_text
    assert final.status == "completed" and final.usage.output_tokens == \
        first_turn.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_previous_response_id_continues_the_conversation(server: Server, client: Any,
                                                         first_turn: Any, stream: bool) -> None:
    kw = {"model": NAMES[0], "input": SECOND, "previous_response_id": first_turn.id,
          "max_output_tokens": 16, "temperature": 0}
    if stream:
        second = list(client.responses.create(**kw, stream=True))[-1].response
    else:
        second = client.responses.create(**kw)
    # The prompt is the whole conversation: the first question, its answer, the new question.
    convo = [{"role": "user", "content": QUESTION},
             {"role": "assistant", "content": first_turn.output_text},
             {"role": "user", "content": SECOND}]
    assert second.usage.input_tokens == _count(server, convo)
    assert second.previous_response_id == first_turn.id
    assert second.output_text


@pytest.mark.slow
def test_retrieve_and_unknown_ids(client: Any, first_turn: Any) -> None:
    got = client.responses.retrieve(first_turn.id)
    assert got.id == first_turn.id and got.output_text == first_turn.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=NAMES[0], input="hi", previous_response_id="resp_unknown",
                                max_output_tokens=4)
    unstored = client.responses.create(model=NAMES[0], input="hi", store=False,
                                       max_output_tokens=2, temperature=0)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.slow
def test_instructions_items_and_tools_render_as_chat_messages(server: Server,
                                                              client: Any) -> None:
    tool = {"type": "function", "name": "get_weather", "description": "weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    r = client.responses.create(
        model=NAMES[0], instructions="Answer in one word.", tools=[tool],
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city": "Oslo"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}],
        max_output_tokens=4, temperature=0)
    convo = [{"role": "system", "content": "Answer in one word."},
             {"role": "user", "content": "Weather in Oslo?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "call_1", "type": "function",
                  "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    assert r.usage.input_tokens == _count(server, convo)
    assert r.tools[0].name == "get_weather" and r.instructions == "Answer in one word."
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=NAMES[0], input="hi", tools=[{"type": "web_search"}])
    assert e.value.code == "unsupported_value" and e.value.param == "tools"
    assert "web_search" in e.value.message  # the tool type refused, by name
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=NAMES[0], input="hi", max_output_tokens=5000)
    assert e.value.body["param"] == "max_output_tokens"


@pytest.mark.slow
def test_text_format_json_schema_is_enforced_and_strict_means_no_other_keys(client: Any) -> None:
    """text.format goes in as the chat endpoint's response_format: the answer parses against the
    schema, and strict=true forbids keys the schema does not list (OpenAI's strict mode)."""
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "country": {"type": "string"}},
              "required": ["city", "country"]}
    r = client.responses.create(
        model=NAMES[0], input=QUESTION, temperature=0, max_output_tokens=48,
        text={"format": {"type": "json_schema", "name": "place", "schema": schema,
                         "strict": True}})
    assert r.status == "completed", r
    answer = json.loads(r.output_text)
    assert set(answer) == {"city", "country"}
    assert all(isinstance(v, str) for v in answer.values())
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=NAMES[0], input=QUESTION,
                                text={"format": {"type": "json_schema", "name": "x"}})
    assert e.value.body["param"] == "text"


def test_response_store_drops_the_least_recently_used() -> None:
    store = ResponseStore(2)
    for rid in ("a", "b"):
        store.put(rid, StoredResponse({"id": rid}, []))
    assert store.get("a") is not None  # "a" is now the most recent
    store.put("c", StoredResponse({"id": "c"}, []))
    assert store.get("b") is None and store.get("a") and store.get("c") and len(store) == 2


# -- the small endpoints -------------------------------------------------------------------


@pytest.mark.slow
def test_tokenize_detokenize_round_trip(server: Server, client: Any) -> None:
    text = "Hello, kiln! Ünïcödé too."
    r = _post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) > 3
    assert r["max_model_len"] == 1024
    assert _post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": text}
    # Messages count as the chat endpoint's prompt does.
    chat = client.chat.completions.create(model=NAMES[0], max_tokens=1, messages=[
        {"role": "user", "content": text}])
    assert _count(server, [{"role": "user", "content": text}]) == chat.usage.prompt_tokens
    bad = _post(server, "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert _post(server, "/tokenize", {"prompt": "x", "model": "nope"}).status_code == 404
    assert httpx.post(f"{server.base_url}/tokenize", json={"prompt": "x"}).status_code == 401


@pytest.mark.slow
def test_models_by_id(client: Any) -> None:
    for name in NAMES:
        m = client.models.retrieve(name)
        assert m.id == name and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.slow
def test_prompt_logprobs_equal_the_logprobs_the_tokens_had_when_generated(
        server: Server) -> None:
    prompt = "The capital of France is"
    gen = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                            "logprobs": 0}).json()["choices"][0]
    prompt_ids = _post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]
    out_ids = _post(server, "/tokenize", {"prompt": gen["text"],
                                          "add_special_tokens": False}).json()["tokens"]
    scored = _post(server, "/v1/completions", {
        "prompt": prompt_ids + out_ids, "max_tokens": 1, "temperature": 0,
        "prompt_logprobs": 2}).json()["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(prompt_ids) + len(out_ids) and scored[0] is None
    n = min(len(out_ids), len(gen["logprobs"]["token_logprobs"]))
    assert n >= 3  # the generated text re-tokenizes to (at least a prefix of) the same tokens
    for i in range(n):
        entry = scored[len(prompt_ids) + i]
        tok = str(out_ids[i])
        assert entry[tok]["rank"] == 1  # greedy: the likeliest token
        assert abs(entry[tok]["logprob"] - gen["logprobs"]["token_logprobs"][i]) < 1e-4
        assert len(entry) <= 3  # the prompt's token and the 2 likeliest
    chat = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0})
    assert len(chat.json()["prompt_logprobs"]) == _count(server, [{"role": "user",
                                                                    "content": "hi"}])
    streamed = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "stream": True, "prompt_logprobs": 0})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


@pytest.mark.slow
def test_interleaved_system_messages_are_coalesced_when_on(server: Server) -> None:
    later = [{"role": "user", "content": "hi"}, {"role": "system", "content": "be brief"}]
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert _post(server, "/tokenize", {"messages": later}).json()["tokens"] == \
        _post(server, "/tokenize", {"messages": first}).json()["tokens"]


# A template that refuses a system message anywhere but first, as many do.
STRICT = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
          "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
          "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_system_coalescing_on_renders_what_a_strict_template_refuses(
        smollm2_tokenizer: Tokenizer) -> None:
    tok = Tokenizer(copy.deepcopy(smollm2_tokenizer.hf), chat_template=STRICT,
                    eos_token_ids=smollm2_tokenizer.eos_token_ids)
    msgs = [{"role": "system", "content": "A."}, {"role": "user", "content": "hi"},
            {"role": "system", "content": "B."}]
    assert coalesce_system_messages(msgs) == [{"role": "system", "content": "A.\n\nB."},
                                              {"role": "user", "content": "hi"}]
    # The engine is not reached: rendering a prompt is all these calls do.
    off = Serving(None, tok, ["m"], max_model_len=64, version="t")  # type: ignore[arg-type]
    with pytest.raises(APIError) as e:
        off.chat_prompt(msgs)
    assert e.value.status == 400 and "--enable-interleaved-system-coalescing" in e.value.message
    on = Serving(None, tok, ["m"], max_model_len=64, version="t",  # type: ignore[arg-type]
                 coalesce_system=True)
    assert tok.decode(on.chat_prompt(msgs)).startswith("<|im_start|>system\nA.\n\nB.<|im_end|>")


# Tools as Qwen's template writes them (each with tojson, so the key order is in the prompt),
# and the calls of earlier turns.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] or '' }}{% for c in m['tool_calls'] or [] %}<tool_call>"
    "{{ c['function'] | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_and_responses_make_the_same_engine_request(smollm2_tokenizer: Tokenizer) -> None:
    """Issue 44: one conversion. The same conversation (instructions, an earlier call and its
    output, a tool whose keys a client sent in another order) through the chat and the
    Responses request gives the same prompt token ids and SamplingParams (special tokens kept
    for the hermes parser, the same constraint for a named tool_choice)."""
    import asyncio

    from kiln.server.chat_output import ChatFormat
    from kiln.server.protocol import ChatCompletionRequest
    from kiln.server.responses_protocol import ResponsesRequest
    from kiln.server.routes.chat import prepare_chat
    from kiln.server.routes.responses import chat_request, input_messages

    tok = Tokenizer(copy.deepcopy(smollm2_tokenizer.hf), chat_template=TOOLS_TEMPLATE,
                    eos_token_ids=smollm2_tokenizer.eos_token_ids)
    # The engine is not reached: preparing a request renders, tokenizes and plans; the named
    # tool_choice's grammar is compiled by the engine's grammar engine, which this test skips.
    sv = Serving(None, tok, ["m"], max_model_len=512, version="t",  # type: ignore[arg-type]
                 chat=ChatFormat("hermes"))
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    fn = {"name": "get_weather", "description": "weather of a city", "parameters": params}
    scrambled = {"type": "function", "function": {"parameters": params, "name": "get_weather",
                                                  "description": "weather of a city"}}
    chat = ChatCompletionRequest(
        temperature=0, max_tokens=8, tools=[scrambled], messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    resp = ResponsesRequest(
        temperature=0, max_output_tokens=8, instructions="Be brief.",
        tools=[{"type": "function", **fn}], input=[
            {"role": "user", "content": "Oslo?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    a = asyncio.run(prepare_chat(sv, chat))
    b = asyncio.run(prepare_chat(sv, chat_request(resp, input_messages(resp))))
    assert a.prompt_ids == b.prompt_ids and a.params == b.params
    assert a.params.skip_special_tokens is False  # hermes' markers stay in the output text
    assert json.dumps({"type": "function", "function": fn}) in a.prompt_text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}' in a.prompt_text

    from kiln.server.chat_output import plan_tools

    named = plan_tools(chat.tools, {"type": "function", "function": {"name": "get_weather"}},
                       None, sv.chat)
    via_responses = chat_request(resp.model_copy(update={
        "tool_choice": {"type": "function", "name": "get_weather"}}), [])
    assert plan_tools(via_responses.tools, via_responses.tool_choice, None, sv.chat
                      ).structured == named.structured
