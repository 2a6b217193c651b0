"""Agent frameworks against a real `kiln serve`, unchanged (issue 44): the openai SDK's parse and
stream helpers, openai-agents, langchain-openai, instructor and pydantic-ai, each with its own
client, on Qwen2.5-Coder-0.5B-Instruct Q4_K_M (served as shipped: its K-quant kernels, greedy),
one server for the module. Also what the frameworks lean on: the same request renders the same
token ids through /v1/chat/completions and /v1/responses (read from --request-dump-dir), a named
tool_choice is constrained to the model's own call format (the wrapper, then the arguments), and
a streamed Responses tool call comes as function_call_arguments events, not as message text.

`heavy` (a real model's load): `pytest -m heavy tests/heavy/test_agent_frameworks.py`. The frameworks
are in the test extras except instructor, whose jiter<0.15 pin conflicts with the openai client's
jiter>=0.16 (pip would downgrade openai): `pip install --no-deps instructor docstring-parser`,
else its cases skip. KILN_AGENTS_MODELS=0.5b,1.5b runs the module on the 1.5B as well.

The 0.5B calls its tool again after the tool's result instead of answering (the same prompt
through any server): agent runs here stop at the first tool's output (openai-agents'
stop_on_first_tool) or end in a structured output the tool's result fills (pydantic-ai), so what
is checked is what the server does: the call reaches the framework, the tool runs, its output
comes back.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import QWEN_CODER_05B, QWEN_CODER_15B, pypi_model
from pydantic import BaseModel
from test_server import API_KEY, NAMES, Server, _free_port, _run_server

pytestmark = pytest.mark.heavy

MODELS = {"0.5b": QWEN_CODER_05B, "1.5b": QWEN_CODER_15B}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
FLAT_WEATHER = {"type": "function", **WEATHER["function"]}
ASK = "What's the weather in Paris?"
JOHN = "John is 30 years old."


class Person(BaseModel):
    name: str
    age: int


class Weather(BaseModel):
    city: str
    summary: str


def weather_of(city: str) -> str:
    return f"Sunny, 23 degrees Celsius in {city}"


@pytest.fixture(scope="module", params=os.environ.get("KILN_AGENTS_MODELS", "0.5b").split(","))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Server, Path]]:
    """One `kiln serve` of the model for the whole module, and its request-dump folder."""
    tmp = tmp_path_factory.mktemp("agents")
    port = _free_port()
    dumps = tmp / "dumps"
    cmd = [sys.executable, "-m", "kiln", "serve", str(pypi_model(MODELS[request.param])),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", ",".join(NAMES),
           "--api-key", API_KEY, "--device", "cpu", "--no-compile", "--max-model-len", "4096",
           "--kv-cache-memory", "256MiB", "--request-dump-dir", str(dumps),
           "--effective-config-json", str(tmp / f"effective-{port}.json")]
    for server in _run_server(tmp, port, cmd):
        yield server, dumps


@pytest.fixture(scope="module")
def server(served: tuple[Server, Path]) -> Server:
    return served[0]


@pytest.fixture(scope="module")
def base_url(server: Server) -> str:
    return f"{server.base_url}/v1"


def _dump_of(dumps: Path, request_id: str) -> dict[str, Any]:
    (path,) = dumps.glob(f"*{request_id}*.json")
    return json.loads(path.read_text())


# --------------------------------------------------------------------------- the openai SDK


def test_chat_completions_parse(server: Server) -> None:
    r = server.client().chat.completions.parse(
        model=NAMES[0], messages=[{"role": "user", "content": JOHN}], response_format=Person,
        temperature=0, max_tokens=64)
    assert r.choices[0].message.parsed == Person(name="John", age=30)


def test_responses_parse(server: Server) -> None:
    r = server.client().responses.parse(model=NAMES[0], input=JOHN, text_format=Person,
                                        temperature=0, max_output_tokens=64)
    assert r.output_parsed == Person(name="John", age=30)


def test_responses_stream_with_a_tool_sends_the_call_as_arguments_events(server: Server) -> None:
    """OpenAI's stream for a call: the function_call item added, its arguments as
    function_call_arguments deltas then .done, the item done, the response completed; no
    output_text event spells the call. The non-streamed response has the same items."""
    client = server.client()
    kw = {"model": NAMES[0], "input": ASK, "tools": [FLAT_WEATHER], "temperature": 0,
          "max_output_tokens": 64}
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert types[-4:] == ["response.function_call_arguments.delta",
                          "response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    assert not [e for e in events if e.type.startswith("response.output_text")]
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments == events[-3].arguments
    whole = client.responses.create(**kw)
    assert [(o.type, o.name, o.arguments) for o in whole.output] == [
        (o.type, o.name, o.arguments) for o in final.output]


def test_chat_and_responses_render_the_same_token_ids(served: tuple[Server, Path]) -> None:
    """One conversation (instructions, a call the model made, its output, tools given in
    another key order) through both endpoints: the same prompt token ids and the same sampling
    (special tokens kept for the tool parser), for tool_choice auto and a named function (the
    same grammar)."""
    server, dumps = served
    client = server.client()
    args = '{"city": "Paris"}'
    scrambled = {"type": "function", "function": {
        "parameters": WEATHER["function"]["parameters"], "name": "get_weather",
        "description": WEATHER["function"]["description"]}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": weather_of("Paris")},
                {"role": "user", "content": "And in Oslo?"}]
    items = [{"role": "user", "content": ASK},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": args},
             {"type": "function_call_output", "call_id": "call_1", "output": weather_of("Paris")},
             {"role": "user", "content": "And in Oslo?"}]
    for chat_choice, resp_choice in ((None, None), (
            {"type": "function", "function": {"name": "get_weather"}},
            {"type": "function", "name": "get_weather"})):
        extra = {"tool_choice": chat_choice} if chat_choice else {}
        chat = client.chat.completions.create(model=NAMES[0], messages=messages,
                                              tools=[scrambled], temperature=0, max_tokens=48,
                                              **extra)
        extra = {"tool_choice": resp_choice} if resp_choice else {}
        resp = client.responses.create(model=NAMES[0], instructions="Be brief.", input=items,
                                       tools=[FLAT_WEATHER], temperature=0,
                                       max_output_tokens=48, **extra)
        a, b = (_dump_of(dumps, chat.id)["choices"][0], _dump_of(dumps, resp.id)["choices"][0])
        assert a["prompt_token_ids"] == b["prompt_token_ids"]
        assert a["sampling_params"] == b["sampling_params"]
        assert a["sampling_params"]["skip_special_tokens"] is False  # <tool_call> stays
        assert (a["sampling_params"]["structured_outputs"] is None) == (chat_choice is None)
        # The same prompt and sampling, so the same answer out of both.
        assert a["text"] == b["text"]
        assert [(o.name, o.arguments) for o in resp.output if o.type == "function_call"] == [
            (c.function.name, c.function.arguments)
            for c in chat.choices[0].message.tool_calls or []]


def test_named_tool_choice_is_constrained_to_the_models_call_format(server: Server) -> None:
    """instructor's and langchain's way to get a structured answer: a tool named after the
    schema, forced. Constrained to the model's own wrapper and then the arguments, the schema's
    `name` field gets the person's name, not the function's; one call only."""
    tool = {"type": "function", "function": {"name": "Person", "description": "A person",
                                             "parameters": Person.model_json_schema()}}
    client = server.client()
    r = client.chat.completions.create(
        model=NAMES[0], messages=[{"role": "user", "content": JOHN}], tools=[tool],
        tool_choice={"type": "function", "function": {"name": "Person"}}, temperature=0,
        max_tokens=64)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "Person" and r.choices[0].finish_reason == "tool_calls"
    assert json.loads(call.function.arguments) == {"name": "John", "age": 30}
    one = client.chat.completions.create(
        model=NAMES[0], messages=[{"role": "user", "content": "Tell me a joke."}],
        tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, temperature=0,
        max_tokens=64)
    (call,) = one.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)


# --------------------------------------------------------------------------- openai-agents


@pytest.mark.parametrize("api", ["responses", "chat"])
@pytest.mark.parametrize("streamed", [False, True])
def test_openai_agents_runner_with_a_function_tool(base_url: str, api: str,
                                                   streamed: bool) -> None:
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return weather_of(city)

    async def run() -> tuple[Any, str]:
        client = AsyncOpenAI(base_url=base_url, api_key=API_KEY)  # on this run's event loop
        model = (agents.OpenAIResponsesModel(NAMES[0], client) if api == "responses"
                 else agents.OpenAIChatCompletionsModel(NAMES[0], client))
        agent = agents.Agent(name="weather", instructions="Use the tools to answer.",
                             tools=[get_weather], model=model,
                             model_settings=agents.ModelSettings(temperature=0, max_tokens=128),
                             tool_use_behavior="stop_on_first_tool")
        if not streamed:
            return await agents.Runner.run(agent, ASK), ""
        result = agents.Runner.run_streamed(agent, ASK)
        text = ""
        async for ev in result.stream_events():
            if ev.type == "raw_response_event" and ev.data.type == "response.output_text.delta":
                text += ev.data.delta
        return result, text

    result, streamed_text = asyncio.run(run())
    assert calls == ["Paris"]
    assert result.final_output == weather_of("Paris")
    assert streamed_text == ""  # the call never shows as the assistant's words


# --------------------------------------------------------------------------- langchain


@pytest.fixture(scope="module")
def langchain_llm(base_url: str) -> Any:
    lc = pytest.importorskip("langchain_openai")
    return lambda **kw: lc.ChatOpenAI(model=NAMES[0], base_url=base_url, api_key=API_KEY,
                                      temperature=0, max_tokens=128, **kw)


def _lc_weather_tool() -> Any:
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return weather_of(city)

    return get_weather


def test_langchain_bind_tools(langchain_llm: Any) -> None:
    m = langchain_llm().bind_tools([_lc_weather_tool()]).invoke(ASK)
    assert [(c["name"], c["args"]) for c in m.tool_calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(langchain_llm: Any, method: str) -> None:
    assert langchain_llm().with_structured_output(Person, method=method).invoke(JOHN) == \
        Person(name="John", age=30)


@pytest.mark.parametrize("responses_api", [False, True])
def test_langchain_streams_a_tool_call(langchain_llm: Any, responses_api: bool) -> None:
    chunks = list(langchain_llm(use_responses_api=responses_api)
                  .bind_tools([_lc_weather_tool()]).stream(ASK))
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [("get_weather", {"city": "Paris"})]
    text = full.content if isinstance(full.content, str) else "".join(
        p.get("text", "") for p in full.content if p.get("type") == "text")
    assert "get_weather" not in text


# --------------------------------------------------------------------------- instructor


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA", "JSON"])
def test_instructor_modes(server: Server, mode: str) -> None:
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(server.client(), mode=getattr(instructor.Mode, mode))
    p = client.chat.completions.create(model=NAMES[0], response_model=Person, max_retries=0,
                                       temperature=0, max_tokens=128,
                                       messages=[{"role": "user", "content": JOHN}])
    assert p.model_dump() == {"name": "John", "age": 30}


# --------------------------------------------------------------------------- pydantic-ai


@pytest.fixture(scope="module")
def pai_models(base_url: str) -> dict[str, Any]:
    pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=base_url, api_key=API_KEY)
    return {"chat": OpenAIChatModel(NAMES[0], provider=provider),
            "responses": OpenAIResponsesModel(NAMES[0], provider=provider)}


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_pydantic_ai_structured_output(pai_models: dict[str, Any], api: str) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.settings import ModelSettings

    agent = Agent(pai_models[api], output_type=Person,
                  model_settings=ModelSettings(temperature=0, max_tokens=128))
    assert agent.run_sync(JOHN).output == Person(name="John", age=30)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_pydantic_ai_tool_then_structured_output(pai_models: dict[str, Any], api: str) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.settings import ModelSettings

    # One call a turn: the summary is written after the tool's result is in (the 1.5B, allowed
    # parallel calls, writes final_result beside get_weather, before the result exists).
    agent = Agent(pai_models[api], output_type=Weather,
                  model_settings=ModelSettings(temperature=0, max_tokens=128,
                                               parallel_tool_calls=False))
    seen: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return weather_of(city)

    out = agent.run_sync(ASK).output
    assert seen == ["Paris"]
    assert out.city == "Paris" and "23" in out.summary
