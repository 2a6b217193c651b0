"""Real-time factor of kiln's audio kinds: seconds of compute per second of audio (lower is faster;
0.1 = ten times faster than real time), through the same code the server runs (kiln/kinds/).

    python benchmarks/audio_rtf.py [--rounds 3] [--threads N]

Speech: the Piper voice speaks the test sentences (one request's worth of text). Transcription:
Whisper tiny.en hears that audio back, with CTranslate2's int8 and float32 compute types
alternated in the same run (int8, float32, int8, ...) so machine load drifts hit both alike.
Models: the installed PyPI packages (kiln's registry aliases whisper-tiny.en and piper-joe).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_audio import SENTENCES, wer

from kiln.kinds.speech import AudioEncoder, build_voice, synthesize
from kiln.kinds.transcription import (
    TranscribeOptions,
    build_transcriber,
    joined_text,
    transcribe,
)
from kiln.resolve.sources import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    voice_src = resolve_model("piper-joe", download=False)
    whisper_src = resolve_model("whisper-tiny.en", download=False)
    voice = build_voice(voice_src.files[0], device="cpu", num_threads=args.threads)
    models = {q: build_transcriber(whisper_src.path, device="cpu", quantization=q, dtype="auto",
                                   num_threads=args.threads) for q in ("int8", "none")}
    text = " ".join(SENTENCES)
    rtf: dict[str, list[float]] = {"speech": [], "int8": [], "float32": []}
    errors: dict[str, list[float]] = {"int8": [], "float32": []}
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        enc = AudioEncoder("wav", voice.sample_rate, streamed=False)
        n = 0
        for samples in synthesize(voice, text, speed=1.0, speaker=None):
            n += samples.size
            enc.add(samples)
        wav = enc.close()
        seconds = n / voice.sample_rate
        rtf["speech"].append((time.perf_counter() - t0) / seconds)
        for q, name in (("int8", "int8"), ("none", "float32")):
            t0 = time.perf_counter()
            it = transcribe(models[q], wav, TranscribeOptions())
            next(it)
            heard = joined_text(list(it))
            rtf[name].append((time.perf_counter() - t0) / seconds)
            errors[name].append(wer(text, heard))
    out = {"audio_seconds": round(seconds, 2), "rounds": args.rounds,
           "threads": args.threads or "runtime default",
           "rtf": {k: {"median": round(statistics.median(v), 3),
                       "min": round(min(v), 3), "max": round(max(v), 3)}
                   for k, v in rtf.items()},
           "int8_over_float32": [round(a / b, 3) for a, b in zip(rtf["int8"], rtf["float32"],
                                                                 strict=True)],
           "wer": {k: round(max(v), 3) for k, v in errors.items()}}
    json.dump(out, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
