"""Tool-call and reasoning parsers without a model: each format whole and streamed, split at
every character boundary (the streamed deltas, assembled, must equal the whole answer)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from pydantic import ValidationError

from kiln.sampling_params import StructuredOutputsParams
from kiln.server import reasoning_parsers, tool_parsers
from kiln.server.chat_output import ChatFormat, ChoiceParser, plan_tools, required_schema
from kiln.server.protocol import ChatCompletionRequest, DeltaMessage, DeltaToolCall
from kiln.server.reasoning_parsers import DeepSeekR1Parser, Qwen3Parser
from kiln.server.tool_call_stream import ToolCallStream
from kiln.server.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
    RequiredParser,
    ToolParser,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def grammars(smollm2_tokenizer: Any) -> Any:
    from kiln.engine.structured import StructuredOutputs

    return StructuredOutputs(smollm2_tokenizer, 49152)


def whole(parser: ToolParser, text: str) -> tuple[str, list[tuple[str, str]]]:
    p = parser.parse(text, final=True)
    return p.content, [(c.name, c.arguments) for c in p.calls]


def assemble(stream: ToolCallStream, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Feed the pieces as a server would, assemble the deltas the way a client does."""
    content, calls, text = "", {}, ""
    for n, piece in enumerate(pieces):
        text += piece
        c, deltas = stream.update(text, final=n == len(pieces) - 1)
        content += c
        for d in deltas:
            if "id" in d:  # a call's first delta: id, type, name, then only argument pieces
                assert d["index"] not in calls and d["type"] == "function"
                assert re.fullmatch(r"call_[0-9a-f]{24}", d["id"])
                calls[d["index"]] = [d["function"]["name"], ""]
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]][1] += d["function"].get("arguments", "")
    return content, [tuple(calls[i]) for i in sorted(calls)]  # type: ignore[misc]


def check_every_split(make: Any, text: str) -> tuple[str, list[tuple[str, str]]]:
    """The whole parse, checked against streams split at every boundary (one character per
    step, and two pieces cut at each position)."""
    expected = whole(make(), text)
    assert assemble(ToolCallStream(make()), list(text)) == expected, "one char per step"
    for cut in range(len(text) + 1):
        assert assemble(ToolCallStream(make()), [text[:cut], text[cut:]]) == expected, cut
    return expected


def hermes() -> HermesParser:
    return HermesParser(["get_weather", "get_time"])


# --------------------------------------------------------------------------- hermes / Qwen


