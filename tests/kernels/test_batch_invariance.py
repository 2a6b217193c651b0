"""Batch invariance with kiln's default CPU settings: a greedy request's tokens and logprobs are
the same bits alone, in a batch of 16 sharing a system prompt (prefix-cache hits), with the
prefix cache off, and with its prefill cut into 32-token chunks (--max-num-batched-tokens 32).
See the batch_invariant setting (kiln/settings/table.py) and Attention._invariant."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.models.llama import DECODE_KERNEL_ANY_ROWS
from kiln.sampling_params import SamplingParams

SYSTEM = "You are a helpful assistant. Answer briefly and precisely, in plain English. " * 3
QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "What is 12 times 11?",
    "Who wrote Hamlet?", "What is the boiling point of water?", "Give a synonym for happy.",
    "What planet is closest to the sun?", "Translate 'cat' to Spanish.", "What is 2+2?",
    "Name a mammal that flies.", "What is H2O?", "How many legs does a spider have?",
    "What color is the sky?", "What is the largest ocean?", "Who painted the Mona Lisa?",
    "What is the square root of 81?",
]
MESSAGES = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            for q in QUESTIONS]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)


def _results(outs: list[Any]) -> list[tuple[list[int], list[Any]]]:
    """Token ids and every logprob (chosen and top-2 alternatives), as exact floats."""
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((list(c.token_ids), [(lp.token_id, lp.logprob, lp.top) for lp in c.logprobs]))
    return res


@pytest.fixture(scope="module")
def llm(gguf_path: Path, kernel_level_module: str) -> Any:
    """At every ISA level this CPU runs (the promise holds on each)."""
    from kiln.llm import LLM

    # The default model with default settings; a small KV pool only so that loading does not
    # size it from RAM.
    return LLM(str(gguf_path), kv_cache_memory=128 << 20)


@pytest.fixture(scope="module")
def alone(llm: Any) -> list[tuple[list[int], list[Any]]]:
    return _results([llm.chat([m], GREEDY)[0] for m in MESSAGES])


def _with_engine(llm: Any, **changes: Any) -> Any:
    """The same loaded model and KV pool under a fresh engine whose config differs by `changes`
    (no second load)."""
    from kiln.engine.engine import Engine

    old = llm.engine
    cfg = old.config.replace(**changes)
    llm.engine = Engine(cfg, runner=old.runner, tokenizer=llm.tokenizer)
    return old


def test_batch_invariance_is_on_by_default_and_says_why(llm: Any) -> None:
    decided = llm.engine.runner.decisions
    assert decided.batch_invariant.value, decided.batch_invariant.reason
    assert decided.batch_invariant.code == "batch_invariant.on"
    assert decided.compiled.value is False and decided.cascade.value is False
    assert decided.cascade.code == "cascade.batch_invariant"
    assert (decided.compiled.code in ("compiled.batch_invariant", "compiled.layer_kernel")
            or not llm.config.compile)


def test_decode_steps_run_the_invariant_layer_kernel(llm: Any, kernel_level_module: str) -> None:
    """With kiln's kernels, SmolLM2's decode-only steps run each layer as one call of the
    kernels its eager steps chain (layers.cpp decode_layer): the 16-at-once test below then
    compares those steps with the eager ones that mix decodes and prefill."""
    decided = llm.engine.runner.decisions
    assert decided.batch_invariant.value, decided.batch_invariant.reason
    assert decided.cpu_kernels.value == kernel_level_module, decided.cpu_kernels.reason
    assert decided.decode_path.value == "kernel", decided.decode_path.reason
    assert decided.decode_path.code == "decode_path.kernel_every_batch"
    assert decided.decode_kernel_rows >= DECODE_KERNEL_ANY_ROWS  # any row count
    assert decided.batch_invariant.code == "batch_invariant.on"


@pytest.mark.parametrize("changes", [
    {},  # prefix cache on: 15 of 16 hit the system prompt's blocks
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 32},  # every prompt prefilled in 32-token chunks
], ids=["cache", "no-cache", "chunks-of-32"])
def test_sixteen_at_once_equal_each_alone_exactly(llm: Any, alone: list[Any],
                                                  changes: dict[str, Any]) -> None:
    assert llm.engine.runner.decisions.batch_invariant.value, \
        llm.engine.runner.decisions.batch_invariant.reason
    old = _with_engine(llm, **changes) if changes else None
    try:
        together = _results(llm.chat(MESSAGES, GREEDY))
    finally:
        if old is not None:
            llm.engine = old
            # the other engine wrote over blocks this one's prefix cache still maps
            old.kv.reset_prefix_cache()
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert together == alone  # logprobs too, to the last bit
    assert sum(len(t) > 1 for t, _ in together) >= 12  # real answers, not one EOS each


def test_layer_kernel_and_eager_decode_give_the_same_bits(llm: Any, alone: list[Any]) -> None:
    """Every decode step of the 16 through the eager layers (the layer kernel turned off) gives
    what the one-call layer kernel gave each request alone: the kernel chains the eager step's
    own kernels in its order, so a decode row in a step mixed with prefill (eager) and one in a
    decode-only step (the kernel) cannot differ."""
    runner = llm.engine.runner
    assert runner.decode_kernel_rows, runner.decisions.decode_path.reason
    rows, runner.decode_kernel_rows = runner.decode_kernel_rows, 0
    try:
        eager = _results(llm.chat(MESSAGES, GREEDY))
    finally:
        runner.decode_kernel_rows = rows
    assert eager == alone
