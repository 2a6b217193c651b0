"""DeepSeek-V2/V3 on kiln's engine: logits and greedy tokens against transformers, the latent
KV pool (one row per token and layer), GGUF loading under llama.cpp's deepseek2 names, and the
int8 / quantization decisions around MLA."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_MOE, assert_fused_block_matches, make_tiny_model

from kiln.sampling_params import SamplingParams

FAMILIES = ["deepseek_v2", "deepseek_v3"]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    """(family, folder, transformers reference model) of a tiny random DeepSeek."""
    import transformers

    family = request.param
    folder = make_tiny_model(family, tmp_path_factory.mktemp(family))
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return family, folder, ref


def _runner(path: Path, **kw):
    from kiln.engine.model_runner import ModelRunner
    from kiln.models.loader import open_checkpoint
    from kiln.settings.engine_config import EngineConfig

    kw.setdefault("kv_cache_memory", 8 << 20)
    cfg = EngineConfig.of(model=str(path), dtype="float32", max_num_batched_tokens=64,
                       compile=False, **kw)
    return ModelRunner(cfg, open_checkpoint(path))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def _greedy(ref, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return ref.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0)[0, len(ids):].tolist()


# --------------------------------------------------------------------------- parity


def test_prompt_logits_match_transformers(tiny):
    family, folder, ref = tiny
    ids = _ids(150, 1)
    got = _runner(folder).prompt_logits(ids)
    expected = _reference_logits(ref, ids)
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    assert diff < 1e-3, f"{family}: max abs logit diff {diff}"


def test_greedy_batched_chunked_and_prefix_cached_match_transformers(tiny):
    """Several prompts batched with a 32-token budget (chunked prefill, mixed steps, batched
    decode), then four prompts that share a 64-token prefix left in the cache by a finished
    request: they prefill from the cached latent rows and decode together over the shared
    blocks (cascade attention: PyTorch's path, so --no-batch-invariant; the batch-invariant
    default runs MLA through attend_rows, row by row). Every request's greedy tokens equal
    transformers'."""
    from kiln.engine.engine import Engine
    from kiln.engine.model_runner import ModelRunner
    from kiln.settings.engine_config import EngineConfig

    family, folder, ref = tiny
    eng = Engine(EngineConfig.of(model=str(folder), dtype="float32", kv_cache_memory=8 << 20,
                              max_num_batched_tokens=32, compile=False, batch_invariant=False))
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=10)
    prompts = {f"a{i}": _ids(n, 10 + i) for i, n in enumerate((5, 17, 40, 70))}
    shared = _ids(64, 20)
    first = {"b0": shared + _ids(3, 21)}
    followers = {f"b{i}": shared + _ids(n, 21 + i) for i, n in enumerate((2, 7, 11, 20), 1)}

    cascade_steps = []
    real_shared = ModelRunner._shared_prefix_blocks

    def spy(self, decodes):
        n = real_shared(self, decodes)
        cascade_steps.append(n)
        return n

    cached: dict[str, int] = {}
    out: dict[str, list[int]] = {}

    def drive() -> None:
        while eng.has_unfinished:
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
            for r in eng.scheduler.all_requests():
                cached[r.request_id] = r.num_cached_tokens
            eng.kv.check_integrity(eng.scheduler.all_requests())

    ModelRunner._shared_prefix_blocks = spy  # type: ignore[method-assign]
    try:
        for group in (prompts, first, followers):
            for rid, p in group.items():
                eng.add_request(rid, p, params)
            drive()
    finally:
        ModelRunner._shared_prefix_blocks = real_shared  # type: ignore[method-assign]

    assert all(cached[rid] >= 48 for rid in followers), cached  # the prefix cache was hit
    assert any(n >= 4 for n in cascade_steps)  # decode rows attended to shared blocks once
    for rid, p in {**prompts, **first, **followers}.items():
        assert out[rid] == _greedy(ref, p, 10), f"{family} request {rid}"


# --------------------------------------------------------------------------- the KV pool


def test_kv_pool_stores_one_latent_row_per_token(tiny):
    family, folder, _ = tiny
    r = _runner(folder)
    c = TINY_MOE[family]
    row = c["kv_lora_rank"] + c["qk_rope_head_dim"]
    assert r.kv_bytes_per_token() == c["num_hidden_layers"] * row * 4  # fp32
    slots = (r.plan.num_blocks + 1) * r.block_size  # + the scratch block
    pool_bytes = 0
    for layer in r.model.attention_layers():
        kv = layer.kv
        assert tuple(kv.k.shape) == (slots, 1, row)
        # V is the latent's first kv_lora_rank columns, in the same memory
        assert kv.v.data_ptr() == kv.k.data_ptr() and kv.v.shape[-1] == c["kv_lora_rank"]
        pool_bytes += kv.k.numel() * kv.k.element_size()
    assert pool_bytes == slots * r.kv_bytes_per_token()