def test_hermes_tagged_calls_with_content_before() -> None:
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
            "</tool_call>")
    assert check_every_split(hermes, text) == (
        "Let me look.", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')])


def test_hermes_arguments_are_the_raw_json_even_with_braces_and_tags_in_strings() -> None:
    args = '{"q": "a } b { \\" </tool_call> ]", "n": [1, {"x": null}], "u": "Zürich 🌧"}'
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
    content, calls = check_every_split(hermes, text)
    assert content == "" and calls == [("get_weather", args)]
    assert json.loads(calls[0][1])["u"] == "Zürich 🌧"


def test_hermes_bare_and_fenced_calls_naming_an_offered_tool() -> None:
    # Qwen2.5-Coder-0.5B writes its calls without the tags (measured: greedy, kiln serve).
    bare = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert check_every_split(hermes, bare) == ("", [("get_weather", '{"city": "Paris"}')])
    fenced = f"```json\n{bare}\n```"
    assert check_every_split(hermes, fenced) == ("", [("get_weather", '{"city": "Paris"}')])
    two = f'{bare}\n{{"name": "get_time", "parameters": {{}}}}'
    assert check_every_split(hermes, two)[1] == [("get_weather", '{"city": "Paris"}'),
                                                 ("get_time", "{}")]
    # Qwen2.5-Coder-1.5B under "Use the tools to answer." (measured: greedy, kiln serve).
    doubled = "{" + bare + "}"
    assert check_every_split(hermes, doubled) == ("", [("get_weather", '{"city": "Paris"}')])
    assert check_every_split(hermes, doubled[:-1] + " Done.") == (
        "Done.", [("get_weather", '{"city": "Paris"}')])
    assert check_every_split(hermes, '{{"answer": 42}}') == ('{{"answer": 42}}', [])


def test_hermes_text_that_only_looks_like_a_call_stays_content() -> None:
    for text in ('{"name": "rm_rf", "arguments": {}}',  # not an offered tool
                 '{"answer": 42}', "```python\nprint(1)\n```", "a <tool_x> b < c",
                 "<tool_call>not json</tool_call>", "   Paris is sunny.  "):
        content, calls = check_every_split(hermes, text)
        assert calls == [] and content == text.strip(), text
    # Without tools offered, a bare object is never a call.
    assert HermesParser([]).parse('{"name": "f", "arguments": {}}', True).calls == []


def test_hermes_call_cut_by_max_tokens_keeps_what_was_written() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    assert check_every_split(hermes, text) == ("", [("get_weather", '{"city": "Par')])


def test_hermes_arguments_given_as_a_json_string() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
    assert check_every_split(hermes, text) == ("", [("get_time", '{"tz": "UTC"}')])


# --------------------------------------------------------------------------- llama3_json, mistral


def test_llama3_json_calls_joined_by_semicolons() -> None:
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
            '{"name": "get_time", "parameters": {"tz": "CET"}}')
    assert check_every_split(Llama3JsonParser, text) == (
        "", [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"tz": "CET"}')])
    assert check_every_split(Llama3JsonParser, "It is sunny.") == ("It is sunny.", [])
    assert check_every_split(Llama3JsonParser, '{"city": "Oslo"}') == ('{"city": "Oslo"}', [])


def test_mistral_tool_calls_array() -> None:
    text = ('Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, '
            '{"name": "get_time", "arguments": {}}]')
    assert check_every_split(MistralParser, text) == (
        "Sure.", [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")])
    assert check_every_split(MistralParser, "No calls [TOOL here].") == ("No calls [TOOL here].",
                                                                       [])


# --------------------------------------------------------------------------- required / named


def test_required_reads_the_constrained_array_and_named_the_arguments() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Lima"}}]'
    assert check_every_split(lambda: RequiredParser(["get_weather"], hermes()), text) == (
        "", [("get_weather", '{"city": "Lima"}')])
    # Unconstrained output (no grammar engine) that is not an array: the server's parser reads it.
    bare = '{"name": "get_weather", "arguments": {"city": "Lima"}}'
    assert whole(RequiredParser(["get_weather"], hermes()), bare)[1] == [
        ("get_weather", '{"city": "Lima"}')]
    assert check_every_split(lambda: NamedParser("get_time"), ' {"tz": "UTC"}\n') == (
        "", [("get_time", '{"tz": "UTC"}')])


def test_required_schema_is_vllms_array_of_name_and_parameters() -> None:
    defs_tool = {"type": "function", "function": {"name": "geo", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}},
        "$defs": {"Point": {"type": "object"}}}}}
    schema = required_schema([WEATHER, defs_tool], parallel=False)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    first = schema["items"]["anyOf"][0]
    assert first["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert first["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert first["required"] == ["name", "parameters"]
    # $defs move to the top, where "#/$defs/Point" points; the tool itself is not changed.
    assert schema["$defs"] == {"Point": {"type": "object"}}
    assert "$defs" not in schema["items"]["anyOf"][1]["properties"]["parameters"]
    assert "$defs" in defs_tool["function"]["parameters"]
    assert "maxItems" not in required_schema([WEATHER], parallel=True)


def test_plan_tools_per_tool_choice() -> None:
    fmt = ChatFormat(tool_parser="hermes")
    assert plan_tools(None, None, None, fmt).parser is None
    assert plan_tools([WEATHER], "none", None, fmt).parser is None
    auto = plan_tools([WEATHER], None, None, fmt)
    assert isinstance(auto.parser, HermesParser) and auto.structured is None
    assert plan_tools([WEATHER], "auto", None, ChatFormat()).parser is None  # no parser set
    assert plan_tools([WEATHER], "auto", None, ChatFormat("hermes", auto_tool_choice=False)
                      ).parser is None
    # With a server parser: its own call format, as a grammar, read by that parser.
    req = plan_tools([WEATHER, TIME], "required", False, fmt)
    assert isinstance(req.parser, HermesParser) and req.max_calls == 1
    assert req.structured == StructuredOutputsParams(
        grammar=HermesParser().call_grammar([("get_weather", WEATHER["function"]["parameters"]),
                                             ("get_time", TIME["function"]["parameters"])], 1))
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}},
                       None, fmt)
    assert isinstance(named.parser, HermesParser) and named.max_calls == 1
    assert named.parser.tool_names == {"get_time"}
    assert '"const": "get_time"' in named.structured.grammar
    assert "get_weather" not in named.structured.grammar
    # Without one: vLLM's JSON shapes.
    req = plan_tools([WEATHER, TIME], "required", False, ChatFormat())
    assert isinstance(req.parser, RequiredParser) and req.max_calls == 1
    assert req.structured == StructuredOutputsParams(json=required_schema([WEATHER, TIME],
                                                                          parallel=False))
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}},
                       None, ChatFormat())
    assert isinstance(named.parser, NamedParser) and named.parser.function == "get_time"
    assert named.structured == StructuredOutputsParams(json=TIME["function"]["parameters"])


