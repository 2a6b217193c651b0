"""Qwen2.5-Coder-0.5B Q4_K_M (Q5_0 / Q8_0 / Q4_K / Q6_K tensors) run on the GGUF's own blocks
(kiln/layers/quant/gguf_blocks.py) against the same file dequantized to a float32 model: per-token
log-probabilities of a text close, greedy code sensible. Heavy (two loads of the model)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("kernel_level")  # at every ISA level this CPU runs

TEXT = ("We hold these truths to be self-evident, that all men are created equal, that they "
        "are endowed by their Creator with certain unalienable Rights, that among these are "
        "Life, Liberty and the pursuit of Happiness. That to secure these rights, Governments "
        "are instituted among Men, deriving their just powers from the consent of the governed.")


def _prompt_logprobs(llm, ids: list[int]) -> list[float]:
    from kiln.sampling_params import SamplingParams

    out = llm.generate(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    return [lp.logprob for lp in out.prompt_logprobs[1:]]


def test_native_blocks_match_float32_reference(qwen_coder_gguf: Path) -> None:
    from kiln.layers.quant.gguf_blocks import BlockEmbedding, KQuantLinear
    from kiln.llm import LLM
    from kiln.sampling_params import SamplingParams

    common = {"kv_cache_memory": "64MiB", "max_model_len": 512, "compile": False}
    native = LLM(str(qwen_coder_gguf), **common)
    model = native.engine.runner.model
    kinds = {m.type_names[0] for m in model.modules() if isinstance(m, KQuantLinear)}
    assert {"Q5_0", "Q8_0", "Q4_K", "Q6_K"} <= kinds
    assert isinstance(model.model.embed_tokens, BlockEmbedding)
    ids = native.tokenizer.encode(TEXT)
    got = _prompt_logprobs(native, ids)
    msgs = [{"role": "user", "content": "Write a Python function is_prime(n)."}]
    text = native.chat(msgs, SamplingParams(max_tokens=40, temperature=0))[0].outputs[0].text
    assert "def is_prime" in text, text
    del native, model

    ref = LLM(str(qwen_coder_gguf), quantization="none", **common)
    want = _prompt_logprobs(ref, ids)
    assert len(got) == len(want) > 40
    diffs = sorted(abs(a - b) for a, b in zip(got, want))
    mean = sum(diffs) / len(diffs)
    # Q4_K_M's own rounding is shared by both; what differs is the activations' int8 rounding
    # per group of 32 (a re-quantized int4 model adds a second rounding of every weight)
    assert mean < 0.1, (mean, diffs[-5:])
    assert abs(sum(got) - sum(want)) / len(got) < 0.05