def test_int8_kv_falls_back_to_the_model_dtype_with_a_reason(tiny):
    _, folder, ref = tiny
    r = _runner(folder, kv_cache_dtype="int8")
    d = r.decisions.kv_cache_dtype
    assert d.value == "fp32" and d.code == "kv_cache_dtype.mla_no_int8"
    assert r.kv_dtype_name == "fp32"
    ids = _ids(40, 3)
    diff = (r.prompt_logits(ids) - _reference_logits(ref, ids)).abs().max().item()
    assert diff < 1e-3


def test_int8_weights_run_close_to_fp32(tiny):
    """quantize_model swaps MLA's linears (not kv_b_proj, used per head) and the experts."""
    from kiln.layers.quant.linear import Int8Linear

    _, folder, ref = tiny
    r = _runner(folder, quantization="int8")
    attn = r.model.model.layers[1].self_attn
    assert isinstance(attn.kv_a_proj_with_mqa, Int8Linear)
    assert isinstance(attn.o_proj, Int8Linear)
    ids = _ids(40, 4)
    got, want = r.prompt_logits(ids), _reference_logits(ref, ids)
    assert (got - want).abs().max().item() < 0.1 * want.abs().max().item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.9


def test_int4_runs_the_latent_up_projections_on_per_head_tiles(tmp_path):
    """With int4 weights on kiln's kernels, kv_b_proj becomes W_uk^T / W_uv per-head tiles
    (heads_q4, the dense weight dropped) where its dims allow (nope 32 here). The same runner
    with those tiles dequantized back into the batched matmuls gives the same logits up to the
    activations' int8 rounding (int4 itself moves this random tiny model's logits by ~30%)."""
    folder = make_tiny_model("deepseek_v2", tmp_path / "ds", qk_nope_head_dim=32)
    r = _runner(folder, quantization="int4")
    ups = [layer.self_attn.kv_b_proj for layer in r.model.model.layers]
    assert all(u.uk_q4 is not None and u.uv_q4 is not None and u.weight.numel() == 0
               for u in ups)
    ids = _ids(40, 5)
    tiles = r.prompt_logits(ids)
    for u in ups:  # back to the dense form, the same (dequantized) weights
        uk, uv = u.parts()
        u.uk_q4 = u.uv_q4 = None
        u.weight = torch.nn.Parameter(torch.cat([uk, uv], 1).reshape(-1, u.rank),
                                      requires_grad=False)
    dense = r.prompt_logits(ids)
    assert (tiles - dense).abs().max().item() < 0.1 * dense.abs().max().item()
    assert (tiles.argmax(-1) == dense.argmax(-1)).float().mean().item() > 0.85


def test_shared_experts_absorbed_into_the_experts_keep_the_outputs(tiny, monkeypatch):
    """On kiln's int4 kernels DeepSeek's shared experts run inside the stacked routed experts
    (one virtual expert here, weight 1), as the runner arranges at load: each MoE block's
    output equals the separate shared MLP's up to fp32 reassociation."""
    import kiln.engine.model_runner as mr

    _, folder, _ = tiny

    def moes(r):
        return [m for m in r.model.modules() if hasattr(m, "shared_experts")]

    assert all(m.shared_experts is None and m.experts.num_shared == 1
               for m in moes(_runner(folder, quantization="int4")))
    monkeypatch.setattr(mr, "fuse_shared_experts", lambda model: 0)
    for moe in moes(_runner(folder, quantization="int4")):
        assert moe.shared_experts is not None
        assert_fused_block_matches(moe, seed=2)


# --------------------------------------------------------------------------- GGUF