def _accepts(grammars: Any, grammar: str, text: str) -> bool:
    """Whether the compiled `grammar` takes `text`, tokenized, to an accepting end."""
    m = grammars.compile(StructuredOutputsParams(grammar=grammar)).deep_copy()
    ids = grammars.tokenizer.encode(text, add_special_tokens=False)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


PERSON = ("Person", {"type": "object", "properties": {"name": {"type": "string"},
                                                      "age": {"type": "integer"}},
                     "required": ["name", "age"]})
GEO = ("geo", {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
               "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}},
                               "required": ["x"]}}})


@pytest.mark.parametrize(("parser", "one", "two", "bare"), [
    (HermesParser(),
     '<tool_call>\n{"name": "Person", "arguments": {"name": "John", "age": 30}}\n</tool_call>',
     ('<tool_call>\n{"name": "Person", "arguments": {"name": "Al", "age": 3}}\n</tool_call>\n'
     '<tool_call>\n{"name": "geo", "arguments": {"p": {"x": 1}}}\n</tool_call>'),
     '{"name": "John", "age": 30}'),
    (Llama3JsonParser(),
     '{"name": "Person", "parameters": {"name": "John", "age": 30}}',
     ('{"name": "Person", "parameters": {"name": "Al", "age": 3}}; '
     '{"name": "geo", "parameters": {"p": {"x": 1}}}'),
     '{"name": "John", "age": 30}'),
    (MistralParser(),
     '[TOOL_CALLS][{"name": "Person", "arguments": {"name": "John", "age": 30}}]',
     ('[TOOL_CALLS][{"name": "Person", "arguments": {"name": "Al", "age": 3}}, '
     '{"name": "geo", "arguments": {"p": {"x": 1}}}]'),
     '[TOOL_CALLS]{"name": "John", "age": 30}'),
])
def test_call_grammar_is_the_parsers_own_format(grammars: Any, parser: ToolParser, one: str,
                                                two: str, bare: str) -> None:
    """The constrained tool_choice (issue 44): the grammar takes the calls written in the
    format the parser reads (wrapper + each function's arguments schema, its $defs where its
    references point), one or several as max_calls says; not bare arguments (where a field
    called "name" would get the function's name), not a wrong argument type. What it takes, the
    parser reads back."""
    both = parser.call_grammar([PERSON, GEO], None)
    only = parser.call_grammar([PERSON], 1)
    assert both is not None and only is not None
    assert _accepts(grammars, only, one) and _accepts(grammars, both, one)
    assert _accepts(grammars, both, two) and not _accepts(grammars, only, two)
    assert not _accepts(grammars, only, bare)
    assert not _accepts(grammars, only, one.replace("30", '"30"'))
    assert whole(type(parser)(), two)[1] == [("Person", '{"name": "Al", "age": 3}'),
                                            ("geo", '{"p": {"x": 1}}')]


