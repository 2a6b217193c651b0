"""Weight-only quantization (kiln/layers/quant/linear.py) and the GGUF block decoding it builds on.

Quality guard on SmolLM2: for each mode, the quantized model's greedy choice agrees with the
unquantized (fp32) model's greedy output at >= 90% of positions, over 5 prompts x 64 tokens, and
the chat answer to "What is the capital of France?" still says Paris.

Agreement is teacher-forced: the quantized engine generates greedily, the fp32 model scores that
continuation, and a position agrees when the fp32 argmax there is the quantized model's token. Free-running agreement (two independent
greedy generations) measures the first near-tie, not quantization: on these prompts fp32 vs plain
bf16 (no quantization at all) agree on only ~76% of positions that way, because one flipped token
changes every later one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
           "The three primary colors are", "Water boils at"]
NEW_TOKENS = 64
MODES = ["int8", "int4", "int4+dense"]  # +dense: bf16 copies for large steps


# --------------------------------------------------------------------------- kernels and modules


def _groups(n: int, k: int, seed: int = 0):
    from kiln.layers.kernels.formats import GroupQuant

    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // 32, generator=g) * 0.02 + 0.001
    mn = -scale * torch.randint(4, 12, (n, k // 32), generator=g).float()
    return GroupQuant(q, scale, mn, 32)


@pytest.mark.parametrize("m", [1, 3, 32, 33, 200])
def test_int4_linear_matches_its_dequantized_weight_on_both_paths(m):
    """Small M runs the fused int4 kernel, large M dequantizes + dense GEMM: same numbers."""
    from kiln.layers.quant.linear import Int4Linear

    gq = _groups(192, 256)
    lin = Int4Linear(gq, None, torch.bfloat16)
    w = gq.dequantize(torch.float32)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = x.float() @ w.t()
    got = lin(x).float()
    assert got.dtype == torch.float32 and got.shape == (m, 192)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    # The layer's own dequantization is the GroupQuant's, up to bf16 scale/zero rounding.
    assert (lin.dequantize(torch.float32) - w).abs().max() <= 0.01 * w.abs().max()


@pytest.mark.parametrize("m", [1, 3, 4, 11, 12, 64, 96])
def test_dense_copies_give_the_quantized_layers_numbers(m):
    """keep_dense: steps of many rows run a bf16 GEMM on the dequantized weight (packed for
    oneDNN where the build can), small ones the kernels; both compute with the quantized weight."""
    from kiln.layers.linear import packing_works
    from kiln.layers.quant.linear import PACKED_DENSE_MIN_M, Int4Linear, Int8Linear

    g = torch.Generator().manual_seed(3)
    w = torch.randn(192, 256, generator=g)
    x = torch.randn(m, 256, generator=g).to(torch.bfloat16)
    for layer in (Int4Linear(_groups(192, 256), None, torch.bfloat16),
                  Int8Linear.from_float(w, None, torch.bfloat16)):
        want = x.float() @ layer.dequantize(torch.float32).t()
        plain = layer(x).float()
        layer.keep_dense()
        if isinstance(layer, Int4Linear) and layer.kernel == "q4":
            # kiln's q4_linear beats a dense copy at every size: none is made
            assert layer.dense is None
            assert (plain - want).abs().max() <= 0.02 * want.abs().max()
            continue
        assert layer.dense is not None and layer.dense.shape == (192, 256)
        assert layer.dense_packed == packing_works(torch.bfloat16)
        if layer.dense_packed:
            assert layer.dense_min_m == PACKED_DENSE_MIN_M
        got = layer(x).float()
        assert (got - want).abs().max() <= 0.02 * want.abs().max()
        if m < layer.dense_min_m:
            assert torch.equal(got, plain)  # below the threshold: the kernel, unchanged


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_linear_matches_f_linear_eager_and_compiled(dtype):
    """kiln::packed_linear on a oneDNN-packed weight: F.linear's numbers, also inside a
    torch.compile'd graph where the packed weight is a graph input (as in the decode step).
    33 rows are padded to 64 inside the op (ROWS_QUANTUM) and cut back."""
    import torch.nn.functional as F

    from kiln.layers.kernels.isa import cpu_native_bf16
    from kiln.layers.linear import pack_weight, packed_linear, packing_works

    if cpu_native_bf16():
        assert packing_works(torch.bfloat16), "oneDNN packs bf16 weights on a CPU with bf16"
    # Elsewhere pack_weight leaves the weight as it is and packed_linear is F.linear: the
    # numbers below must hold either way.
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    wp = pack_weight(w)
    assert wp.is_mkldnn == packing_works(dtype)

    def f(x: torch.Tensor, wp: torch.Tensor) -> torch.Tensor:
        return F.silu(packed_linear(x, wp, wp.is_mkldnn) + b)

    packed = wp.is_mkldnn
    compiled = torch.compile(lambda x, wp: F.silu(packed_linear(x, wp, packed) + b),
                             fullgraph=True)
    for m in (1, 5, 33):
        x = torch.randn(m, 64, generator=g).to(dtype)
        want = F.silu(F.linear(x, w) + b).float()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        assert torch.allclose(f(x, wp).float(), want, rtol=tol, atol=tol * 4)
        assert torch.allclose(compiled(x, wp).float(), want, rtol=tol, atol=tol * 4)
        got = packed_linear(x, wp, packed)
        assert got.shape == (m, 96) and got.is_contiguous()
    # A non-contiguous input (a slice of a wider activation) is accepted too.
    x = torch.randn(7, 128, generator=g).to(dtype)[:, ::2]
    assert torch.allclose(f(x, wp).float(), F.silu(F.linear(x, w) + b).float(), rtol=tol,
                          atol=tol * 4)


def test_int4_linear_keeps_fp32_activations_fp32():
    from kiln.layers.quant.linear import Int4Linear

    gq = _groups(64, 128)
    lin = Int4Linear(gq, torch.ones(64), torch.float32)
    x = torch.randn(5, 128)
    y = lin(x)
    assert y.dtype == torch.float32
    want = x @ gq.dequantize().t() + 1
    assert (y - want).abs().max() <= 0.02 * want.abs().max()


def test_int8_linear_matches_dense_on_both_paths():
    from kiln.layers.quant.linear import Int8Linear

    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(3))
    lin = Int8Linear.from_float(w, None, torch.bfloat16)
    for m in (1, 64):
        x = torch.randn(m, 64).to(torch.bfloat16)
        want = x.float() @ w.t()
        assert (lin(x).float() - want).abs().max() <= 0.03 * want.abs().max()


def test_reference_fallback_gives_the_native_numbers(monkeypatch):
    """Where the packed ops are missing, layers dequantize on the fly: same results. kiln's own
    kernels (the default where they run) give them too."""
    from kiln.layers.quant import linear

    gq = _groups(64, 128)
    x = torch.randn(4, 128).to(torch.bfloat16)
    native = linear.Int4Linear(gq, None, torch.bfloat16, use_kernels=False)
    kiln = linear.Int4Linear(gq, None, torch.bfloat16)
    w8 = torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    native8 = linear.Int8Linear.from_float(w8, None, torch.bfloat16, use_kernels=False)
    kiln8 = linear.Int8Linear.from_float(w8, None, torch.bfloat16)
    assert native.kernel != "q4" and not native8.q8
    monkeypatch.setattr(linear, "native_int4", lambda device_type: False)
    monkeypatch.setattr(linear, "native_int8", lambda device_type: False)
    ref = linear.Int4Linear(gq, None, torch.bfloat16, use_kernels=False)
    ref8 = linear.Int8Linear.from_float(w8, None, torch.bfloat16, use_kernels=False)
    assert not ref.native and not ref8.native
    for a, b in ((ref, native), (kiln, native), (ref8, native8), (kiln8, native8)):
        assert (a(x).float() - b(x).float()).abs().max() <= 0.02 * b(x).float().abs().max()
        torch.testing.assert_close(a.dequantize(torch.float32), b.dequantize(torch.float32),
                                   rtol=1e-2, atol=1e-2 * b.dequantize(torch.float32).abs().max())


def test_gguf_blocks_decode_like_the_gguf_package():
    """kiln's torch decoding of each GGUF block type equals gguf-py's numpy reference."""
    import gguf

    from kiln.layers.kernels.formats import GGML_TYPES, dequantize_blocks

    rng = np.random.default_rng(0)
    f16_at = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
              "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
    for tid, (name, _, nbytes) in GGML_TYPES.items():
        if name not in f16_at:
            continue
        raw = rng.integers(0, 256, (16, nbytes), dtype=np.uint8)
        for row in raw:  # finite fp16 scales
            for p in f16_at[name]:
                row[p:p + 2] = np.frombuffer(np.float16(rng.uniform(-1, 1)).tobytes(), np.uint8)
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(tid)).reshape(-1)
        got = dequantize_blocks(torch.from_numpy(raw.reshape(-1).copy()), name)
        np.testing.assert_array_equal(got.numpy(), want, err_msg=name)


def test_q4_1_blocks_become_int4_without_requantizing(gguf_path):
    """A GGUF Q4_1 matrix reaches Int4Linear as its own codes and scales (exact up to bf16
    rounding of scale and zero), never through a dense copy."""
    from kiln.layers.kernels.formats import GroupQuant
    from kiln.layers.quant.linear import Int4Linear
    from kiln.models.gguf import GGUFFile, gguf_tensor

    gf = GGUFFile(gguf_path)
    t = next(t for t in gf.tensors if t.type_name == "Q4_1" and t.name.endswith("ffn_up.weight"))
    gq = gguf_tensor(gf, t, keep_4bit=True)
    assert isinstance(gq, GroupQuant) and gq.q.max() <= 15
    dense = gguf_tensor(gf, t)
    assert torch.equal(gq.dequantize(), dense)
    lin = Int4Linear(gq, None, torch.bfloat16)
    err = (lin.dequantize(torch.float32) - dense).abs().max()
    assert err <= 0.01 * dense.abs().max()


def test_q4_0_form_gives_a_q4_0_tensor_its_own_blocks_back():
    """quantize_q4_0_groups of a tensor dequantized from Q4_0 blocks (gguf-py's quantizer)
    returns those blocks' codes and scales exactly: MLA's joined kv_b_proj re-packs losslessly."""
    import gguf

    from kiln.layers.kernels.formats import dequantize_blocks
    from kiln.layers.quant.linear import quantize_q4_0_groups

    w = np.random.default_rng(1).standard_normal((12, 128)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)  # [12, 4 blocks * 18 B]
    dense = dequantize_blocks(torch.from_numpy(raw.reshape(-1).copy()), "Q4_0").reshape(12, 128)
    gq = quantize_q4_0_groups(dense)
    blocks = raw.reshape(12, 4, 18)
    d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    qs = torch.from_numpy(blocks[..., 2:].copy())  # [12, 4, 16]: q[j] low, q[j + 16] high
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(12, 128)
    assert torch.equal(gq.scale, d) and torch.equal(gq.min, -8 * d)
    assert torch.equal(gq.q, q)
    assert torch.equal(gq.dequantize(), dense)


# --------------------------------------------------------------------------- SmolLM2 quality


@pytest.fixture(scope="module", params=MODES)
def quantized(request, gguf_path, smollm2_tokenizer):
    """One bf16 engine per mode (the only extra runners this file builds)."""
    from kiln import LLM

    quant, _, dense = request.param.partition("+")
    llm = LLM(str(gguf_path), tokenizer=smollm2_tokenizer, dtype="bfloat16",
              quantization=quant, dense_weights=bool(dense), max_model_len=1024,
              kv_cache_memory=64 << 20, max_num_seqs=8, max_num_batched_tokens=256)
    return request.param, llm


def test_quantization_swaps_every_linear_and_shrinks_the_weights(quantized, smollm2_runner):
    from kiln.layers.linear import Linear
    from kiln.layers.quant.linear import Int4Linear, Int8Linear

    mode, llm = quantized
    model = llm.engine.runner.model
    assert not any(isinstance(m, Linear) for m in model.modules())
    quantized_layers = [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    kinds = {type(m) for m in quantized_layers}
    # the tied Q8_0 embedding: where kiln's GGUF-block kernels are built the head runs on the
    # file's blocks (kiln.layers.quant.gguf_blocks, nothing re-rounded), else on int8 rows
    from kiln.layers import kernels
    from kiln.layers.quant import gguf_blocks
    head = model.lm_head
    if kernels.available():
        assert isinstance(head, gguf_blocks.KQuantLinear) and head.type_names == ["Q8_0"]
        assert kinds == ({Int8Linear} if mode == "int8" else {Int4Linear})
    else:
        assert isinstance(head, Int8Linear)
        assert kinds == ({Int8Linear} if mode == "int8" else {Int4Linear, Int8Linear})
    # Where kiln's kernels run every int4 layer runs q4_linear.
    assert all(m.kernel == "q4" for m in quantized_layers
               if isinstance(m, Int4Linear)) == kernels.available()
    fp32_bytes = smollm2_runner.weight_bytes
    if mode.endswith("+dense"):
        # Every quantized layer also holds its weight in bf16 (~1/2 of fp32 + the int4 copy),
        # except int4 layers on kiln's q4_linear, which beats the copy at every size; and the
        # int8 head on q8_linear (--batch-invariant).
        kept = [m for m in quantized_layers
                if not ((isinstance(m, Int4Linear) and m.kernel == "q4")
                        or getattr(m, "q8", False))]
        assert all(m.dense is not None and m.dense.dtype == torch.bfloat16 for m in kept)
        assert all(m.dense is None for m in quantized_layers if m not in kept)
        head_kept = isinstance(head, Int8Linear) and not head.q8
        assert (mode != "int4+dense") or (
            len(kept) == int(head_kept) if kernels.available() else len(kept) != 1)
        assert llm.engine.runner.weight_bytes < fp32_bytes * 0.75
        return
    assert all(m.dense is None for m in quantized_layers)
    # fp32 -> int8 is ~1/4 (+ scales); int4 ~1/6 (the lm_head stays 8-bit). A BlockEmbedding's
    # blocks are a view of the GGUF's map (lookups page in the rows they read), not a copy.
    emb = model.model.embed_tokens
    mapped = emb.blocks.numel() if isinstance(emb, gguf_blocks.BlockEmbedding) else 0
    assert llm.engine.runner.weight_bytes - mapped < fp32_bytes * (0.27 if mode == "int8" else 0.19)


def test_quantized_greedy_agrees_with_unquantized(quantized, smollm2_runner, smollm2_tokenizer):
    from kiln.layers import kernels
    from kiln.sampling_params import SamplingParams

    mode, llm = quantized
    # every row attends through attend_rows wherever kiln's kernels run (--batch-invariant)
    layers = llm.engine.runner.model.attention_layers()
    assert all(layer.kv.invariant == kernels.available() for layer in layers)
    prompts = [smollm2_tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                min_tokens=NEW_TOKENS))
    same = total = 0
    for ids, out in zip(prompts, outs):
        cont = out.outputs[0].token_ids
        assert len(cont) == NEW_TOKENS
        logits = smollm2_runner.prompt_logits(ids + cont)  # fp32, unquantized
        pred = logits[len(ids) - 1:-1].argmax(dim=-1).tolist()
        same += sum(a == b for a, b in zip(pred, cont))
        total += len(cont)
    assert same / total >= 0.90, f"{mode}: agrees at {same}/{total} positions"


def test_quantized_chat_still_says_paris(quantized):
    from kiln.sampling_params import SamplingParams

    mode, llm = quantized
    out = llm.chat([{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=24))
    text = out[0].outputs[0].text
    assert "Paris" in text, f"{mode}: {text!r}"


# --------------------------------------------------------------------------- torch.compile


def test_compiled_decode_gives_the_eager_tokens(tmp_path, monkeypatch):
    """--compile: decode steps run the compiled layer padded to a batch bucket (3 sequences in
    the bucket of 4, the pad rows on the scratch block); mixed steps stay eager. Then 4
    sequences over a shared 5-block cached prefix run the bucket's cascade graph. Greedy tokens
    are the eager ones in both cases."""
    from conftest import make_tiny_model, run_to_completion

    from kiln.engine.engine import Engine
    from kiln.sampling_params import SamplingParams
    from kiln.settings.engine_config import EngineConfig

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    folder = make_tiny_model("llama", tmp_path / "tiny")
    cfg = EngineConfig.of(model=str(folder), dtype="float32", kv_cache_memory=8 << 20,
                       max_num_seqs=4, max_num_batched_tokens=64, compile=True,
                       batch_invariant=False)  # (which turns compile and cascade off)
    eng = Engine(cfg)
    runner = eng.runner
    assert runner.graphs.buckets == [1, 2, 4] and runner.compile_seconds > 0
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
    prefix = torch.randint(0, 256, (5 * 16,), generator=g).tolist()
    shared = [prefix + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 20, 4)]
    calls = []
    run_compiled = runner.graphs.run

    def spy(model, ids, positions, meta):
        calls.append((ids.shape[0], meta.decode_shared is not None))
        return run_compiled(model, ids, positions, meta)

    monkeypatch.setattr(runner.graphs, "run", spy)
    graphs = runner.graphs
    outs = {}
    for compiled in (True, False):
        runner.graphs = graphs if compiled else None
        e = Engine(cfg, runner=runner)
        for i, p in enumerate(prompts):
            e.add_request(str(i), p, params)
        plain = run_to_completion(e)
        e.add_request("first", shared[0], params)  # publishes the prefix
        e.step()
        for i, p in enumerate(shared[1:]):
            e.add_request(f"s{i}", p, params)
        outs[compiled] = (plain, run_to_completion(e))
    assert outs[True] == outs[False]
    assert (4, False) in calls and {b for b, _ in calls} <= {1, 2, 4}  # padded buckets
    assert (4, True) in calls  # the cascade graph ran


def test_dense_bf16_linear_packs_and_keeps_its_numbers():
    """bf16 layers left dense on CPU are packed for oneDNN at load: same outputs, the weight
    becomes a (multiply-only) buffer; fp32 layers are left alone."""
    from torch import nn

    from kiln.layers.linear import MergedLinear, pack_linears, packing_works

    g = torch.Generator().manual_seed(7)
    model = nn.Sequential(MergedLinear(64, {"a": 32, "b": 64}, bias=True), nn.ReLU())
    lin = model[0]
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 64, generator=g))
        lin.bias.copy_(torch.randn(96, generator=g))
    model.to(torch.bfloat16)
    x = torch.randn(2, 5, 64, generator=g).to(torch.bfloat16)
    want = model(x)
    assert pack_linears(model, torch.float32) == 0 and not lin.packed
    packs = packing_works(torch.bfloat16)
    assert pack_linears(model) == (1 if packs else 0)
    assert lin.packed == packs and ("weight" in dict(lin.named_parameters())) != packs
    got = model(x)
    assert got.shape == want.shape == (2, 5, 96)
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
