"""Speech-to-text: a Whisper model in CTranslate2's format, run by faster-whisper.

    uploaded bytes --PyAV (faster_whisper.decode_audio): any container / codec ffmpeg reads,
      mono 16 kHz float32--> WhisperModel.transcribe (CTranslate2: encoder once per 30 s window,
      greedy decoder with temperature fallback) --> segments, one at a time (streamed as they come)

Why CTranslate2 and not kiln's engine: Whisper is an encoder-decoder with cross-attention over
30-second windows, timestamps as tokens and its own fallback rules; none of it is what the paged
KV engine schedules. The Whisper models shipped for offline use (faster-whisper's, and the one the
tests use) are CTranslate2 conversions already, and CTranslate2's int8 CPU path is its fast one
(README: the real-time factor measured). Audio is decoded by PyAV (ffmpeg's decoders), never by
hand.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError, KilnError
from kiln.kinds import import_audio

log = logging.getLogger("kiln.transcription")

RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")


class AudioDecodeError(KilnError):
    """The upload is not audio PyAV can decode (a 400 naming `file`)."""


@dataclass
class Transcriber:
    model: Any  # faster_whisper.WhisperModel
    compute_type: str
    compute_reason: str
    multilingual: bool
    description: str


@dataclass(frozen=True)
class TranscribeOptions:
    task: str = "transcribe"  # or "translate" (to English; multilingual models only)
    language: str | None = None
    prompt: str | None = None
    temperature: float | None = None  # None / 0: Whisper's fallback ladder 0.0, 0.2, ... 1.0
    word_timestamps: bool = False


def compute_type(device: str, quantization: str, dtype: str) -> tuple[str, str]:
    """CTranslate2's compute type from kiln's settings, with the reason: --quantization int8 or
    auto -> int8 weights (on CPU CTranslate2's fastest path; int8_float16 on CUDA); none -> the
    --dtype (auto: float32 on CPU, float16 on CUDA)."""
    cuda = device.startswith("cuda")
    if quantization == "int4":
        raise ConfigError("--quantization int4: CTranslate2 runs Whisper in int8, float16 or "
                          "float32", hint="pass --quantization int8 (the default) or none")
    if quantization in ("auto", "int8"):
        why = "asked" if quantization == "int8" else "auto"
        if cuda:
            return "int8_float16", f"{why}: int8 weights, float16 compute on CUDA"
        return "int8", (f"{why}: int8 weights and compute, CTranslate2's fast CPU path "
                        "(the weights are stored float16)")
    if dtype == "auto":
        return ("float16", "--quantization none on CUDA") if cuda else \
            ("float32", "--quantization none on CPU")
    return dtype, f"--quantization none, --dtype {dtype}"


def build_transcriber(folder: Path, *, device: str, quantization: str, dtype: str,
                      num_threads: int | None) -> Transcriber:
    fw = import_audio("faster_whisper")
    ctype, reason = compute_type(device, quantization, dtype)
    dev, _, index = device.partition(":")
    model = fw.WhisperModel(str(folder), device=dev, device_index=int(index or 0),
                            compute_type=ctype, cpu_threads=num_threads or 0)
    multilingual = bool(model.model.is_multilingual)
    desc = (f"Whisper ({'multilingual' if multilingual else 'English-only'}), CTranslate2 "
            f"{ctype}")
    return Transcriber(model, ctype, reason, multilingual, desc)


def language_codes() -> tuple[str, ...]:
    """The languages Whisper knows (ISO 639-1 and a few others), as faster-whisper lists them."""
    return tuple(import_audio("faster_whisper.tokenizer")._LANGUAGE_CODES)


def transcribe(t: Transcriber, audio: bytes, opts: TranscribeOptions) -> Iterator[Any]:
    """Runs on the model thread: first the TranscriptionInfo (language, duration), then each
    faster_whisper Segment as the decoder finishes it."""
    fw = import_audio("faster_whisper")
    try:
        samples = fw.decode_audio(io.BytesIO(audio))
    except Exception as e:  # PyAV's errors (InvalidDataError, ...) for what is not audio
        raise AudioDecodeError(f"could not decode the uploaded file as audio: "
                               f"{type(e).__name__}: {e}") from e
    if samples.size == 0:
        raise AudioDecodeError("the uploaded audio has no samples")
    temps: Any = [opts.temperature] if opts.temperature else \
        [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    # Greedy (beam 1): OpenAI's whisper default, and several times faster than beam 5 on CPU.
    segments, info = t.model.transcribe(
        samples, task=opts.task, language=opts.language, initial_prompt=opts.prompt or None,
        temperature=temps, beam_size=1, best_of=1, word_timestamps=opts.word_timestamps,
        vad_filter=False, condition_on_previous_text=True)
    yield info
    yield from segments


# --------------------------------------------------------------------------- output formats


def _stamp(seconds: float, sep: str) -> str:
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def to_srt(segments: list[Any]) -> str:
    """SubRip: numbered cues, `HH:MM:SS,mmm --> HH:MM:SS,mmm`, a blank line between."""
    return "".join(f"{i}\n{_stamp(s.start, ',')} --> {_stamp(s.end, ',')}\n{s.text.strip()}\n\n"
                   for i, s in enumerate(segments, start=1))


def to_vtt(segments: list[Any]) -> str:
    """WebVTT: the WEBVTT header, then cues with `HH:MM:SS.mmm`."""
    return "WEBVTT\n\n" + "".join(
        f"{_stamp(s.start, '.')} --> {_stamp(s.end, '.')}\n{s.text.strip()}\n\n"
        for s in segments)


def joined_text(segments: list[Any]) -> str:
    return "".join(s.text for s in segments).strip()
