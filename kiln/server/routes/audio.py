"""POST /v1/audio/transcriptions, /v1/audio/translations (--kind transcribe) and /v1/audio/speech
(--kind speech): OpenAI's audio API over the model thread (kiln/kinds/worker.py).

    multipart form --file bytes + TranscriptionForm--> transcription job: decode (PyAV), Whisper
      --> info, then segments --> json | text | srt | vtt | verbose_json, or SSE
      transcript.text.delta per segment, then transcript.text.done
    SpeechRequest (JSON) --> speech job: one sentence at a time, encoded on the model thread
      --> the whole file, its bytes chunked (stream_format=audio), or SSE speech.audio.delta

Each job's first item is awaited before any header is sent, so what fails early (audio that does
not decode, text with nothing to speak) is a 400, not a broken stream.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile

from kiln.server.audio_protocol import (
    DurationUsage,
    SpeechAudioDelta,
    SpeechAudioDone,
    SpeechRequest,
    SpeechUsage,
    Transcription,
    TranscriptionForm,
    TranscriptionSegment,
    TranscriptionVerbose,
    TranscriptionWord,
    TranscriptTextDelta,
    TranscriptTextDone,
)
from kiln.server.errors import APIError, engine_error, validation_error
from kiln.server.serving import Serving, data_frame

_FORM_SCHEMA = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file"],
    "properties": {"file": {"type": "string", "format": "binary",
                            "description": "the audio: any format ffmpeg decodes"},
                   **TranscriptionForm.model_json_schema()["properties"]}}}}}}


def _request_error(e: BaseException, param: str) -> BaseException:
    """The HTTP error of a job's failure (its own input's fault: 400; a full queue: 503)."""
    from kiln.kinds.speech import SpeechInputError
    from kiln.kinds.transcription import AudioDecodeError
    from kiln.kinds.worker import AudioOverloadedError

    if isinstance(e, AudioDecodeError | SpeechInputError):
        return APIError(400, e.message, param=param, code="invalid_value")
    if isinstance(e, AudioOverloadedError):
        return APIError(503, e.message, code="overloaded")
    return engine_error(e)


async def _start(sv: Serving, job: Callable[[Any], Iterator[Any]], param: str
                 ) -> tuple[Any, AsyncIterator[Any]]:
    """The job's first item (its errors raised as HTTP errors) and the rest of its items."""
    it = sv.engine.stream(job)  # type: ignore[attr-defined]
    try:
        first = await anext(it)
    except StopAsyncIteration:
        first = None
    except Exception as e:
        await it.aclose()
        raise _request_error(e, param) from e
    return first, it


def _json(model: BaseModel) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json", exclude_none=True))


async def _read_form(request: Request) -> tuple[bytes, TranscriptionForm]:
    ctype = request.headers.get("content-type", "")
    if not ctype.startswith("multipart/form-data"):
        raise APIError(400, "send the audio as multipart/form-data with a `file` field (and "
                       f"the other fields beside it); got Content-Type {ctype or 'none'!r}",
                       param="file", code="invalid_value")
    try:
        form = await request.form()
    except Exception as e:  # python-multipart's parse errors
        raise APIError(400, f"malformed multipart body: {e}", code="invalid_value") from e
    fields: dict[str, Any] = {}
    file = None
    for key, value in form.multi_items():
        if key == "file":
            file = value
            continue
        if isinstance(value, UploadFile):
            raise APIError(400, f"`{key}` must be a plain form field, not a file", param=key,
                           code="invalid_value")
        name = key.removesuffix("[]")  # the openai client sends arrays as key[]
        if name == "timestamp_granularities":
            fields.setdefault(name, []).append(value)
        else:
            fields[name] = value
    if not isinstance(file, UploadFile):
        raise APIError(400, "a `file` field holding the audio (a file upload) is required",
                       param="file", code="invalid_value")
    data = await file.read()
    if not data:
        raise APIError(400, "the uploaded `file` is empty", param="file", code="invalid_value")
    try:
        return data, TranscriptionForm.model_validate(fields)
    except ValidationError as e:
        raise validation_error(RequestValidationError(e.errors())) from None


