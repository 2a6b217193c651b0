"""Writes the MoE benchmark model: a random-weight Qwen3-MoE GGUF in Q4_0, shaped like a
scaled-down Qwen3-30B-A3B (24 layers, hidden 1024, 64 experts of width 384, 8 active per token).

No MoE model ships in a package, and the values of the weights do not change speed, so the
benchmark (benchmarks/compare, `kiln bench`) runs this file, which llama-server loads too: that
checks that kiln's GGUF names and keys are llama.cpp's, and gives the peer.

    python benchmarks/moe_model.py                       # -> ~/.cache/kiln/bench-models/...
    python benchmarks/compare/run.py --model "$(python benchmarks/moe_model.py --print-path)"

The tokenizer (and so the vocabulary: 49152 tokens) is SmolLM2's, copied from the default
model's GGUF; `--tokenizer-from` takes another GGUF's. Q4_0 blocks are written directly (random
4-bit codes, one scale per block sized for weights of std ~0.02): quantizing 1.9 B random floats
would take minutes and change nothing that is measured.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kiln.models.config import ModelConfig
from kiln.models.gguf_writer import write_gguf
from kiln.paths import cache_dir

Q4_0_BLOCK = 18  # bytes per 32 weights: fp16 scale + 16 bytes of codes


def random_q4_0(rng: np.random.Generator, *shape: int, std: float = 0.02) -> np.ndarray:
    """Random Q4_0 blocks for a weight of torch shape `shape` (last dim = input features):
    codes uniform in 0..15, w = (q - 8) * d, so std(w) = 4.6 d."""
    *lead, k = shape
    blocks = int(np.prod(lead)) * (k // 32)
    raw = rng.integers(0, 256, size=(blocks, Q4_0_BLOCK), dtype=np.uint8)
    d = np.float16(std / 4.6)
    raw[:, :2] = np.frombuffer(np.array([d], dtype=np.float16).tobytes(), dtype=np.uint8)
    return raw.reshape(*lead, k // 32 * Q4_0_BLOCK)


def bench_config(args: argparse.Namespace, vocab: int) -> ModelConfig:
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=vocab, hidden_size=args.hidden,
        intermediate_size=args.expert_width * args.active, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1e6, qk_norm=True, num_experts=args.experts,
        num_experts_per_tok=args.active, moe_intermediate_size=args.expert_width,
        norm_topk_prob=True, bos_token_id=None, eos_token_ids=[2])


def tensors(cfg: ModelConfig, seed: int):
    """(llama.cpp name, array) for every tensor: Q4_0 blocks for matrices, F32 for the rest."""
    rng = np.random.default_rng(seed)
    h, v, e, w = cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.moe_intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    ones = np.ones(h, dtype=np.float32)
    yield "token_embd.weight", random_q4_0(rng, v, h)
    yield "output_norm.weight", ones
    yield "output.weight", random_q4_0(rng, v, h)
    for i in range(cfg.num_hidden_layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", ones
        yield b + "attn_q.weight", random_q4_0(rng, q, h)
        yield b + "attn_k.weight", random_q4_0(rng, kv, h)
        yield b + "attn_v.weight", random_q4_0(rng, kv, h)
        yield b + "attn_output.weight", random_q4_0(rng, h, q)
        yield b + "attn_q_norm.weight", np.ones(cfg.head_dim, dtype=np.float32)
        yield b + "attn_k_norm.weight", np.ones(cfg.head_dim, dtype=np.float32)
        yield b + "ffn_norm.weight", ones
        # Router logits of std ~1: routing spreads over the experts as a trained one's does.
        yield b + "ffn_gate_inp.weight", rng.normal(0, 1 / np.sqrt(h), (e, h)).astype(np.float32)
        yield b + "ffn_gate_exps.weight", random_q4_0(rng, e, w, h)
        yield b + "ffn_up_exps.weight", random_q4_0(rng, e, w, h)
        yield b + "ffn_down_exps.weight", random_q4_0(rng, e, h, w)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--active", type=int, default=8)
    ap.add_argument("--expert-width", type=int, default=384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-from", type=Path, default=None)
    ap.add_argument("--force", action="store_true", help="write even if the file exists")
    ap.add_argument("--print-path", action="store_true", help="only print where it is written")
    args = ap.parse_args(argv)
    out = args.out or cache_dir("bench-models") / (
        f"qwen3moe-{args.layers}L-{args.hidden}h-{args.experts}x{args.expert_width}"
        f"-top{args.active}-q4_0.gguf")
    if args.print_path:
        print(out)
        return 0
    if out.exists() and not args.force:
        print(f"{out} exists (--force to rewrite)")
        return 0
    from kiln.tokenizer import default_gguf_path

    tok = args.tokenizer_from or default_gguf_path()
    from kiln.models.gguf import GGUFFile, read_gguf_metadata

    meta, _ = read_gguf_metadata(GGUFFile(tok))
    vocab = len(meta["tokenizer.ggml.tokens"])
    cfg = bench_config(args, vocab)
    t0 = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    write_gguf(tmp, cfg, tensors(cfg, args.seed), qtype="Q4_0", tokenizer_from=tok,
               name="kiln-bench-qwen3moe")
    tmp.replace(out)
    print(f"wrote {out} ({out.stat().st_size / 1e9:.2f} GB) in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
