"""Pydantic models of /v1/audio/transcriptions, /v1/audio/translations (multipart forms) and
/v1/audio/speech (JSON), in OpenAI's shapes, and their responses and stream events."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from kiln.server.protocol import _Request

# OpenAI's cap on /v1/audio/speech's input.
MAX_SPEECH_CHARS = 4096


class TranscriptionForm(_Request):
    """The form fields of POST /v1/audio/transcriptions and /translations besides `file`."""

    model: str | None = None
    language: str | None = None  # ISO 639-1; translations have none (the output is English)
    prompt: str | None = None
    response_format: Literal["json", "text", "srt", "verbose_json", "vtt"] = "json"
    # 0 (or none): Whisper's fallback ladder; above 0: that temperature alone.
    temperature: float | None = Field(default=None, ge=0, le=1)
    timestamp_granularities: list[Literal["segment", "word"]] = Field(default_factory=list)
    stream: bool = False


class TranscriptionWord(BaseModel):
    word: str
    start: float
    end: float


class TranscriptionSegment(BaseModel):
    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


class DurationUsage(BaseModel):
    type: Literal["duration"] = "duration"
    seconds: float


class Transcription(BaseModel):
    """response_format json (text and srt / vtt are plain text)."""

    text: str
    usage: DurationUsage | None = None


class TranscriptionVerbose(BaseModel):
    """response_format verbose_json: the language, the duration, the segments (and words with
    timestamp_granularities[]=word)."""

    task: Literal["transcribe", "translate"]
    language: str
    duration: float
    text: str
    segments: list[TranscriptionSegment] | None = None
    words: list[TranscriptionWord] | None = None
    usage: DurationUsage | None = None


class TranscriptTextDelta(BaseModel):
    """stream=true: each segment's text as it is decoded."""

    type: Literal["transcript.text.delta"] = "transcript.text.delta"
    delta: str


class TranscriptTextDone(BaseModel):
    type: Literal["transcript.text.done"] = "transcript.text.done"
    text: str


class SpeechRequest(_Request):
    """POST /v1/audio/speech."""

    model: str | None = None
    input: str = Field(min_length=1, max_length=MAX_SPEECH_CHARS)
    # A speaker of a multi-speaker voice; a single-speaker voice answers to any name.
    voice: str | None = None
    instructions: str | None = None  # gpt-4o-mini-tts's; a Piper voice takes none (ignored)
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    # None: the whole file at once; "audio": the file's bytes chunked as each sentence is
    # spoken; "sse": speech.audio.delta events (base64 of those bytes), then speech.audio.done.
    stream_format: Literal["audio", "sse"] | None = None


class SpeechAudioDelta(BaseModel):
    type: Literal["speech.audio.delta"] = "speech.audio.delta"
    audio: str  # base64 of the next bytes of the response_format's file


class SpeechUsage(BaseModel):
    input_tokens: int  # characters of input spoken
    output_tokens: int = 0
    total_tokens: int


class SpeechAudioDone(BaseModel):
    type: Literal["speech.audio.done"] = "speech.audio.done"
    usage: SpeechUsage
