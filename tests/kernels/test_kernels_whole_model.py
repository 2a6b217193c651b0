"""kiln's batch-invariant CPU kernels checked inside the whole model, not only on made-up
tensors (tests/kernels/test_kernels.py does that): SmolLM2 with the default settings except
int8 weights (re-quantized from the GGUF's blocks: --no-gguf-kernels) runs 3 chat requests, a
batched prefill then 4 batched decode steps, once with the kernels (ops.attend_rows
for every attention row, q8_linear for the int8 head) and once with their PyTorch references
swapped in, fed the same tokens; every logit of every step
must agree. That covers what unit tests cannot: the pool layout, the gather tables and
context lengths the runner builds for decode and prefill rows, the query-to-KV head mapping of
a GQA model, the head's real scales.

Why int8 weights and not the default int4: int4 layers run q4_linear, which rounds its
activations to int8 per group of 32, so any 1e-6 difference upstream (the kernels' add order
against PyTorch's) flips some roundings and grows, layer by layer, to the size of that
quantization noise (SmolLM2 Q4_1, 16 requests x 17 steps: kernels against references differ
by ~0.5 mean |logit|, as much as kernels against --no-cpu-kernels or against the previous
attention kernel). A comparison there could only catch gross bugs; with int8 weights (fp32
activations, fp32 KV) the two paths agree to ~1e-4 and a wrong head, slot or length shows at
once."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kiln.sampling_params import SamplingParams

QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "How many legs does a spider have?"]
STEPS = 5  # the token sampled after the prefill, then 4 decode steps of 3 rows each
# Measured (16 requests x 17 steps, the same setup): max |logit difference| 1.1e-4, mean
# 1.1e-5, on logits of magnitude ~20-30; with fp32 weights 6e-5. A kernel bug (a wrong head,
# slot, length or scale) moves logits by whole units.
TOL = 1e-3


@pytest.fixture(scope="module")
def llm(kernel_level_module: str) -> Any:
    from kiln.llm import LLM

    # fp32 KV: an fp16 pool (the default with quantized weights) rounds every key and value,
    # and a 1e-6 difference upstream then flips some of those roundings, as int4's activation
    # rounding does above (measured: 1e-2 between the two runs instead of 1e-4).
    # --no-gguf-kernels: the tied Q8_0 embedding then becomes an int8 head on q8_linear (with
    # the GGUF kernels it runs on the file's blocks, whose int8 activations round like int4's)
    return LLM(None, quantization="int8", kv_cache_memory=64 << 20, kv_cache_dtype="fp32",
               gguf_kernels=False)


def _run(llm: Any, monkeypatch: pytest.MonkeyPatch, force: list[list[int]] | None
         ) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens and every step's logits [request, step, vocab]; `force`: tokens to feed
    instead of the argmax (the logits recorded are the model's, before forcing)."""
    from kiln.engine import model_runner

    prompts = [llm.tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS]
    index = {tuple(p): i for i, p in enumerate(prompts)}
    seen: dict[tuple[int, int], torch.Tensor] = {}
    rows: list[int] = []
    sample = model_runner.sample_with_drafts

    def recording(sampler: Any, logits: torch.Tensor, reqs: list[Any], drafts: Any,
                  draft_probs: Any = None) -> Any:
        rows.append(len(reqs))
        keys = [(index[tuple(r.prompt_token_ids)], len(r.output_token_ids)) for r in reqs]
        for i, key in enumerate(keys):
            seen[key] = logits[i].float().clone()
        if force is not None:
            logits = torch.full_like(logits, -float("inf"))
            for i, (q, s) in enumerate(keys):
                logits[i, force[q][s]] = 0.0
        return sample(sampler, logits, reqs, drafts, draft_probs)

    monkeypatch.setattr(model_runner, "sample_with_drafts", recording)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS,
                                                ignore_eos=True))
    # One prefill step, then decode steps of all 8 rows together: batched, as served.
    assert rows == [len(QUESTIONS)] * STEPS
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logits = torch.stack([torch.stack([seen[(q, s)] for s in range(STEPS)])
                          for q in range(len(QUESTIONS))])
    return tokens, logits


def _attend_rows_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                        row_of: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """attend_rows' contract in plain PyTorch, all rows of a call at once (padded to the longest
    context and masked): ops.attend_rows_reference loops over rows in Python, ~10x
    slower here, too slow for this test's budget."""
    hq, hk = q.shape[1], k.shape[1]
    length = int(lens.max())
    slots = table[row_of][:, :length]  # [T, L]
    kt = k[slots].float().repeat_interleave(hq // hk, dim=2)  # [T, L, Hq, D]
    vt = v[slots].float().repeat_interleave(hq // hk, dim=2)
    s = torch.einsum("thd,tlhd->thl", q.float(), kt) * scale
    past = torch.arange(length, device=q.device)[None, :] >= lens[:, None]  # [T, L]
    s = s.masked_fill(past[:, None, :], -float("inf"))
    return torch.einsum("thl,tlhd->thd", torch.softmax(s, dim=-1), vt)


def q8_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q8_linear's contract: x @ (w * scale)^T in fp32."""
    return x.float() @ (w.float() * scale.float()[:, None]).t()


def test_kernels_match_their_references_in_the_whole_model(
        llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.layers.kernels import ops

    decided = llm.engine.runner.decisions
    assert decided.batch_invariant.value, decided.batch_invariant.reason
    head = llm.engine.runner.model.lm_head
    assert getattr(head, "q8", False), "the int8 head should run q8_linear here"

    calls = {"attend_rows": 0, "q8_linear": 0}

    def counted(name: str, fn: Any) -> Any:
        def call(*a: Any) -> Any:
            calls[name] += 1
            return fn(*a)
        return call

    with monkeypatch.context() as m:
        m.setattr(ops, "attend_rows", counted("attend_rows", ops.attend_rows))
        m.setattr(ops, "q8_linear", counted("q8_linear", ops.q8_linear))
        tokens, kernels = _run(llm, m, None)
    layers = len(list(llm.engine.runner.model.attention_layers()))
    # Every layer of every step went through the kernels (prefill: one call per chunk).
    assert calls["attend_rows"] >= layers * STEPS and calls["q8_linear"] == STEPS

    with monkeypatch.context() as m:
        m.setattr(ops, "attend_rows", _attend_rows_masked)
        m.setattr(ops, "q8_linear", q8_reference)
        forced, reference = _run(llm, m, tokens)
    assert forced == tokens
    diff = (kernels - reference).abs()
    assert diff.max().item() < TOL, (diff.max().item(), diff.amax(dim=(0, 2)).tolist())
    assert bool(torch.isfinite(kernels).all())
    # Real answers: the logits are not flat, and the greedy picks agree.
    assert (kernels.argmax(-1) == reference.argmax(-1)).all()
