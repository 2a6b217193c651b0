"""Writes the MoE benchmark models: random-weight GGUFs in Q4_0 that kiln and llama-server load.

    qwen3moe (default)  a scaled-down Qwen3-30B-A3B: 24 layers, hidden 1024, 64 experts of
                        width 384, 8 active per token
    deepseek2           a scaled-down DeepSeek-V2-Lite: MLA (q/kv LoRA ranks), 2 shared experts,
                        64 routed of width 352, 6 active, grouped top-k (see deepseek_config)
    qwen2moe            --full-size: Qwen1.5-MoE-A2.7B's shape, ~14 B parameters, ~8 GB

No MoE model ships in a package, and the values of the weights do not change speed, so the
benchmarks (benchmarks/compare, `kiln bench`) run these files, which llama-server loads too:
that checks that kiln's GGUF names and keys are llama.cpp's, and gives the peer.

    python benchmarks/moe_model.py                       # -> ~/.cache/kiln/bench-models/...
    python benchmarks/compare/run.py --model "$(python benchmarks/moe_model.py --print-path)"
    python benchmarks/moe_model.py --routing-report      # per-layer routing spread, measured
    python benchmarks/moe_model.py --arch deepseek2      # the DeepSeek-shaped model
    python benchmarks/moe_model.py --router random       # the first model (README history)
    python benchmarks/moe_model.py --full-size           # Qwen1.5-MoE-A2.7B-shaped, ~8 GB

What the values do change is *which experts run*, and so how many expert bytes a step reads.
The first model (`--router random`, on which the README's first MoE figures were measured)
sends almost every token to the same 8 experts. Its routers are random rows, but the cause is
the hidden states: random Q4_0 codes 0..15 have a mean of -0.5 scale, so every matrix carries a
rank-one common term, which the residual stream amplifies layer after layer until every token's
router input is nearly the same vector (cosine > 0.99 to the mean from layer 1 on, the rest of
rank ~9), so every router's logits are one fixed vector plus noise.

The default model (`--router spread`) routes like a trained one:
- each Q4_0 block's scale gets a random sign, which removes the common term at its source;
- token embeddings of std 1 (`--embed-std`) and sharp attention (`--qk-gain`: Qwen3's q/k
  norm weights, DeepSeek's q scale) keep each token's identity and context in the residual
  stream instead of an average of the context;
- the routers are fitted, layer by layer, to the hidden states kiln itself computes on a fixed
  English text (`FIT_TOKENS` of benchmarks/data/perplexity.txt): a Gaussian matrix over the
  whitened, centred router input, each expert's logit spread over the text set to
  `--logit-std` x exp(`--skew` x z_e), so that experts are unequally busy, as trained ones
  are. The fit runs in one prefill: a hook on each router sets its weights from its own input
  before the layer routes, so each layer is fitted to what the final layers below it compute.
  The fitted routers are then written into the file (F32, as llama-quantize leaves routers).
Measured on the 24-layer qwen3moe: with the first two changes alone, random router rows already
spread (the 8 busiest experts of 64 take <= 27% of a layer's tokens); the fit calibrates the
logit scale and the unequal popularity (90% of the routed tokens take ~46 of 64 experts rather
than ~52; a trained Qwen3-30B-A3B is reported to need about half of its experts for 90%).

`--routing-report` measures the spread with kiln's engine on the written file over text the
routers were not fitted on (`REPORT_TOKENS` of the same prose, a benchmark-style prompt of
random common words as the c=1 workload sends, and the greedy tokens decoded after it) and
prints, per MoE layer, the share of the k busiest experts, the routing entropy and the experts
never chosen.

The tokenizer (and so the vocabulary: 49152 tokens) is SmolLM2's, copied from the default
model's GGUF; `--tokenizer-from` takes another GGUF's. Q4_0 blocks are written directly (random
4-bit codes, one scale per block sized for weights of std ~0.02): quantizing 1.9 B random floats
would take minutes and change nothing that is measured.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kiln.models.config import ModelConfig
from kiln.models.gguf_writer import write_gguf
from kiln.paths import cache_dir

Q4_0_BLOCK = 18  # bytes per 32 weights: fp16 scale + 16 bytes of codes
ROUTERS = ("spread", "random")

# The fixed texts: the routers are fitted on one part of benchmarks/data/perplexity.txt (English
# prose) and the report measures another part, so the report shows how the routing generalises.
TEXT_FILE = REPO / "benchmarks" / "data" / "perplexity.txt"
FIT_TOKENS = (0, 1536)
REPORT_TOKENS = (2048, 3072)
REPORT_PROMPT_TOKENS = 107  # the c=1 workload's prompt length (benchmarks/compare/measure.py)
REPORT_DECODE_TOKENS = 64
# How far the fit's covariance is shrunk towards a multiple of the identity before whitening:
# unshrunk, directions the fit text barely spans (the embeddings of tokens it lacks) get huge
# weights, and text it did not see routes by them alone.
SHRINK = 0.5


Tensors = Iterator[tuple[str, np.ndarray]]


def random_q4_0(rng: np.random.Generator, *shape: int, std: float = 0.02,
                signed: bool = False) -> np.ndarray:
    """Random Q4_0 blocks for a weight of torch shape `shape` (last dim = input features):
    codes uniform in 0..15, w = (q - 8) * d, so std(w) = 4.6 d. `signed`: each block's d gets
    a random sign, so the codes' mean (-0.5 d) is no common term of the whole matrix."""
    *lead, k = shape
    blocks = int(np.prod(lead)) * (k // 32)
    raw = rng.integers(0, 256, size=(blocks, Q4_0_BLOCK), dtype=np.uint8)
    d = np.float16(std / 4.6)
    raw[:, :2] = np.frombuffer(np.array([d], dtype=np.float16).tobytes(), dtype=np.uint8)
    if signed:  # fp16's sign is bit 15: the high bit of the scale's second byte
        raw[:, 1] |= rng.integers(0, 2, size=blocks, dtype=np.uint8) << 7
    return raw.reshape(*lead, k // 32 * Q4_0_BLOCK)


# --------------------------------------------------------------------------- the models


def qwen3_config(a: argparse.Namespace, vocab: int) -> ModelConfig:
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=vocab, hidden_size=a.hidden,
        intermediate_size=a.expert_width * a.active, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1e6, qk_norm=True, num_experts=a.experts,
        num_experts_per_tok=a.active, moe_intermediate_size=a.expert_width,
        norm_topk_prob=True, bos_token_id=None, eos_token_ids=[2])


def qwen3_tensors(cfg: ModelConfig, a: argparse.Namespace) -> Tensors:
    """(llama.cpp name, array) for every tensor: Q4_0 blocks for matrices, F32 for the rest.
    With router "random" these are exactly the first benchmark model's bytes (the README's
    history); with "spread" the routers are placeholders that `fit_routers` replaces."""
    rng = np.random.default_rng(a.seed)
    signed = a.router != "random"
    h, v, e, w = cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.moe_intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

    def q4(*shape: int, std: float = 0.02) -> np.ndarray:
        return random_q4_0(rng, *shape, std=std, signed=signed)

    ones = np.ones(h, dtype=np.float32)
    yield "token_embd.weight", q4(v, h, std=a.embed_std)
    yield "output_norm.weight", ones
    yield "output.weight", q4(v, h)
    for i in range(cfg.num_hidden_layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", ones
        yield b + "attn_q.weight", q4(q, h)
        yield b + "attn_k.weight", q4(kv, h)
        yield b + "attn_v.weight", q4(kv, h)
        yield b + "attn_output.weight", q4(h, q)
        # q and k are normed per head, so their norms' weights set how sharp attention is
        yield b + "attn_q_norm.weight", np.full(cfg.head_dim, a.qk_gain, dtype=np.float32)
        yield b + "attn_k_norm.weight", np.full(cfg.head_dim, a.qk_gain, dtype=np.float32)
        yield b + "ffn_norm.weight", ones
        if a.router == "random":
            yield b + "ffn_gate_inp.weight", rng.normal(0, 1 / np.sqrt(h), (e, h)).astype(
                np.float32)
        else:
            yield b + "ffn_gate_inp.weight", np.zeros((e, h), dtype=np.float32)
        yield b + "ffn_gate_exps.weight", q4(e, w, h)
        yield b + "ffn_up_exps.weight", q4(e, w, h)
        yield b + "ffn_down_exps.weight", q4(e, h, w)


def deepseek_config(a: argparse.Namespace, vocab: int) -> ModelConfig:
    """DeepSeek-V2-Lite scaled down (its 2048 hidden, 10944 dense / 1408 expert widths and
    128/64/128 head dims by 1/2 to 1/4; 64 routed experts, 6 active, 2 shared, the first layer
    dense, as it has), with V3's grouped routing: sigmoid scores, the experts in 8 groups, the
    top 6 taken from the best 3 groups. V2-Lite itself routes by a plain top 6 of a softmax;
    V2's own grouping (a group scored by its best expert) is not what llama.cpp computes (it
    scores every grouped model's groups by their two best, as V3 does), so the benchmark uses
    V3's rule, on which both engines agree. `--q-lora-rank 0` gives V2-Lite's single q_proj."""
    return ModelConfig(
        architecture="DeepseekV3ForCausalLM", vocab_size=vocab, hidden_size=a.hidden,
        intermediate_size=a.dense_width, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.heads,
        head_dim=a.nope_dim + a.rope_dim, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=10000.0, num_experts=a.experts, num_experts_per_tok=a.active,
        moe_intermediate_size=a.expert_width,
        shared_expert_intermediate_size=a.shared_experts * a.expert_width,
        norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
        n_group=a.groups, topk_group=a.groups_used, routed_scaling_factor=1.0,
        dense_layers=frozenset(range(a.dense_layers)), q_lora_rank=a.q_lora_rank,
        kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.nope_dim,
        qk_rope_head_dim=a.rope_dim, v_head_dim=a.v_dim, rope_interleave=True,
        bos_token_id=None, eos_token_ids=[2])


def deepseek_tensors(cfg: ModelConfig, a: argparse.Namespace) -> Tensors:
    """The deepseek2 tensors as llama.cpp's converter writes them (MLA's kv_b split into
    attn_k_b [H, rank, nope] and attn_v_b [H, v, rank]), random Q4_0 matrices with signed
    scales, placeholder routers and a zero selection bias (`exp_probs_b`)."""
    rng = np.random.default_rng(a.seed)
    h, v, e, w = cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.moe_intermediate_size
    heads, r, p = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    qk = cfg.qk_nope_head_dim + p

    def q4(*shape: int, std: float = 0.02) -> np.ndarray:
        return random_q4_0(rng, *shape, std=std, signed=True)

    ones = np.ones(h, dtype=np.float32)
    yield "token_embd.weight", q4(v, h, std=a.embed_std)
    yield "output_norm.weight", ones
    yield "output.weight", q4(v, h)
    for i in range(cfg.num_hidden_layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", ones
        # MLA has no per-head q/k norm: q's scale sets how sharp attention is
        if cfg.q_lora_rank:
            yield b + "attn_q_a.weight", q4(cfg.q_lora_rank, h)
            yield b + "attn_q_a_norm.weight", np.ones(cfg.q_lora_rank, dtype=np.float32)
            yield b + "attn_q_b.weight", q4(heads * qk, cfg.q_lora_rank, std=0.02 * a.qk_gain)
        else:
            yield b + "attn_q.weight", q4(heads * qk, h, std=0.02 * a.qk_gain)
        yield b + "attn_kv_a_mqa.weight", q4(r + p, h)
        yield b + "attn_kv_a_norm.weight", np.ones(r, dtype=np.float32)
        yield b + "attn_k_b.weight", q4(heads, r, cfg.qk_nope_head_dim)
        yield b + "attn_v_b.weight", q4(heads, cfg.v_head_dim, r)
        yield b + "attn_output.weight", q4(h, heads * cfg.v_head_dim)
        yield b + "ffn_norm.weight", ones
        if i in cfg.dense_layers:
            yield b + "ffn_gate.weight", q4(cfg.intermediate_size, h)
            yield b + "ffn_up.weight", q4(cfg.intermediate_size, h)
            yield b + "ffn_down.weight", q4(h, cfg.intermediate_size)
            continue
        yield b + "ffn_gate_inp.weight", np.zeros((e, h), dtype=np.float32)
        yield b + "exp_probs_b.bias", np.zeros(e, dtype=np.float32)
        yield b + "ffn_gate_exps.weight", q4(e, w, h)
        yield b + "ffn_up_exps.weight", q4(e, w, h)
        yield b + "ffn_down_exps.weight", q4(e, h, w)
        s = cfg.shared_expert_intermediate_size
        yield b + "ffn_gate_shexp.weight", q4(s, h)
        yield b + "ffn_up_shexp.weight", q4(s, h)
        yield b + "ffn_down_shexp.weight", q4(h, s)


def qwen2_config(a: argparse.Namespace, vocab: int) -> ModelConfig:
    """Qwen1.5-MoE-A2.7B's shape (24 layers, hidden 2048, 60 experts of width 1408, 4 active,
    a gated shared expert of width 5632, q/k/v biases): ~14 B parameters, ~8 GB in Q4_0."""
    return ModelConfig(
        architecture="Qwen2MoeForCausalLM", vocab_size=vocab, hidden_size=a.hidden,
        intermediate_size=a.shared_width, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
        max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=1e6, attention_bias=True,
        num_experts=a.experts, num_experts_per_tok=a.active, moe_intermediate_size=a.expert_width,
        shared_expert_intermediate_size=a.shared_width, shared_expert_gate=True,
        norm_topk_prob=False, bos_token_id=None, eos_token_ids=[2])


def qwen2_tensors(cfg: ModelConfig, a: argparse.Namespace) -> Tensors:
    """The qwen2moe tensors, one at a time (the full-size file is written as they come).
    Without q/k norms, q's scale sets how sharp attention is; routers are `unfitted_router`'s
    unless a fit replaces them."""
    rng = np.random.default_rng(a.seed)
    h, v, e, w = cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.moe_intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    s = cfg.shared_expert_intermediate_size

    def q4(*shape: int, std: float = 0.02) -> np.ndarray:
        return random_q4_0(rng, *shape, std=std, signed=True)

    ones = np.ones(h, dtype=np.float32)
    yield "token_embd.weight", q4(v, h, std=a.embed_std)
    yield "output_norm.weight", ones
    yield "output.weight", q4(v, h)
    for i in range(cfg.num_hidden_layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", ones
        yield b + "attn_q.weight", q4(q, h, std=0.02 * a.qk_gain)
        yield b + "attn_q.bias", np.zeros(q, dtype=np.float32)
        yield b + "attn_k.weight", q4(kv, h)
        yield b + "attn_k.bias", np.zeros(kv, dtype=np.float32)
        yield b + "attn_v.weight", q4(kv, h)
        yield b + "attn_v.bias", np.zeros(kv, dtype=np.float32)
        yield b + "attn_output.weight", q4(h, q)
        yield b + "ffn_norm.weight", ones
        yield b + "ffn_gate_inp.weight", unfitted_router(rng, e, h, a.logit_std, a.skew)
        yield b + "ffn_gate_exps.weight", q4(e, w, h)
        yield b + "ffn_up_exps.weight", q4(e, w, h)
        yield b + "ffn_down_exps.weight", q4(e, h, w)
        yield b + "ffn_gate_inp_shexp.weight", rng.normal(0, h ** -0.5, h).astype(np.float32)
        yield b + "ffn_gate_shexp.weight", q4(s, h)
        yield b + "ffn_up_shexp.weight", q4(s, h)
        yield b + "ffn_down_shexp.weight", q4(h, s)


@dataclass
class Family:
    config: Any
    tensors: Any
    defaults: dict[str, Any]
    fit: bool = True  # routers fitted by a prefill through kiln (else `unfitted_router`'s)
    stream: bool = False  # tensors written as they come (larger than memory)


FAMILIES = {
    "qwen3moe": Family(qwen3_config, qwen3_tensors, {
        "layers": 24, "hidden": 1024, "experts": 64, "active": 8, "expert_width": 384,
        "heads": 16, "kv_heads": 4, "head_dim": 64, "qk_gain": 3.0}),
    "deepseek2": Family(deepseek_config, deepseek_tensors, {
        "layers": 24, "hidden": 1024, "experts": 64, "active": 6, "expert_width": 352,
        "heads": 16, "shared_experts": 2, "dense_layers": 1, "dense_width": 2816,
        "q_lora_rank": 384, "kv_lora_rank": 256, "nope_dim": 64, "rope_dim": 32, "v_dim": 64,
        "groups": 8, "groups_used": 3, "qk_gain": 8.0}),
    # --full-size: not fitted (the fit pass would hold the whole model in memory and prefill
    # 1.5k tokens through 14 B parameters), not benchmarked by this script
    "qwen2moe": Family(qwen2_config, qwen2_tensors, {
        "layers": 24, "hidden": 2048, "experts": 60, "active": 4, "expert_width": 1408,
        "shared_width": 5632, "heads": 16, "kv_heads": 16, "head_dim": 128, "qk_gain": 8.0},
        fit=False, stream=True),
}


# --------------------------------------------------------------------------- fitted routers


def _text_ids(tokenizer: Any, span: tuple[int, int]) -> list[int]:
    ids = tokenizer.encode(TEXT_FILE.read_text())
    if len(ids) < span[1]:
        raise SystemExit(f"{TEXT_FILE} has {len(ids)} tokens, fewer than {span[1]}")
    return list(ids[span[0]:span[1]])


def router_weights(x: np.ndarray, num_experts: int, rng: np.random.Generator,
                   logit_std: float, skew: float) -> np.ndarray:
    """Router rows [E, H] for router inputs x [T, H] (one layer's, over the fit text).

    Logits = G W (x - m): W whitens the inputs (their covariance shrunk towards a multiple of
    the identity, so that directions the fit text barely spans, such as the embeddings of
    tokens it lacks, are not blown up), G is Gaussian, so every expert's logit varies from
    token to token independently of the others'; the component along the mean input m is
    removed (it is nearly the same for every token: kept, it would decide the routing alone).
    Each row is then scaled so that its logit's spread over the text is
    `logit_std` x exp(`skew` x N(0, 1)): an expert whose logit swings wider is in the top k
    more often, so experts are unequally busy, as trained ones are, on any text (an offset
    would ride on some direction of the input, and none is the same for every text)."""
    x = x.astype(np.float64)
    t, h = x.shape
    mean = x.mean(0)
    xc = x - mean
    cov = xc.T @ xc / t
    cov = (1 - SHRINK) * cov + SHRINK * np.trace(cov) / h * np.eye(h)
    lam, vec = np.linalg.eigh(cov)
    rows = rng.standard_normal((num_experts, h)) @ ((vec / np.sqrt(lam)) @ vec.T)
    u = mean / np.linalg.norm(mean)
    rows -= np.outer(rows @ u, u)
    spread = logit_std * _popularity(rng, num_experts, skew)
    rows *= (spread / (xc @ rows.T).std(0))[:, None]
    return rows.astype(np.float32)


def _popularity(rng: np.random.Generator, num_experts: int, skew: float) -> np.ndarray:
    """exp(skew x z) over the normal's quantiles z, shuffled: every layer has the same profile
    of busy and idle experts, and no draw leaves an expert that never wins."""
    z = np.array([NormalDist().inv_cdf((i + 0.5) / num_experts) for i in range(num_experts)])
    return np.exp(skew * rng.permutation(z))


def unfitted_router(rng: np.random.Generator, num_experts: int, hidden: int, logit_std: float,
                    skew: float) -> np.ndarray:
    """Router rows without a fit: Gaussian, scaled for a router input of RMS 1 (what the MoE
    block's norm gives) to logits of spread `logit_std` x the `_popularity` profile. On the
    24-layer qwen3moe with these weights such rows spread as well as fitted ones (the 8
    busiest of 64 experts <= 27% of a layer's tokens), a little more evenly."""
    rows = rng.standard_normal((num_experts, hidden)) * hidden ** -0.5
    return (rows * (logit_std * _popularity(rng, num_experts, skew))[:, None]).astype(
        np.float32)


def _moe_blocks(model: Any) -> list[Any]:
    """The model's MoE blocks (a `gate` router and stacked `experts`), in layer order."""
    from kiln.layers.moe import Experts
    from kiln.layers.router import Router

    blocks = [m for m in model.modules()
              if isinstance(getattr(m, "gate", None), Router)
              and isinstance(getattr(m, "experts", None), Experts)]
    return sorted(blocks, key=lambda m: m.experts.layer)


def fit_routers(path: Path, ids: list[int], seed: int, logit_std: float,
                skew: float) -> dict[int, np.ndarray]:
    """{layer: router rows} fitted by one prefill of `ids` through kiln's model of `path`: a
    pre-hook on each router replaces its weights from its input before the layer routes, so
    each layer is fitted to the inputs that the already fitted layers below it produce."""
    import torch

    from kiln.engine.model_runner import ModelRunner
    from kiln.models.loader import open_checkpoint
    from kiln.settings.engine_config import EngineConfig

    cfg = EngineConfig.of(model=str(path), dtype="float32", compile=False,
                       max_num_batched_tokens=256, kv_cache_memory=16 << 20)
    runner = ModelRunner(cfg, open_checkpoint(path))
    fitted: dict[int, np.ndarray] = {}
    handles = []
    for block in _moe_blocks(runner.model):
        layer = block.experts.layer

        def hook(module: Any, args: tuple, layer: int = layer) -> None:
            rows = router_weights(args[0].float().numpy(), module.weight.shape[0],
                                  np.random.default_rng([seed, layer]), logit_std, skew)
            module.weight.data.copy_(torch.from_numpy(rows))
            fitted[layer] = rows

        handles.append(block.gate.register_forward_pre_hook(hook))
    try:
        runner._scratch_forward(torch.tensor(ids, dtype=torch.long), None)
    finally:
        for handle in handles:
            handle.remove()
    if len(fitted) != len(handles):
        raise RuntimeError(f"only {len(fitted)} of {len(handles)} routers ran in the fit pass")
    return fitted


def patch_tensors(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Overwrites F32 tensors of a written GGUF in place (same names, shapes and types)."""
    from kiln.models.gguf import GGUFFile

    infos = {t.name: t for t in GGUFFile(path).tensors}
    with open(path, "r+b") as f:
        for name, arr in arrays.items():
            t = infos[name]
            data = np.ascontiguousarray(arr, dtype=np.float32).tobytes()
            if t.type_name != "F32" or t.nbytes != len(data):
                raise ValueError(f"{name}: {t.type_name} of {t.nbytes} bytes, not F32 "
                                 f"{len(data)}")
            f.seek(t.offset)
            f.write(data)


# --------------------------------------------------------------------------- the report


@dataclass
class LayerRouting:
    layer: int
    counts: dict[str, list[int]]  # text -> tokens routed to each expert

    @staticmethod
    def top_share(counts: list[int], k: int) -> float:
        """Share of the routed (token, expert) pairs that the k busiest experts took."""
        return sum(sorted(counts, reverse=True)[:k]) / max(1, sum(counts))

    @staticmethod
    def coverage(counts: list[int], share: float) -> int:
        """How many of the busiest experts it takes to cover `share` of the routed pairs."""
        total, acc = sum(counts), 0
        for n, c in enumerate(sorted(counts, reverse=True), 1):
            acc += c
            if acc >= share * total:
                return n
        return len(counts)

    @staticmethod
    def entropy_bits(counts: list[int]) -> float:
        n = sum(counts)
        return -sum(c / n * math.log2(c / n) for c in counts if c) if n else 0.0


def routing_report(path: Path, tokenizer: Any) -> list[LayerRouting]:
    """Per MoE layer, the experts kiln's engine routes to on `path` over three texts it was not
    fitted on: a prose passage (one prefill), a benchmark-style prompt of random common words
    (the c=1 workload's), and the greedy tokens decoded after that prompt."""
    import random

    import torch

    from kiln.bench.workloads import make_text
    from kiln.engine.engine import Engine
    from kiln.sampling_params import SamplingParams
    from kiln.settings.engine_config import EngineConfig

    prose = _text_ids(tokenizer, REPORT_TOKENS)
    prompt = list(tokenizer.encode(make_text(random.Random("moe_model"), REPORT_PROMPT_TOKENS)))
    longest = max(len(prose) + 1, len(prompt) + REPORT_DECODE_TOKENS + 1)
    cfg = EngineConfig.of(model=str(path), compile=False, kv_cache_memory=128 << 20,
                       max_model_len=longest, max_num_batched_tokens=longest,
                       enable_prefix_caching=False)
    engine = Engine(cfg)

    def counts() -> torch.Tensor:
        c = engine.routing_counts()
        assert c is not None, "not a MoE model"
        return c

    def run(ids: list[int], max_tokens: int, first_step_only: bool = False) -> None:
        engine.add_request(f"r{len(runs)}", ids, SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        engine.step()  # the whole prompt in one step (max_num_batched_tokens covers it)
        runs.append(counts())
        if not first_step_only:
            while engine.has_unfinished:
                engine.step()
            runs.append(counts())

    runs: list[torch.Tensor] = [counts()]
    run(prose, 1, first_step_only=True)
    run(prompt, REPORT_DECODE_TOKENS + 1)
    parts = {"prose": runs[1] - runs[0], "prompt": runs[2] - runs[1],
             "decode": runs[3] - runs[2]}
    return [LayerRouting(layer, {k: v[i].tolist() for k, v in parts.items()})
            for i, layer in enumerate(engine.moe_layers)]


def format_report(rows: list[LayerRouting], k: int) -> str:
    e = len(rows[0].counts["prose"])
    head = (f"routing per MoE layer ({e} experts, top {k}): share of routed tokens the {k} "
            f"busiest experts took (uniform: {k / e:.1%}), entropy in bits (max "
            f"{math.log2(e):.2f}), experts never chosen")
    lines = [head, "", "| layer | " + " | ".join(
        f"{t} top-{k} | {t} bits | {t} unused" for t in rows[0].counts) + " |",
        "|---" * (1 + 3 * len(rows[0].counts)) + "|"]
    for r in rows:
        cells = []
        for c in r.counts.values():
            cells += [f"{r.top_share(c, k):.1%}", f"{r.entropy_bits(c):.2f}",
                      str(sum(1 for n in c if n == 0))]
        lines.append(f"| {r.layer} | " + " | ".join(cells) + " |")
    worst = {t: max(r.top_share(r.counts[t], k) for r in rows) for t in rows[0].counts}
    lines += ["", "worst layer: " + ", ".join(f"{t} {v:.1%}" for t, v in worst.items())]
    cover = {t: sorted(r.coverage(r.counts[t], 0.9) for r in rows)[len(rows) // 2]
             for t in rows[0].counts}
    lines.append("experts that take 90% of the routed tokens (median layer): " + ", ".join(
        f"{t} {n} of {e}" for t, n in cover.items()))
    tokens = {t: sum(rows[0].counts[t]) // k for t in rows[0].counts}
    lines.append("tokens routed per layer: " + ", ".join(f"{t} {n}" for t, n in tokens.items()))
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def default_path(a: argparse.Namespace) -> Path:
    suffix = ("" if a.router == "random" else
              f"-{a.router}" + ("" if FAMILIES[a.arch].fit else "-unfitted"))
    return cache_dir("bench-models") / (
        f"{a.arch}-{a.layers}L-{a.hidden}h-{a.experts}x{a.expert_width}"
        f"-top{a.active}-q4_0{suffix}.gguf")


def build(a: argparse.Namespace, out: Path, tok_gguf: Path, tokenizer: Any) -> None:
    from kiln.models.gguf import GGUFFile, read_gguf_metadata

    meta, _ = read_gguf_metadata(GGUFFile(tok_gguf))
    family = FAMILIES[a.arch]
    cfg = family.config(a, len(meta["tokenizer.ggml.tokens"]))
    t0 = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.stem + ".partial.gguf")  # a .gguf: the loader opens it to fit
    write_gguf(tmp, cfg, family.tensors(cfg, a), qtype="Q4_0", tokenizer_from=tok_gguf,
               name=f"kiln-bench-{a.arch}", stream=family.stream)
    print(f"wrote the weights in {time.monotonic() - t0:.0f} s")
    if a.router == "spread" and family.fit:
        t1 = time.monotonic()
        fitted = fit_routers(tmp, _text_ids(tokenizer, FIT_TOKENS), a.seed, a.logit_std,
                             a.skew)
        patch_tensors(tmp, {f"blk.{i}.ffn_gate_inp.weight": w for i, w in fitted.items()})
        print(f"fitted {len(fitted)} routers in {time.monotonic() - t1:.0f} s")
    tmp.replace(out)
    print(f"wrote {out} ({out.stat().st_size / 1e9:.2f} GB) in {time.monotonic() - t0:.0f} s")

SHAPE_OPTIONS = ("layers", "hidden", "experts", "active", "expert_width", "heads", "kv_heads",
                 "head_dim", "shared_experts", "dense_layers", "dense_width", "q_lora_rank",
                 "kv_lora_rank", "nope_dim", "rope_dim", "v_dim", "groups", "groups_used",
                 "shared_width")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=sorted(FAMILIES), default="qwen3moe")
    ap.add_argument("--full-size", action="store_true",
                    help="the Qwen1.5-MoE-A2.7B-shaped model (--arch qwen2moe: ~14 B "
                    "parameters, ~8 GB), written as it is generated; its routers are not "
                    "fitted")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--router", choices=ROUTERS, default="spread",
                    help="spread: fitted to route like a trained model (default); random: the "
                    "first benchmark model (random rows: nearly every token takes the same "
                    "experts), kept to reproduce the README's earlier figures (qwen3moe only)")
    ap.add_argument("--logit-std", type=float, default=1.0,
                    help="spread of a router logit over tokens (the median expert's)")
    ap.add_argument("--skew", type=float, default=0.25,
                    help="how unequally busy experts are: the experts' logit spreads are "
                    "--logit-std x exp(skew x N(0, 1)); 0: all alike")
    ap.add_argument("--embed-std", type=float, default=1.0,
                    help="token embedding std (large: the residual stream keeps each token's "
                    "identity instead of converging on one vector)")
    ap.add_argument("--qk-gain", type=float, default=None,
                    help="attention sharpness: qwen3moe's q/k norm weights, deepseek2's q "
                    "scale (per-family default)")
    for name in SHAPE_OPTIONS:  # a family's own, defaults in FAMILIES
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-from", type=Path, default=None)
    ap.add_argument("--force", action="store_true", help="write even if the file exists")
    ap.add_argument("--print-path", action="store_true", help="only print where it is written")
    ap.add_argument("--routing-report", action="store_true",
                    help="measure and print the routing spread per layer (writes the file "
                    "first if needed)")
    a = ap.parse_args(argv)
    if a.full_size:
        a.arch = "qwen2moe"
    defaults = FAMILIES[a.arch].defaults
    foreign = [k for k in SHAPE_OPTIONS if getattr(a, k) is not None and k not in defaults]
    if foreign:
        ap.error(f"{a.arch} has no " + ", ".join("--" + k.replace("_", "-") for k in foreign))
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.router == "random":
        if a.arch != "qwen3moe":
            ap.error("--router random is the first qwen3moe model only")
        a.qk_gain, a.embed_std = 1.0, 0.02  # that model's values
    if a.arch == "deepseek2" and a.q_lora_rank and a.layers in (26, 27):
        # llama.cpp takes a 26- or 27-layer deepseek2 for V2-Lite and reads no q_lora_rank
        ap.error("llama.cpp reads a 26/27-layer deepseek2 as V2-Lite: use --q-lora-rank 0")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    out = a.out or default_path(a)
    if a.print_path:
        print(out)
        return 0
    from kiln.tokenizer import default_gguf_path, load_tokenizer

    tok_gguf = a.tokenizer_from or default_gguf_path()
    tokenizer = load_tokenizer(tok_gguf)
    if out.exists() and not a.force:
        print(f"{out} exists (--force to rewrite)")
    else:
        build(a, out, tok_gguf, tokenizer)
    if a.routing_report:
        print(format_report(routing_report(out, tokenizer), a.active))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