def _write_deepseek2_gguf(folder: Path, path: Path, split_kv_b: bool) -> None:
    """The tiny HF checkpoint as llama.cpp's convert_hf_to_gguf.py writes deepseek2 (F32):
    its tensor names and metadata keys; `split_kv_b`: the newer converter's attn_k_b/attn_v_b
    and MQA-form key/value lengths, else the older attn_kv_b."""
    import json

    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors"))
    h, n = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
    r, p, v = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    v3 = cfg["model_type"] == "deepseek_v3"
    out = gguf.GGUFWriter(str(path), "deepseek2")
    out.add_block_count(cfg["num_hidden_layers"])
    out.add_context_length(cfg["max_position_embeddings"])
    out.add_embedding_length(cfg["hidden_size"])
    out.add_feed_forward_length(cfg["intermediate_size"])
    out.add_head_count(h)
    out.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    out.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    out.add_vocab_size(cfg["vocab_size"])
    if cfg.get("q_lora_rank"):
        out.add_q_lora_rank(cfg["q_lora_rank"])
    out.add_kv_lora_rank(r)
    out.add_rope_dimension_count(p)
    if split_kv_b:
        out.add_head_count_kv(1)
        out.add_key_length(r + p)
        out.add_value_length(r)
        out.add_key_length_mla(n + p)
        out.add_value_length_mla(v)
    else:
        out.add_head_count_kv(h)
        out.add_key_length(n + p)
        out.add_value_length(v)
    out.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    out.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    out.add_expert_count(cfg["n_routed_experts"])
    out.add_expert_used_count(cfg["num_experts_per_tok"])
    out.add_expert_shared_count(cfg["n_shared_experts"])
    out.add_expert_weights_scale(cfg["routed_scaling_factor"])
    out.add_expert_weights_norm(bool(cfg["norm_topk_prob"]))
    out.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3
                               else gguf.ExpertGatingFuncType.SOFTMAX)
    out.add_expert_group_count(cfg["n_group"])
    out.add_expert_group_used_count(cfg["topk_group"])

    def put(name: str, t: torch.Tensor) -> None:
        out.add_tensor(name, np.ascontiguousarray(t.float().numpy()))

    put("token_embd.weight", w["model.embed_tokens.weight"])
    put("output_norm.weight", w["model.norm.weight"])
    put("output.weight", w["lm_head.weight"])
    attn = {"q_proj": "attn_q", "q_a_proj": "attn_q_a", "q_a_layernorm": "attn_q_a_norm",
            "q_b_proj": "attn_q_b", "kv_a_proj_with_mqa": "attn_kv_a_mqa",
            "kv_a_layernorm": "attn_kv_a_norm", "o_proj": "attn_output"}
    for i in range(cfg["num_hidden_layers"]):
        hf, blk = f"model.layers.{i}.", f"blk.{i}."
        put(blk + "attn_norm.weight", w[hf + "input_layernorm.weight"])
        put(blk + "ffn_norm.weight", w[hf + "post_attention_layernorm.weight"])
        for ours, theirs in attn.items():
            if f"{hf}self_attn.{ours}.weight" in w:
                put(f"{blk}{theirs}.weight", w[f"{hf}self_attn.{ours}.weight"])
        kv_b = w[hf + "self_attn.kv_b_proj.weight"]
        if split_kv_b:  # the converter's split: k_b [H, r, n] (transposed), v_b [H, v, r]
            k_b, v_b = kv_b.view(h, n + v, r).split([n, v], dim=1)
            put(blk + "attn_k_b.weight", k_b.transpose(1, 2).contiguous())
            put(blk + "attn_v_b.weight", v_b.contiguous())
        else:
            put(blk + "attn_kv_b.weight", kv_b)
        mlp = hf + "mlp."
        if i < cfg["first_k_dense_replace"]:
            for proj in ("gate", "up", "down"):
                put(f"{blk}ffn_{proj}.weight", w[f"{mlp}{proj}_proj.weight"])
            continue
        put(blk + "ffn_gate_inp.weight", w[mlp + "gate.weight"])
        if v3:
            put(blk + "exp_probs_b.bias", w[mlp + "gate.e_score_correction_bias"])
        for proj in ("gate", "up", "down"):
            put(f"{blk}ffn_{proj}_exps.weight", torch.stack(
                [w[f"{mlp}experts.{e}.{proj}_proj.weight"]
                 for e in range(cfg["n_routed_experts"])]))
            put(f"{blk}ffn_{proj}_shexp.weight", w[f"{mlp}shared_experts.{proj}_proj.weight"])
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()


@pytest.mark.parametrize("split_kv_b", [False, True], ids=["attn_kv_b", "attn_k_b+attn_v_b"])
def test_gguf_gives_the_safetensors_logits(tiny, tmp_path, split_kv_b):
    family, folder, ref = tiny
    path = tmp_path / f"{family}.gguf"
    _write_deepseek2_gguf(folder, path, split_kv_b)
    from kiln.models.loader import open_checkpoint

    mc = open_checkpoint(path).config
    assert mc.architecture == ("DeepseekV3ForCausalLM" if family == "deepseek_v3"
                               else "DeepseekV2ForCausalLM")
    assert (mc.qk_nope_head_dim, mc.v_head_dim, mc.kv_lora_rank) == (16, 16, 32)
    ids = _ids(100, 5)
    from_gguf = _runner(path).prompt_logits(ids)
    from_st = _runner(folder).prompt_logits(ids)
    diff = (from_gguf - from_st).abs().max().item()
    assert diff < 1e-5, f"{family} GGUF vs safetensors: max abs logit diff {diff}"
    assert (from_gguf - _reference_logits(ref, ids)).abs().max().item() < 1e-3


