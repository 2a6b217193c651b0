"""In-process engine benchmark (`kiln bench --offline`): no HTTP, no tokenizer round trips.

  prefill  one prompt of exactly `prefill_len` tokens, max_tokens=1: prompt tokens / seconds
           (median of `repeats` runs, each with a fresh prompt so the prefix cache never hits).
  decode   at each batch size B, B fresh short prompts run twice, to N1 and to N1 + N output
           tokens; decode tok/s = extra tokens / extra seconds. The difference cancels the
           prefill and the per-call overhead, leaving the steady decode rate.

Prompts are token ids, not text: one calibration call tokenizes the benchmark's word list once,
and every prompt is then a random sequence of those word tokens, exact in length without
knowing the model's tokenizer.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kiln.bench.workloads import WORDS, new_salt
from kiln.errors import KilnError

DECODE_PROMPT_LEN = 32
DECODE_BASE_TOKENS = 8  # N1: the short run whose time is subtracted


@dataclass
class DecodeResult:
    batch: int
    tokens_per_seq: int  # N, the extra tokens per sequence between the two runs
    seconds: float  # extra seconds between the two runs
    tok_s: float  # whole batch
    per_seq_tok_s: float
    short_seconds: float = 0.0  # the N1 run
    long_seconds: float = 0.0  # the N1 + N run
    # "difference": (long - short) timing; "whole-call": long run only, prefill included, used
    # when noise (a busy machine) made the long run no slower than the short one.
    method: str = "difference"
    # kiln.bench.roofline.Roofline as a dict (bytes per step, GB/s achieved, fraction of the
    # measured read bandwidth); None where the engine has no CPU runner to count
    roofline: dict[str, Any] | None = None


@dataclass
class OfflineResult:
    model: str
    load_seconds: float
    prefill_tokens: int
    prefill_seconds: list[float]
    prefill_tok_s: float
    decode: list[DecodeResult] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)  # {name: value, source...}
    # MoE models: per MoE layer, the tokens routed to its experts during the benchmark:
    # {"layer", "experts", "tokens", "min", "mean", "max", "imbalance", "idle"}; [] if dense.
    moe_routing: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "kiln-bench-offline", "version": 1, **asdict(self)}


def _timed_generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """(seconds, output tokens) of one generate call; raises if the engine stopped early."""
    from kiln.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != max_tokens * len(prompts):
        raise KilnError(
            f"asked for {max_tokens} tokens x {len(prompts)} prompts, got {produced}",
            hint="ignore_eos must make every sequence run to max_tokens; check the engine",
        )
    return seconds, produced


def _timed_decode(llm: Any, pool: Sequence[int], batch: int, max_tokens: int,
                  rng: random.Random) -> tuple[float, int]:
    """_timed_generate over `batch` new random prompts of DECODE_PROMPT_LEN tokens."""
    return _timed_generate(llm, random_prompts(pool, batch, DECODE_PROMPT_LEN, rng), max_tokens)


def word_token_pool(llm: Any) -> list[int]:
    """Token ids of the benchmark word list, as this model tokenizes it."""
    text = " ".join(WORDS)
    encode = getattr(getattr(llm, "tokenizer", None), "encode", None)
    if callable(encode):
        try:
            ids = list(encode(text, add_special_tokens=False))
        except TypeError:  # an encode without the keyword: drop a leading BOS below
            ids = list(encode(text))
    else:
        from kiln.sampling_params import SamplingParams

        out = llm.generate([text], SamplingParams(temperature=0.0, max_tokens=1))
        ids = list(out[0].prompt_token_ids)
    # A tokenizer that adds BOS puts it first; prompts must be made of word tokens only.
    if len(ids) > len(WORDS):
        ids = ids[1:]
    pool = sorted(set(ids))
    if len(pool) < 64:
        raise KilnError(f"the tokenizer produced only {len(pool)} distinct word tokens")
    return pool


def random_prompts(pool: Sequence[int], n: int, length: int, rng: random.Random) -> list[list[int]]:
    return [[rng.choice(pool) for _ in range(length)] for _ in range(n)]


def run_offline(
    model: str | None = None,
    *,
    prefill_len: int = 512,
    batch_sizes: Sequence[int] = (1, 8, 32),
    decode_tokens: int = 128,
    repeats: int = 3,
    seed: int | None = None,
    engine_overrides: dict[str, Any] | None = None,
    llm: Any = None,
) -> OfflineResult:
    """Load `model` with kiln's offline API (or use `llm`) and measure prefill and decode."""
    t0 = time.perf_counter()
    if llm is None:
        from kiln.llm import LLM

        llm = LLM(model=model, **(engine_overrides or {}))
    load_seconds = time.perf_counter() - t0
    tiles = getattr(getattr(llm.engine, "runner", None), "tiles", None)
    if tiles is not None:  # a first start's tile-cache write would share the cores with the run
        tiles.wait()
    rng = random.Random(f"seed{seed}" if seed is not None else new_salt())
    routing_before = _routing_stats(llm)
    pool = word_token_pool(llm)

    prefill_times: list[float] = []
    _timed_generate(llm, random_prompts(pool, 1, prefill_len, rng), 1)  # warm this shape
    for _ in range(max(1, repeats)):
        seconds, _ = _timed_generate(llm, random_prompts(pool, 1, prefill_len, rng), 1)
        prefill_times.append(seconds)
    prefill_s = statistics.median(prefill_times)

    runner = getattr(getattr(llm, "engine", None), "runner", None)
    read_gbs = None
    if runner is not None and runner.device.type == "cpu":
        from kiln.bench.roofline import measure_read_bandwidth

        read_gbs = measure_read_bandwidth(getattr(llm.config, "num_threads", None))
    decode: list[DecodeResult] = []
    for batch in batch_sizes:
        _timed_decode(llm, pool, batch, 2, rng)  # warm
        short, n_short = _timed_decode(llm, pool, batch, DECODE_BASE_TOKENS, rng)
        long, n_long = _timed_decode(llm, pool, batch, DECODE_BASE_TOKENS + decode_tokens, rng)
        if long > short * 1.05:
            method, extra_s, tokens = "difference", long - short, n_long - n_short
        else:
            method, extra_s, tokens = "whole-call", long, n_long
        tok_s = tokens / extra_s
        roof = None
        if read_gbs is not None:
            from kiln.bench.roofline import roofline

            # the measured tokens' mean context: the prompt, the short run, half the rest
            context = DECODE_PROMPT_LEN + DECODE_BASE_TOKENS + decode_tokens / 2
            roof = asdict(roofline(runner, batch, context, tok_s, read_gbs))
        decode.append(DecodeResult(batch=batch, tokens_per_seq=decode_tokens, seconds=extra_s,
                                   tok_s=tok_s, per_seq_tok_s=tok_s / batch, short_seconds=short,
                                   long_seconds=long, method=method, roofline=roof))
    name = model or str(getattr(getattr(llm, "config", None), "model", None) or "default")
    config: dict[str, Any] = {"prefill_len": prefill_len, "batch_sizes": list(batch_sizes),
                              "decode_tokens": decode_tokens,
                              "decode_prompt_len": DECODE_PROMPT_LEN,
                              "decode_base_tokens": DECODE_BASE_TOKENS, "repeats": repeats,
                              "engine_overrides": engine_overrides or {}}
    return OfflineResult(model=name, load_seconds=load_seconds, prefill_tokens=prefill_len,
                         prefill_seconds=prefill_times, prefill_tok_s=prefill_len / prefill_s,
                         decode=decode, config=config, settings=served_settings(llm),
                         moe_routing=moe_routing(routing_before, _routing_stats(llm)))


