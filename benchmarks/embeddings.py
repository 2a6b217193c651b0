"""Embedding throughput: kiln's embedder vs sentence-transformers, sentences/s, same batch size.

    PYTHONPATH=. .venv/bin/python benchmarks/embeddings.py                # all-MiniLM-L6-v2
    PYTHONPATH=. .venv/bin/python benchmarks/embeddings.py --batch 32 --rounds 5

Both embed the same sentences (short to medium, 10 to 60 tokens) in float32 on the CPU, at the
same batch size, tokenization included, in alternating rounds (kiln, reference, kiln, ...), so a
busy machine slows both alike; the medians are compared. kiln runs the serving path without HTTP:
`EmbeddingEngine` (the batching loop on its own thread, longest inputs first, as
sentence-transformers also sorts by length) over the encoder, each sentence tokenized as the
/v1/embeddings route does. The reference is sentence-transformers' `encode` (its Pooling and
Normalize modules) on a thread of its own, so neither side shares the other's OpenMP team.
sentence-transformers must be importable (installed with --no-deps next to kiln's torch); without
it, the reference is transformers' BertModel + mean pooling + normalize, and the JSON says so.

Prints a table and writes benchmarks/results/embeddings.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "embeddings.json"
DEFAULT_MODEL = Path.home() / ".cache" / "kiln" / "test-models" / "all-MiniLM-L6-v2"

_TEXT = ("the quick brown fox jumps over a lazy dog while engineers measure latency of servers "
         "in distant data centres and grandmothers bake bread for the village market every "
         "single morning before sunrise because tradition matters")
WORDS = _TEXT.split()


def make_sentences(n: int) -> list[str]:
    out = []
    for i in range(n):
        k = 8 + (i * 7) % 45  # 8 to 52 words
        out.append(" ".join(WORDS[(i + j * 3) % len(WORDS)] for j in range(k)).capitalize() + ".")
    return out


def kiln_runner(model: Path, batch: int) -> tuple[Callable[[list[str]], torch.Tensor], Callable]:
    from kiln.kinds.embedding import EmbeddingEngine, build_embedder
    from kiln.models.loader import open_checkpoint
    from kiln.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    engine = EmbeddingEngine(
        lambda: build_embedder(open_checkpoint(model), pooling_mode=None, dtype="float32",
                               device="cpu", num_threads=None, max_model_len=None),
        max_batch_tokens=1 << 30, max_batch_seqs=batch).start()

    def run(texts: list[str]) -> torch.Tensor:
        ids = [tok.encode(t) for t in texts]
        return asyncio.run(engine.embed(ids))

    return run, engine.shutdown


def reference_runner(model: Path, batch: int) -> tuple[Callable[[list[str]], torch.Tensor], str]:
    pool = ThreadPoolExecutor(1)  # the reference's own thread (and OpenMP team)
    try:
        from sentence_transformers import SentenceTransformer

        st = pool.submit(SentenceTransformer, str(model), device="cpu").result()

        def encode(texts: list[str]) -> torch.Tensor:
            return st.encode(texts, batch_size=batch, convert_to_tensor=True)

        name = "sentence-transformers " + __import__("sentence_transformers").__version__
    except ImportError:
        from transformers import AutoModel, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model))
        bert = pool.submit(lambda: AutoModel.from_pretrained(str(model)).eval()).result()

        def encode(texts: list[str]) -> torch.Tensor:
            order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
            out = torch.empty(len(texts), bert.config.hidden_size)
            for s in range(0, len(texts), batch):
                idx = order[s:s + batch]
                b = tok([texts[i] for i in idx], padding=True, truncation=True,
                        max_length=256, return_tensors="pt")
                with torch.inference_mode():
                    h = bert(**b).last_hidden_state
                m = b["attention_mask"].unsqueeze(-1).float()
                out[idx] = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)
            return out

        name = "transformers BertModel + mean pooling + normalize (no sentence-transformers)"
    return (lambda texts: pool.submit(encode, texts).result()), name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--sentences", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if not (args.model / "config.json").exists():
        print(f"{args.model} is not a model folder (tests/server/test_embeddings.py caches MiniLM "
              "there)", file=sys.stderr)
        return 2
    texts = make_sentences(args.sentences)
    kiln_embed, shutdown = kiln_runner(args.model, args.batch)
    ref_embed, ref_name = reference_runner(args.model, args.batch)
    a, b = kiln_embed(texts[:64]), ref_embed(texts[:64])  # warm-up, and agreement
    cos_min = float((a * b.cpu().float()).sum(-1).min())
    rates: dict[str, list[float]] = {"kiln": [], "reference": []}
    for r in range(args.rounds):
        for name, fn in (("kiln", kiln_embed), ("reference", ref_embed))[::1 if r % 2 == 0
                                                                          else -1]:
            t0 = time.perf_counter()
            fn(texts)
            rates[name].append(len(texts) / (time.perf_counter() - t0))
    shutdown()
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {
        "model": str(args.model.name), "sentences": len(texts), "batch": args.batch,
        "rounds": args.rounds, "threads": torch.get_num_threads(), "reference": ref_name,
        "kiln_sentences_per_s": round(med["kiln"], 1),
        "reference_sentences_per_s": round(med["reference"], 1),
        "ratio_kiln_over_reference": round(med["kiln"] / med["reference"], 3),
        "per_round": {k: [round(x, 1) for x in v] for k, v in rates.items()},
        "cosine_min_first_64": round(cos_min, 7),
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "load_average": os.getloadavg(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(f"{'':<10} {'sentences/s':>12}   rounds")
    for k in ("kiln", "reference"):
        print(f"{k:<10} {med[k]:>12.1f}   {', '.join(f'{x:.1f}' for x in rates[k])}")
    print(f"ratio kiln / reference: {result['ratio_kiln_over_reference']}  ({ref_name}; "
          f"batch {args.batch}, {len(texts)} sentences, cosine min {cos_min:.6f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