# --------------------------------------------------------------------------- attention forms


def test_mla_decode_forms_match_a_reference():
    """MQA over a latent row whose values are its first columns: the eager decode forms (SDPA,
    bf16 matmuls), the fused ones torch.compile traces, and cascade over shared rows all give
    softmax(q . k) @ k[:, :r]."""
    from kiln.layers.attention import Attention

    g = torch.Generator().manual_seed(0)
    b, h, r, p, length, shared = 5, 4, 32, 8, 37, 16
    attn = Attention(h, 1, r + p, scale=0.2, v_head_dim=r, v_in_k=True)
    q = torch.randn(b, h, r + p, generator=g)
    rows = torch.randn(shared + length, 1, r + p, generator=g)
    lens = torch.tensor([37, 20, 5, 30, 1])
    mask = torch.arange(length)[None] < lens[:, None]  # [B, L] over each row's own part
    own = rows[shared:].expand(b, -1, -1, -1)  # [B, L, 1, D]

    def reference(with_shared: bool) -> torch.Tensor:
        keys = torch.cat([rows[:shared].expand(b, -1, -1, -1), own], 1) if with_shared else own
        full = torch.cat([torch.ones(b, shared, dtype=torch.bool), mask], 1) if with_shared \
            else mask
        s = torch.einsum("bhd,bld->bhl", q, keys[:, :, 0]) * 0.2
        probs = torch.softmax(s.masked_fill(~full[:, None], float("-inf")), -1)
        return probs @ keys[:, :, 0, :r]

    m4 = mask[:, None, None, :]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 5e-2)):
        qd, ck, sk = q.to(dtype), own.to(dtype).contiguous(), rows[:shared].to(dtype)
        want, want_c = reference(False), reference(True)
        forms = {"decode": attn._decode(qd, ck, ck[..., :r], m4),
                 "decode_fused": attn._decode_fused(qd, ck, ck[..., :r], m4)}
        cascade = {"cascade": attn._cascade(qd, sk, sk[..., :r], ck, ck[..., :r], m4),
                   "cascade_fused": attn._cascade_fused(qd, sk, sk[..., :r], ck, ck[..., :r],
                                                        m4)}
        for name, got in forms.items():
            assert got.shape == (b, h, r)
            assert (got.float() - want).abs().max().item() < tol, (name, dtype)
        for name, got in cascade.items():
            assert got.shape == (b, h, r)
            assert (got.float() - want_c).abs().max().item() < tol, (name, dtype)


def test_bf16_engine_runs_batched_and_stays_close_to_fp32(tiny):
    """bf16 (the CPU default): batched decode takes the matmul forms; logits stay near fp32's."""
    from kiln.engine.engine import Engine
    from kiln.settings.engine_config import EngineConfig

    _, folder, ref = tiny
    eng = Engine(EngineConfig.of(model=str(folder), dtype="bfloat16", kv_cache_memory=8 << 20,
                              max_num_batched_tokens=32, compile=False))
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6)
    for i in range(5):
        eng.add_request(str(i), _ids(9 + 7 * i, 30 + i), params)
    out: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    assert all(len(out[str(i)]) == 6 for i in range(5))
    assert eng.runner.model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    ids = _ids(60, 6)
    got = eng.runner.prompt_logits(ids)
    want = _reference_logits(ref, ids)
    # (an occasional routing flip moves one token's logits a lot: bound the typical error)
    assert (got - want).abs().mean().item() < 0.01
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.9


def test_mtp_layer_tensors_are_skipped(tiny, tmp_path):
    """DeepSeek-V3 checkpoints ship the multi-token-prediction module as one more layer
    (`model.layers.{num_hidden_layers}.*`); loading skips it and the logits do not change."""
    import shutil

    from safetensors.torch import save_file

    _, folder, ref = tiny
    copy = tmp_path / "with_mtp"
    shutil.copytree(folder, copy)
    n = TINY_MOE["deepseek_v3"]["num_hidden_layers"]
    save_file({f"model.layers.{n}.eh_proj.weight": torch.zeros(64, 128),
               f"model.layers.{n}.self_attn.kv_b_proj.weight": torch.zeros(128, 32)},
              str(copy / "model-mtp.safetensors"))
    ids = _ids(30, 7)
    diff = (_runner(copy).prompt_logits(ids) - _reference_logits(ref, ids)).abs().max().item()
    assert diff < 1e-3