def test_call_grammar_names_a_special_marker_by_its_id(grammars: Any) -> None:
    """A marker that is one special token (Mistral's [TOOL_CALLS]) is the token in the grammar:
    special tokens are never matched as text. Here SmolLM2's <|im_start|> stands in for it."""
    tok = grammars.tokenizer
    (tid,) = tok.encode("<|im_start|>", add_special_tokens=False)
    assert tid in tok.all_special_ids
    grammar = MistralParser().call_grammar([PERSON], 1, lambda text: tid)
    assert grammar.startswith(f"start: <[{tid}]>")
    assert _accepts(grammars, grammar,
                    '<|im_start|>[{"name": "Person", "arguments": {"name": "J", "age": 1}}]')


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = ('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    _, calls = assemble(ToolCallStream(hermes(), max_calls=1), list(text))
    assert calls == [("get_weather", "{}")]


def test_stream_deltas_serialize_like_openais() -> None:
    stream = ToolCallStream(hermes())
    _, first = stream.update('<tool_call>{"name": "get_time", "arguments": {"tz', False)
    _, later = stream.update('<tool_call>{"name": "get_time", "arguments": {"tz": 1}}', True)
    d1 = DeltaMessage(tool_calls=[DeltaToolCall.model_validate(d) for d in first]).model_dump()
    assert d1 == {"tool_calls": [{"index": 0, "id": stream.sent[0].id, "type": "function",
                                  "function": {"name": "get_time", "arguments": '{"tz'}}]}
    d2 = DeltaMessage(tool_calls=[DeltaToolCall.model_validate(d) for d in later]).model_dump()
    assert d2 == {"tool_calls": [{"index": 0, "function": {"arguments": '": 1}'}}]}
    assert stream.tool_calls() == [{"id": stream.sent[0].id, "type": "function", "function": {
        "name": "get_time", "arguments": '{"tz": 1}'}}]


def test_auto_parser_from_the_chat_template() -> None:
    assert tool_parsers.choose_for_template("... <tool_call>\\n{...} ...")[0] == "hermes"
    assert tool_parsers.choose_for_template("[AVAILABLE_TOOLS] [TOOL_CALLS]")[0] == "mistral"
    assert tool_parsers.choose_for_template("<|python_tag|>{{ x }}")[0] == "llama3_json"
    assert tool_parsers.choose_for_template("{{ messages }}")[0] == "none"
    assert tool_parsers.choose_for_template(None)[0] == "none"
    assert reasoning_parsers.choose_for_template("<think>\\n\\n</think>")[0] == "qwen3"
    assert reasoning_parsers.choose_for_template(
        "<｜Assistant｜>{{ c.split('</think>')[-1] }}")[0] == "deepseek_r1"
    assert reasoning_parsers.choose_for_template("{{ messages }}")[0] == "none"


# --------------------------------------------------------------------------- protocol


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def refused(**kw: Any) -> tuple[str, str]:
    """(param, code) of a chat request the protocol refuses."""
    with pytest.raises(ValidationError) as e:
        chat(**kw)
    err = e.value.errors()[0]
    return str(err["loc"][0]), err["type"]


@pytest.mark.parametrize(("choice", "code"), [
    ("always", "invalid_tool_choice"),
    ({"type": "function", "function": {"name": "nope"}}, "unknown_tool"),
    ({"type": "function"}, "invalid_tool_choice"), ({"name": "get_weather"}, "invalid_tool_choice")])
def test_bad_tool_choice_is_refused(choice: Any, code: str) -> None:
    assert refused(tools=[WEATHER], tool_choice=choice) == ("tool_choice", code)


def test_tool_choice_needs_tools_and_tools_must_be_functions() -> None:
    assert refused(tool_choice="required") == ("tool_choice", "invalid_tool_choice")
    no_name = {"type": "function", "function": {"description": "no name"}}
    assert refused(tools=[no_name]) == ("tools", "invalid_tool")
    no_schema = {"type": "function", "function": {"name": "f", "parameters": "x"}}
    assert refused(tools=[no_schema]) == ("tools", "invalid_tool")
    assert chat(tool_choice="none").tool_choice == "none"


def test_earlier_tool_calls_reach_the_template_with_object_arguments() -> None:
    req = ChatCompletionRequest(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "17 C"}])
    msgs = req.template_messages()
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert msgs[1]["content"] is None and msgs[2]["tool_call_id"] == "call_1"


# --------------------------------------------------------------------------- reasoning


def split_every(parser_factory: Any, text: str) -> tuple[str, str]:
    full = parser_factory().parse(text, True)
    expected = (full.reasoning, full.content)
    for cut in [*range(len(text) + 1)]:
        for pieces in ([text[:cut], text[cut:]], list(text)):
            p = ChoiceParser(parser_factory(), None)
            got_r = got_c = ""
            for n, piece in enumerate(pieces):
                d = p.feed(piece, final=n == len(pieces) - 1)
                got_r, got_c = got_r + d.reasoning, got_c + d.content
            assert (got_r, got_c) == expected, (cut, pieces[:3])
            assert (p.result.reasoning, p.result.content) == expected
    return expected


def test_qwen3_reasoning_opened_by_the_model() -> None:
    text = "<think>\nThe user greets me.\n</think>\n\nHello!"
    assert split_every(Qwen3Parser, text) == ("The user greets me.", "Hello!")
    assert split_every(Qwen3Parser, "Hello <think> there") == ("", "Hello <think> there")
    assert split_every(Qwen3Parser, "  just text\n") == ("", "  just text\n")


