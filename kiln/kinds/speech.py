"""Text-to-speech: a Piper voice (VITS exported to ONNX) run by piper-tts on onnxruntime, the
audio encoded by PyAV.

    text --piper's espeak-ng phonemizer (bundled in the piper-tts wheel), one list of phonemes
      per sentence--> phoneme ids --onnxruntime: one VITS forward per sentence--> float32 samples
      at the voice's rate --AudioEncoder (PyAV: libmp3lame, flac, libopus, aac, pcm_s16le)-->
      the response, whole or one sentence at a time (stream_format)

Why piper-tts and not kiln's engine: a Piper voice is a small ONNX graph with an espeak-ng front
end; piper-tts is the maintained runtime of that format (its phonemizer must match the one the
voice was trained with), and onnxruntime runs the graph on CPU in a fraction of real time. kiln
builds the onnxruntime session itself, so --threads applies.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.kinds import import_audio

log = logging.getLogger("kiln.speech")

# (container, codec, sample rate it must have or None for the voice's own); "pcm" is raw
# 16-bit little-endian mono at 24 kHz, as OpenAI documents it, with no container.
FORMATS: dict[str, tuple[str | None, str, int | None]] = {
    "mp3": ("mp3", "libmp3lame", None),
    "opus": ("ogg", "libopus", 48000),
    "aac": ("adts", "aac", None),
    "flac": ("flac", "flac", None),
    "wav": ("wav", "pcm_s16le", None),
    "pcm": (None, "pcm_s16le", 24000),
}
MEDIA_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac",
               "flac": "audio/flac", "wav": "audio/wav", "pcm": "audio/pcm"}
# OpenAI's voice names: a single-speaker voice answers to any of them (it has one speaker).
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage",
                 "shimmer", "verse", "marin", "cedar")


class SpeechInputError(KilnError):
    """The request's text or voice cannot be spoken (a 400)."""


@dataclass
class Voice:
    piper: Any  # piper.PiperVoice
    sample_rate: int
    speakers: dict[str, int]  # name -> speaker id (empty: one speaker)
    language: str
    description: str


def build_voice(onnx: Path, *, device: str, num_threads: int | None) -> Voice:
    piper = import_audio("piper")
    ort = import_audio("onnxruntime")
    config = json.loads(onnx.with_name(onnx.name + ".json").read_text(encoding="utf-8"))
    opts = ort.SessionOptions()
    if num_threads:
        opts.intra_op_num_threads = num_threads
    providers = (["CUDAExecutionProvider", "CPUExecutionProvider"] if device.startswith("cuda")
                 else ["CPUExecutionProvider"])
    session = ort.InferenceSession(str(onnx), sess_options=opts, providers=providers)
    voice = piper.PiperVoice(session=session, config=piper.PiperConfig.from_dict(config))
    speakers = {str(k): int(v) for k, v in (config.get("speaker_id_map") or {}).items()}
    lang = (config.get("language") or {}).get("code") or config.get("espeak", {}).get("voice", "")
    # One word spoken at load: espeak-ng initializes and onnxruntime warms up now, not during
    # the first request.
    for _ in voice.synthesize("Ready."):
        pass
    desc = (f"Piper voice {onnx.stem} ({lang}, {voice.config.sample_rate} Hz, "
            f"{len(speakers) or 1} speaker{'s' if len(speakers) > 1 else ''}), onnxruntime "
            f"{session.get_providers()[0].removesuffix('ExecutionProvider')}")
    return Voice(voice, voice.config.sample_rate, speakers, lang, desc)


def speaker_id(v: Voice, name: str) -> int | None:
    """The speaker `name` picks: one of a multi-speaker voice's (or any of OpenAI's names, for
    its first speaker); a single-speaker voice answers to every name."""
    if not v.speakers:
        return None
    if name in v.speakers:
        return v.speakers[name]
    if name in OPENAI_VOICES:
        return min(v.speakers.values())
    raise SpeechInputError(f"voice {name!r} is not a speaker of this model; its speakers: "
                           f"{', '.join(sorted(v.speakers))}")


def synthesize(v: Voice, text: str, *, speed: float, speaker: int | None) -> Iterator[Any]:
    """Runs on the model thread: float32 samples in [-1, 1] at `v.sample_rate`, one array per
    sentence. `speed` scales the voice's own length_scale (2.0: twice as fast)."""
    piper = import_audio("piper")
    base = v.piper.config.length_scale or 1.0
    cfg = piper.SynthesisConfig(speaker_id=speaker, length_scale=base / speed)
    for chunk in v.piper.synthesize(text, syn_config=cfg):
        yield chunk.audio_float_array


class _Sink(io.RawIOBase):
    """Where PyAV writes a streamed response: not seekable, so the muxer writes what it can
    up front (a WAV header says 0xFFFFFFFF bytes, as streamed WAV does) and never seeks back."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, b: Any) -> int:
        self.buf += bytes(b)
        return len(b)

    def take(self) -> bytes:
        out = bytes(self.buf)
        self.buf.clear()
        return out


class AudioEncoder:
    """Float32 mono samples in, encoded bytes out, chunk by chunk (`add`, then `close`):
    `streamed` writes to a non-seekable sink so every add returns what is ready; otherwise the
    whole file is returned by `close`, headers complete."""

    def __init__(self, fmt: str, rate: int, *, streamed: bool) -> None:
        self.av = import_audio("av")
        container, codec, out_rate = FORMATS[fmt]
        self.rate, self.streamed = rate, streamed
        self.sink: Any = _Sink() if streamed else io.BytesIO()
        self.out = self.av.open(self.sink, "w", format=container) if container else None
        ctx_rate = out_rate or rate
        if self.out is not None:
            self.stream = self.out.add_stream(codec, rate=ctx_rate, layout="mono")
            fmt_name = self.stream.codec_context.format.name
        else:  # raw pcm: resampled and converted, no codec
            self.stream, fmt_name = None, "s16"
        self.resampler = self.av.AudioResampler(format=fmt_name, layout="mono", rate=ctx_rate)

    def _write(self, frames: list[Any]) -> None:
        for fr in frames:
            if self.stream is None:
                self.sink.write(fr.to_ndarray().astype("<i2").tobytes())
                continue
            for packet in self.stream.encode(fr):
                self.out.mux(packet)

    def add(self, samples: np.ndarray) -> bytes:
        frame = self.av.AudioFrame.from_ndarray(
            np.ascontiguousarray(samples, dtype=np.float32)[None, :], format="flt", layout="mono")
        frame.sample_rate = self.rate
        self._write(self.resampler.resample(frame))
        return self.sink.take() if self.streamed else b""

    def close(self) -> bytes:
        self._write(self.resampler.resample(None))
        if self.out is not None:
            for packet in self.stream.encode(None):
                self.out.mux(packet)
            self.out.close()
        return self.sink.take() if self.streamed else self.sink.getvalue()
