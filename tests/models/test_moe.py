"""Mixture-of-experts: routing, grouped expert execution, loading from safetensors and GGUF, and
the quantized expert path, on tiny random-weight Qwen3-MoE / Qwen2-MoE / Mixtral models.
(Logit and greedy parity with transformers for these families is in test_parity.py.)"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from conftest import assert_fused_block_matches, make_tiny_model

from kiln.engine.model_runner import ModelRunner
from kiln.layers.kernels import reference
from kiln.layers.moe import Experts
from kiln.layers.router import grouped_topk, softmax_topk
from kiln.models.gguf_writer import write_gguf
from kiln.models.loader import iter_tensors, open_checkpoint
from kiln.settings.engine_config import EngineConfig

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral"]


def _runner(path, **kw) -> ModelRunner:
    cfg = EngineConfig.of(model=str(path), dtype="float32", kv_cache_memory=8 << 20,
                       max_num_batched_tokens=64, compile=False, **kw)
    return ModelRunner(cfg, open_checkpoint(path))


def _prompt(n: int = 60) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (safetensors folder, F32 GGUF, Q4_0 GGUF), made once per module."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for fam in FAMILIES:
        folder = make_tiny_model(fam, root / fam)
        ck = open_checkpoint(folder)
        f32 = write_gguf(root / f"{fam}-f32.gguf", ck.config, iter_tensors(ck), qtype="F32")
        q4 = write_gguf(root / f"{fam}-q4_0.gguf", ck.config, iter_tensors(ck), qtype="Q4_0")
        out[fam] = (folder, f32, q4)
    return out


def test_experts_grouped_run_equals_per_token_loop():
    """Sorting (token, expert) pairs by expert and running each expert once gives exactly what
    running every token through its k experts one by one gives."""
    torch.manual_seed(0)
    ex = Experts(6, 32, 16)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.2)
        ex.down_proj.normal_(0, 0.2)
    x = torch.randn(9, 32)
    weights, ids = softmax_topk(torch.randn(9, 6), 3, renormalize=True)
    got = ex(x, weights, ids)
    want = torch.zeros_like(x)
    for t in range(9):
        for j in range(3):
            e = int(ids[t, j])
            gu = ex.gate_up_proj[e] @ x[t]
            h = torch.nn.functional.silu(gu[:16]) * gu[16:]
            want[t] += weights[t, j] * (ex.down_proj[e] @ h)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # every (token, expert) pair was counted once
    assert int(ex.tokens_per_expert.sum()) == 9 * 3
    assert ex.tokens_per_expert.tolist() == torch.bincount(ids.flatten(), minlength=6).tolist()


def test_grouped_topk_only_picks_from_the_best_groups():
    """DeepSeek-V3 routing: experts outside the top `topk_group` groups are never chosen, the
    correction bias moves the choice but not the weights, and the weights are renormalised and
    scaled."""
    torch.manual_seed(1)
    logits = torch.randn(50, 16)
    bias = torch.randn(16)
    w, ids = grouped_topk(logits, 4, n_group=4, topk_group=2, scoring="sigmoid", bias=bias,
                          renormalize=True, scale=2.5, method="noaux_tc")
    choice = torch.sigmoid(logits) + bias
    group_score = choice.view(50, 4, 4).topk(2, dim=-1).values.sum(-1)
    best_groups = group_score.topk(2, dim=-1).indices
    for t in range(50):
        assert set((ids[t] // 4).tolist()) <= set(best_groups[t].tolist())
        # the chosen experts are the best by biased score within those groups
        allowed = torch.cat([torch.arange(g * 4, g * 4 + 4) for g in best_groups[t].tolist()])
        top = allowed[choice[t, allowed].topk(4).indices]
        assert sorted(ids[t].tolist()) == sorted(top.tolist())
    scores = torch.sigmoid(logits).gather(1, ids)
    torch.testing.assert_close(w, scores / scores.sum(-1, keepdim=True) * 2.5)


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_loads_like_safetensors(tiny, family):
    """A GGUF with llama.cpp's names (stacked `ffn_*_exps`, `ffn_gate_inp`, shared-expert
    tensors, Mixtral's permuted Q/K) gives the safetensors model's logits exactly."""
    folder, f32, _ = tiny[family]
    ids = _prompt()
    ref = _runner(folder).prompt_logits(ids)
    got = _runner(f32).prompt_logits(ids)
    assert _runner(f32).model_config.num_experts == 8
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_q4_0_experts_are_repacked_not_requantized(tiny, family):
    """With --quantization int4 a Q4_0 GGUF's expert blocks become the experts' int4 weights as
    they are: each expert's dequantized int4 weight equals the GGUF's dequantized blocks, up to
    the bf16 rounding of the scales that PyTorch's int4 kernel keeps (re-quantizing would be off
    by up to half a 4-bit step, ~1e-2 here)."""
    _, _, q4 = tiny[family]
    dense = _runner(q4)  # Q4_0 dequantized to fp32
    quant = _runner(q4, quantization="int4")
    d_layers = [m for m in dense.model.modules() if isinstance(m, Experts)]
    q_layers = [m for m in quant.model.modules() if isinstance(m, Experts)]
    assert d_layers and len(d_layers) == len(q_layers)
    for d, q in zip(d_layers, q_layers, strict=True):
        # per-expert modules, or (kiln's CPU kernels) all experts stacked for moe_q4
        assert q.is_quantized and not d.is_quantized
        if q.w13_q4 is not None:  # stacked: Q4_0 blocks without their mins (min = -8 scale)
            assert q.w13_q4.shape[-1] == q.w2_q4.shape[-1] == reference.Q4_SYM_BLOCK
        for e in range(d.num_experts):
            gate_up, down = q.expert_weights(e)
            torch.testing.assert_close(gate_up, d.gate_up_proj[e], rtol=0, atol=2e-3)
            torch.testing.assert_close(down, d.down_proj[e], rtol=0, atol=2e-3)
    # The untied head arrives as Q4_0 blocks too: it stays int4 (an int8 copy of 4-bit values
    # holds nothing more), with the file's values.
    from kiln.layers.quant.linear import Int4Linear

    assert isinstance(quant.model.lm_head, Int4Linear)
    torch.testing.assert_close(quant.model.lm_head.dequantize(torch.float32),
                               dense.model.lm_head.weight.float(), rtol=0, atol=2e-3)
    # Same weights; the int4 kernels round activations to int8 per group of 32, and a tiny
    # random model's logits are near-ties everywhere, so some argmaxes flip: over 10 prompts of
    # 40 tokens (Mixtral) 0.80-0.975 agree per prompt, 0.90 on average, before and after the
    # fp32 row kernels alike. One prompt is a coin toss around any threshold: the mean of 8.
    agree = []
    for seed in range(8):
        ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
        a, b = dense.prompt_logits(ids), quant.prompt_logits(ids)
        agree.append((a.argmax(-1) == b.argmax(-1)).float().mean().item())
    assert sum(agree) / len(agree) > 0.85, agree


def test_shared_expert_absorbed_into_the_experts_keeps_the_outputs(tiny, monkeypatch):
    """On kiln's int4 kernels Qwen2-MoE's gated shared expert (96 wide) runs inside the stacked
    experts as three virtual experts of the routed width (its tiles sliced, not re-quantized;
    its gate a row of the router), which the runner does at load: each block's output equals
    the separate shared expert's up to fp32 reassociation (its down product summed in three
    parts)."""
    import kiln.engine.model_runner as mr

    _, _, q4 = tiny["qwen2_moe"]
    fused = _runner(q4, quantization="int4")
    assert all(b.shared_expert is None and b.experts.num_shared == 3 and
               b.gate.weight.shape[0] == 9 for b in _blocks(fused))
    monkeypatch.setattr(mr, "fuse_shared_experts", lambda model: 0)
    for block in _blocks(_runner(q4, quantization="int4")):
        assert block.shared_expert is not None
        assert_fused_block_matches(block, seed=1)


def _blocks(runner: ModelRunner) -> list:
    return [m for m in runner.model.modules() if hasattr(m, "shared_gate_in_router")]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_experts_from_safetensors(tiny, mode):
    """Dense checkpoints quantize their experts too, and stay close to the fp32 model."""
    folder = tiny["qwen3_moe"][0]
    ids = _prompt(40)
    ref = _runner(folder).prompt_logits(ids)
    got = _runner(folder, quantization=mode).prompt_logits(ids)
    # A 64-wide random model is far more sensitive to 4-bit weights than a real one (argmax
    # agreement is no measure here: the dense tiny Qwen3 agrees on 70% at int4), so the logits
    # as a whole are compared.
    cos = torch.nn.functional.cosine_similarity(ref, got, dim=-1).min().item()
    assert cos > (0.99 if mode == "int8" else 0.85), cos


def test_routing_counts_every_token_of_a_step(tiny):
    """Each MoE layer counts top_k experts per token it ran: a 60-token prompt adds 60 * k."""
    r = _runner(tiny["qwen3_moe"][0])
    experts = [m for m in r.model.modules() if isinstance(m, Experts)]
    before = [int(m.tokens_per_expert.sum()) for m in experts]
    r.prompt_logits(_prompt(60))
    k = r.model_config.num_experts_per_tok
    assert [int(m.tokens_per_expert.sum()) - b for m, b in zip(experts, before)] == \
        [60 * k] * len(experts)
    # mlp_only_layers=[1] in the tiny Qwen3-MoE: layers 0 and 2 route, layer 1 is dense
    assert [m.layer for m in experts] == [0, 2]


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory, gguf_path):
    """`kiln serve` on a tiny Qwen3-MoE GGUF in Q4_0 (SmolLM2's tokenizer copied in, so it
    chats), with the CPU default int4 path: the experts' 4-bit blocks are served as they are."""
    from test_server import _serve

    tmp = tmp_path_factory.mktemp("moe-serve")
    folder = make_tiny_model("qwen3_moe", tmp / "hf", vocab_size=49152,
                             max_position_embeddings=2048)
    ck = open_checkpoint(folder)
    gguf = write_gguf(tmp / "tiny-qwen3moe-q4_0.gguf", ck.config, iter_tensors(ck),
                      qtype="Q4_0", tokenizer_from=gguf_path)
    yield from _serve(tmp, gguf, "--quantization", "int4")