def test_reasoning_opened_by_the_prompt_and_closed_by_it() -> None:
    # DeepSeek-R1's template (and Qwen3's with thinking) ends the prompt inside <think>.
    assert split_every(lambda: Qwen3Parser("<|im_start|>assistant\n<think>\n"),
                       "Hmm, 2+2.\n</think>\n\n4") == ("Hmm, 2+2.", "4")
    # enable_thinking=False renders an empty <think></think>: nothing to split.
    assert split_every(lambda: Qwen3Parser("assistant\n<think>\n\n</think>\n\n"),
                       "4 </think>") == ("", "4 </think>")
    # DeepSeek-R1: the output starts inside the reasoning even when the prompt did not open it.
    assert split_every(DeepSeekR1Parser, "2+2 is 4</think>4") == ("2+2 is 4", "4")
    assert split_every(DeepSeekR1Parser, "<think>a</think>b") == ("a", "b")
    # Cut by max_tokens inside the reasoning: it stays reasoning.
    assert split_every(DeepSeekR1Parser, "still thinking </thi") == ("still thinking </thi", "")


def test_reasoning_then_a_tool_call() -> None:
    text = ('<think>I need the weather.</think>\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Oslo"}}\n</tool_call>')
    p = ChoiceParser(Qwen3Parser(), ToolCallStream(hermes()))
    for n in range(1, len(text) + 1):
        p.feed(text[n - 1], final=n == len(text))
    assert p.result.reasoning == "I need the weather." and p.result.content == ""
    assert [c["function"] for c in p.result.tool_calls] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert p.called


# --------------------------------------------------------------------------- Responses items


def _items(parser: ChoiceParser, pieces: list[str], emit: bool) -> tuple[list[dict], list[dict]]:
    """The Responses output items of `pieces` fed in turn, without their ids, and the events."""
    from kiln.server.routes.responses import OutputItems

    events: list[dict] = []
    out = OutputItems(parser, (lambda type_, **f: json.dumps({"type": type_, **f}))
                      if emit else None)
    for i, piece in enumerate(pieces):
        events += [json.loads(e) for e in out.feed(piece, i == len(pieces) - 1)]
    strip = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in out.items]
    return strip, events


@pytest.mark.parametrize("text", [
    ("Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}"
    "\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"CET\"}}\n"
    "</tool_call>\nI asked both."),
    "<think>Weather, so the tool.</think>{\"name\": \"get_weather\", \"arguments\": {}}",
    "Just words, no call.",
    "",
])
def test_responses_items_streamed_at_every_split_equal_the_whole(text: str) -> None:
    """Streamed and non-streamed Responses give the same output items (reasoning, the text
    before the calls, one function_call per call, the text after them), whatever the engine
    steps were; the stream's events add them up: arguments only in function_call_arguments
    deltas, never in output_text, and each item done before the next is added."""
    def parser() -> ChoiceParser:
        return ChoiceParser(reasoning_parsers.PARSERS["qwen3"](""),
                            ToolCallStream(HermesParser(["get_weather", "get_time"])))

    want, _ = _items(parser(), [text], emit=False)
    kinds = [i["type"] for i in want]
    if "I asked both" in text:
        assert kinds == ["message", "function_call", "function_call", "message"]
        assert want[0]["content"][0]["text"] == "Let me look."
        assert want[3]["content"][0]["text"] == "I asked both."
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text) if cut == 0 and text else None):
            if pieces is None:
                continue
            got, events = _items(parser(), pieces, emit=True)
            assert got == want, (cut, pieces)
            text_deltas = "".join(e["delta"] for e in events
                                  if e["type"] == "response.output_text.delta")
            assert "get_weather" not in text_deltas
            added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
            done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
            assert added == done == list(range(len(want)))
            order = [(e["type"], e["output_index"]) for e in events
                     if e["type"].startswith("response.output_item")]
            assert order == [(t, i) for i in range(len(want))
                             for t in ("response.output_item.added",
                                       "response.output_item.done")]
            for i, item in enumerate(want):
                if item["type"] == "function_call":
                    args = "".join(e["delta"] for e in events if e.get("output_index") == i and
                                   e["type"] == "response.function_call_arguments.delta")
                    assert args == item["arguments"]