def router(sv: Serving) -> APIRouter:
    """Under /v1, behind the API key."""
    from kiln.kinds.speech import MEDIA_TYPES, AudioEncoder, SpeechInputError

    r = APIRouter()

    async def transcription(request: Request, task: str) -> Any:
        """/transcriptions and /translations: one handler, `task` says which."""
        data, form = await _read_form(request)
        model = sv.check_model(form.model, kind="transcribe")
        from kiln.kinds.transcription import (
            TranscribeOptions,
            joined_text,
            language_codes,
            to_srt,
            to_vtt,
            transcribe,
        )

        t = sv.engine.wait_built()  # type: ignore[attr-defined]
        if task == "translate" and not t.multilingual:
            raise APIError(400, f"`{model}` is an English-only Whisper model: it cannot "
                           "translate into English from another language. Use "
                           "/v1/audio/transcriptions, or serve a multilingual Whisper model",
                           param="model", code="unsupported_model")
        lang = (form.language or "").strip().lower() or None
        if task == "translate":
            lang = None  # the source language is detected; the output is English
        elif lang is not None and not t.multilingual and lang != "en":
            raise APIError(400, f"language={lang!r}: `{model}` is an English-only Whisper "
                           "model; send language=en or none", param="language",
                           code="invalid_value")
        elif lang is not None and lang not in language_codes():
            raise APIError(400, f"language={lang!r} is not one Whisper knows; send an ISO "
                           "639-1 code such as en, de, fr, zh", param="language",
                           code="invalid_value")
        words = "word" in form.timestamp_granularities
        if words and form.response_format != "verbose_json":
            raise APIError(400, "timestamp_granularities needs response_format=verbose_json",
                           param="timestamp_granularities", code="invalid_value")
        opts = TranscribeOptions(task=task, language=lang, prompt=form.prompt,
                                 temperature=form.temperature, word_timestamps=words)
        info, it = await _start(sv, lambda m: transcribe(m, data, opts), "file")
        if form.stream:
            return StreamingResponse(_transcript_events(it), media_type="text/event-stream")
        try:
            segments = [s async for s in it]
        except Exception as e:
            raise _request_error(e, "file") from e
        text = joined_text(segments)
        fmt = form.response_format
        if fmt == "text":
            return PlainTextResponse(text + "\n")
        if fmt == "srt":
            return PlainTextResponse(to_srt(segments))
        if fmt == "vtt":
            return PlainTextResponse(to_vtt(segments), media_type="text/vtt")
        usage = DurationUsage(seconds=round(info.duration, 3))
        if fmt == "json":
            return _json(Transcription(text=text, usage=usage))
        segs = [TranscriptionSegment(
            id=i, seek=s.seek, start=s.start, end=s.end, text=s.text, tokens=s.tokens,
            temperature=s.temperature or 0.0, avg_logprob=s.avg_logprob,
            compression_ratio=s.compression_ratio, no_speech_prob=s.no_speech_prob)
            for i, s in enumerate(segments)]
        want_segments = not form.timestamp_granularities or \
            "segment" in form.timestamp_granularities
        return _json(TranscriptionVerbose(
            task=task, language=info.language, duration=info.duration, text=text,
            segments=segs if want_segments else None,
            words=[TranscriptionWord(word=w.word, start=w.start, end=w.end)
                   for s in segments for w in s.words or ()] if words else None,
            usage=usage))

    @r.post("/audio/transcriptions", openapi_extra=_FORM_SCHEMA)
    async def transcriptions(request: Request) -> Any:
        return await transcription(request, "transcribe")

    @r.post("/audio/translations", openapi_extra=_FORM_SCHEMA)
    async def translations(request: Request) -> Any:
        return await transcription(request, "translate")

    @r.post("/audio/speech")
    async def speech(req: SpeechRequest) -> Any:
        sv.check_model(req.model, kind="speech")
        from kiln.kinds.speech import speaker_id, synthesize

        voice = sv.engine.wait_built()  # type: ignore[attr-defined]
        try:
            speaker = speaker_id(voice, req.voice or "")
        except SpeechInputError as e:
            raise APIError(400, e.message, param="voice", code="invalid_value") from e
        streamed = req.stream_format is not None

        def job(v: Any) -> Iterator[bytes]:
            """On the model thread: synthesis and encoding; only non-empty byte chunks."""
            enc = AudioEncoder(req.response_format, v.sample_rate, streamed=streamed)
            spoken = False
            for samples in synthesize(v, req.input, speed=req.speed, speaker=speaker):
                spoken = spoken or samples.size > 0
                if chunk := enc.add(samples):
                    yield chunk
            if not spoken:
                raise SpeechInputError("the input has nothing to speak (no words)")
            if tail := enc.close():
                yield tail

        first, it = await _start(sv, job, "input")
        media = MEDIA_TYPES[req.response_format]
        if not streamed:
            try:
                rest = [b async for b in it]
            except Exception as e:
                raise _request_error(e, "input") from e
            return Response(b"".join([first or b"", *rest]), media_type=media)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                if first:
                    yield first
                async for b in it:
                    yield b
            finally:
                await it.aclose()

        if req.stream_format == "audio":
            return StreamingResponse(chunks(), media_type=media)

        async def events() -> AsyncIterator[str]:
            async for b in chunks():
                d = SpeechAudioDelta(audio=base64.b64encode(b).decode("ascii"))
                yield data_frame(d.model_dump_json())
            n = len(req.input)
            yield data_frame(SpeechAudioDone(usage=SpeechUsage(input_tokens=n, total_tokens=n))
                             .model_dump_json())

        return StreamingResponse(events(), media_type="text/event-stream")

    return r


async def _transcript_events(it: AsyncIterator[Any]) -> AsyncIterator[str]:
    """transcript.text.delta per segment (their concatenation is the text), then
    transcript.text.done; a failure mid-stream is an error event, as the chat stream's."""
    parts: list[str] = []
    try:
        async for seg in it:
            delta = seg.text if parts else seg.text.lstrip()
            parts.append(delta)
            yield data_frame(TranscriptTextDelta(delta=delta).model_dump_json())
    except Exception as e:  # noqa: BLE001 - the headers are sent: report it in the stream
        err = _request_error(e, "file")
        body = err.body() if isinstance(err, APIError) else APIError(500, str(e)).body()
        yield data_frame(json.dumps(body))
        return
    finally:
        await it.aclose()
    yield data_frame(TranscriptTextDone(text="".join(parts).strip()).model_dump_json())