@pytest.mark.slow
def test_moe_gguf_served_through_the_openai_client(moe_server):
    client = moe_server.client()
    msgs = [{"role": "user", "content": "Hello"}]
    r = client.chat.completions.create(model="smol", messages=msgs, max_tokens=12,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smol", messages=msgs, max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert text == r.choices[0].message.content
    effective = json.loads(moe_server.effective_config.read_text())
    assert effective["settings"]["quantization"]["value"] == "int4"
    # /metrics counts the routing per layer and expert: both MoE layers saw every token twice
    # (top-2); layer 1 is dense and has no series.
    text = httpx.get(f"{moe_server.base_url}/metrics", timeout=10).text
    per_layer: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("kiln:moe_expert_tokens_total{"):
            layer = line.split('layer="')[1].split('"')[0]
            per_layer[layer] = per_layer.get(layer, 0) + int(float(line.rsplit(" ", 1)[1]))
    assert set(per_layer) == {"0", "2"}
    assert per_layer["0"] == per_layer["2"] > 0 and per_layer["0"] % 2 == 0



def test_repacked_experts_are_mapped_from_the_tile_cache_at_the_next_start(tiny, tmp_path,
                                                                           monkeypatch):
    """--tile-cache (kiln/layers/tile_cache.py): the first start of a Q4_0 GGUF writes each MoE
    layer's packed stack, the absorbed shared expert's rows included, to kiln's cache folder;
    the next maps them instead of packing, with the same bytes and the same logits. A file
    changed since (another mtime) is not read from the old tiles, whose folder the new write
    replaces, as it removes a dead writer's temporary file; --no-tile-cache neither reads nor
    writes."""
    import os
    import shutil

    from kiln.layers import tile_cache

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tile_cache, "MIN_LAYER_BYTES", 0)  # the tiny stacks are a few KB
    q4 = shutil.copy(tiny["qwen2_moe"][2], tmp_path / "m.gguf")
    first = _runner(q4, quantization="int4")
    first.tiles.wait()
    layers = first.model_config.num_hidden_layers
    assert len(list(first.tiles.folder.glob("layer*.bin"))) == layers
    assert first.tiles.hits == 0
    second = _runner(q4, quantization="int4")
    assert second.tiles.hits == layers and second.tiles.folder == first.tiles.folder
    a, b = _blocks(first), _blocks(second)
    assert all(blk.experts.from_tile_cache and blk.experts.num_shared == 3 for blk in b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.experts.w13_q4, y.experts.w13_q4)
        assert torch.equal(x.experts.w2_q4, y.experts.w2_q4)
    ids = _prompt()
    assert torch.equal(first.prompt_logits(ids), second.prompt_logits(ids))

    st = os.stat(q4)
    os.utime(q4, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    # a writer that died mid-write left its temporary file (a pid above any pid_max)
    dead = tile_cache.TileCache.for_file(q4).folder / "layer0.tmp999999999"
    dead.parent.mkdir(parents=True)
    dead.write_bytes(b"partial")
    third = _runner(q4, quantization="int4")
    assert third.tiles.hits == 0 and third.tiles.folder == dead.parent != first.tiles.folder
    third.tiles.wait()
    assert not first.tiles.folder.exists()  # the stale folder went with the new write
    assert not dead.exists()
    assert torch.equal(third.prompt_logits(ids), second.prompt_logits(ids))
    assert _runner(q4, quantization="int4", tile_cache=False).tiles is None