def _routing_stats(llm: Any) -> dict[int, list[int]]:
    engine = getattr(llm, "engine", None)
    return engine.routing_stats() if hasattr(engine, "routing_stats") else {}


def moe_routing(before: dict[int, list[int]], after: dict[int, list[int]]
                ) -> list[dict[str, Any]]:
    """Per MoE layer, how the tokens routed between the two snapshots spread over the experts
    (the summary /metrics gives operators: min/mean/max per expert, max over mean, idle)."""
    from kiln.server.metrics import moe_layer_summary

    rows = []
    for layer, counts in sorted(after.items()):
        prior = before.get(layer, [0] * len(counts))
        delta = [a - b for a, b in zip(counts, prior)]
        rows.append({"layer": layer, "experts": len(delta), "tokens": sum(delta),
                     **moe_layer_summary(delta)})
    return rows


# What the offline report names: the settings that decide the engine's speed.
REPORTED = ("device", "dtype", "quantization", "dense_weights", "kv_cache_dtype", "cpu_kernels",
            "cpu_isa", "compile", "num_threads", "max_num_seqs", "max_num_batched_tokens",
            "runtime_preset")


def served_settings(llm: Any) -> dict[str, dict[str, Any]]:
    """The engine settings the measured LLM resolved, each {value, source, reason}: the same
    table, presets and auto rules as `kiln serve`, so this is the served configuration."""
    settings = getattr(llm, "settings", None)
    if settings is None:
        return {}
    from kiln.settings.table import BY_NAME

    return {name: r.to_dict() for name, r in settings.values.items()
            if BY_NAME[name].group == "engine" and r.value is not None}
