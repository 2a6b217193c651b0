"""DeepSeek's one-call decoder layer (kiln/layers/kernels/mla.cpp `mla_layer`) at every ISA level
this CPU runs: it computes what the eager layer (kiln/models/deepseek.py) computes, its one
parallel region gives the bits of its op-by-op chain, and greedy requests decode the same tokens
alone or batched with it on. Tiny random DeepSeek-V2 / V3 models (MLA, grouped routing, a shared
expert, a dense first layer; V3 with a q LoRA, sigmoid scores and a correction bias) in int4."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model

from kiln.models.llama import DECODE_KERNEL_ANY_ROWS
from kiln.sampling_params import SamplingParams


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def folder(request, tmp_path_factory) -> Path:
    # nope 32: kv_b_proj on per-head q4 tiles (heads_q4), which the layer kernel needs
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param),
                           qk_nope_head_dim=32)


def _engine(folder: Path, **kw):
    from kiln.engine.engine import Engine
    from kiln.settings.engine_config import EngineConfig

    return Engine(EngineConfig.of(model=str(folder), dtype="float32", quantization="int4",
                                  kv_cache_memory=8 << 20, max_num_batched_tokens=32,
                                  compile=False, **kw))


def _prompts(n: int) -> list[list[int]]:
    return [torch.randint(0, 256, (9 + 5 * i,), generator=torch.Generator().manual_seed(i)).tolist()
            for i in range(n)]


def _run(eng, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    out: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_every_step_runs_the_one_call_layer_and_it_computes_the_eager_layer(
        folder: Path, kernel_level: str, monkeypatch) -> None:
    """Each layer of each step (prefill chunks, decode rows) through mla_layer, checked against
    the eager forward on the same input: the dense layer to the bit, the MoE layers to the
    rounding of the routing weights (the eager layer's softmax / sigmoid are ATen's)."""
    from kiln.models.deepseek import DeepseekDecoderLayer, DeepseekMoE
    from kiln.models.llama import LlamaModel

    eng = _engine(folder)
    # layer by layer (the step's one mla_stack call runs the same mla_layer calls)
    monkeypatch.setattr(LlamaModel, "_mla_stack", lambda self: None)
    assert eng.runner.decode_kernel_rows == DECODE_KERNEL_ANY_ROWS
    seen = {"dense": 0, "moe": 0}
    kernel = DeepseekDecoderLayer.forward_decode_kernel

    def checked(self, cos, sin, x):
        want = self.forward(cos, sin, x.clone())  # writes the same pool rows first
        got = kernel(self, cos, sin, x)
        if isinstance(self.mlp, DeepseekMoE):
            seen["moe"] += 1
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
        else:
            seen["dense"] += 1
            assert torch.equal(got, want)
        return got

    monkeypatch.setattr(DeepseekDecoderLayer, "forward_decode_kernel", checked)
    greedy = SamplingParams(temperature=0, max_tokens=4, min_tokens=4)
    _run(eng, _prompts(3), greedy)
    assert seen["dense"] >= 5 and seen["moe"] >= 10


def test_the_one_region_gives_the_bits_of_the_op_chain(folder: Path, kernel_level: str) -> None:
    """mla_layer_q4 (one parallel region) against the op-by-op chain (the path of GGUF-block
    linears), on the same layer, input and pool: output and written latent rows alike."""
    from kiln.layers.kernels import ops

    eng = _engine(folder)
    model = eng.runner.model.model
    for layer in model.layers:
        kernel = layer._mla_kernel()
        assert kernel is not None
        kv = layer.self_attn.attn.kv
        h = layer.input_layernorm.weight.shape[0]
        for t in (1, 17):
            x = torch.randn(t, h, generator=torch.Generator().manual_seed(t))
            cos, sin = model._rotary[0].lookup(torch.arange(t), torch.float32)
            rows = (torch.arange(t), torch.arange(t)[None], torch.zeros(t, dtype=torch.long),
                    torch.arange(1, t + 1))
            got = []
            for chain in (True, False):
                kernel.set_chain(chain)
                kv.k.zero_()
                y = ops.mla_layer(x, cos, sin, kernel, rows[0], *rows[1:])
                got.append((y, kv.k[:t].clone()))
            kernel.set_chain(False)
            assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


def test_greedy_rows_are_the_same_alone_or_batched(folder: Path, kernel_level: str,
                                                   monkeypatch) -> None:
    """Eight requests one by one, then all at once (chunked prefill mixed with decode rows): the
    same tokens, every step's layers run as one mla_stack call (batch invariance for MoE and
    MLA); and the same again layer by layer (mla_layer per layer, as a LoRA step would)."""
    from kiln.layers.kernels import ops
    from kiln.models.llama import LlamaModel

    eng = _engine(folder)
    rows = []
    real = ops.mla_stack

    def counted(*a):
        rows.append(a[0].shape[0])
        return real(*a)

    monkeypatch.setattr(ops, "mla_stack", counted)
    greedy = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    prompts = _prompts(8)
    alone = [_run(eng, [p], greedy)[0] for p in prompts]
    assert _run(eng, prompts, greedy) == alone
    assert max(rows) > 8  # steps of many rows ran through the kernel too
    monkeypatch.setattr(LlamaModel, "_mla_stack", lambda self: None)
    n = len(rows)
    assert _run(eng, prompts, greedy) == alone
    assert len(rows) == n  # that run went layer by layer
