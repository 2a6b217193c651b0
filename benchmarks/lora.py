"""LoRA's cost: c=16 throughput with four adapters mixed in one batch vs the base model alone,
in alternating runs over one loaded model (the offline LLM, the same engine `kiln serve` runs).

    .venv/bin/python benchmarks/lora.py                      # SmolLM2 (embedded GGUF), defaults
    .venv/bin/python benchmarks/lora.py --rounds 3 --tokens 64 --rank 16

Four random PEFT adapters (every Llama linear targeted, rank --rank, random non-zero A and B)
are written to a temporary folder and loaded at startup. Each run adds 16 requests at once
(different prompts, greedy, ignore_eos, exactly --tokens tokens each) and steps the engine until
all are done: a "base" run asks for no adapter, a "lora" run for the four adapters, four
requests each, so every step mixes all four. Runs alternate base, lora, lora, base, ... so a
drift of the machine's speed lands on both. Reported: throughput (output tokens / wall time,
prefill included) per run, and each round's ratio lora / base, with their median and spread.

Prints a table and writes benchmarks/results/lora-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOPICS = ["the sea", "a mountain", "the city at night", "an old library", "a storm", "autumn",
          "a train journey", "the desert", "a lighthouse", "a small garden", "the moon",
          "a river", "a market", "snow", "a forest", "the first day of school"]


def write_adapter(folder: Path, mc, rank: int, seed: int, alpha: float = 16.0,
                  std: float = 0.02) -> Path:
    """A PEFT LoRA folder for the model config `mc` (kiln's ModelConfig): adapter_config.json
    and adapter_model.safetensors under PEFT's key names, A and B random (non-zero)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    hd = mc.head_dim
    shapes = {"q_proj": (mc.num_attention_heads * hd, mc.hidden_size),
              "k_proj": (mc.num_key_value_heads * hd, mc.hidden_size),
              "v_proj": (mc.num_key_value_heads * hd, mc.hidden_size),
              "o_proj": (mc.hidden_size, mc.num_attention_heads * hd),
              "gate_proj": (mc.intermediate_size, mc.hidden_size),
              "up_proj": (mc.intermediate_size, mc.hidden_size),
              "down_proj": (mc.hidden_size, mc.intermediate_size)}
    tensors = {}
    for layer in range(mc.num_hidden_layers):
        for t in TARGETS:
            out, inp = shapes[t]
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * std
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(TARGETS),
         "bias": "none", "lora_dropout": 0.0}))
    return folder


def run(llm, adapters: list[str | None], concurrency: int, tokens: int, tag: str
        ) -> dict[str, float]:
    from kiln.sampling_params import SamplingParams

    eng = llm.engine
    t0 = time.perf_counter()
    for i in range(concurrency):
        msgs = [{"role": "user", "content": f"Write a poem about {TOPICS[i % len(TOPICS)]}."}]
        ids = llm.tokenizer.apply_chat_template(msgs)
        eng.add_request(f"{tag}-{i}", ids, SamplingParams(
            temperature=0, max_tokens=tokens, ignore_eos=True,
            lora=adapters[i % len(adapters)]))
    steps = produced = 0
    while eng.has_unfinished:
        for o in eng.step():
            produced += len(o.outputs[0].token_ids)
        steps += 1
    wall = time.perf_counter() - t0
    return {"tokens": produced, "seconds": wall, "tok_s": produced / wall, "steps": steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="MODEL (default: the embedded SmolLM2)")
    ap.add_argument("--rounds", type=int, default=3, help="base/lora pairs (>= 3)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from kiln import LLM
    from kiln.startup import namespace_for, plan

    with tempfile.TemporaryDirectory() as tmp:
        mc = plan(namespace_for(args.model, {})).model_config
        names = [f"lora{i}" for i in range(args.adapters)]
        mods = [f"{n}={write_adapter(Path(tmp) / n, mc, args.rank, seed=i)}"
                for i, n in enumerate(names)]
        llm = LLM(args.model, lora_modules=mods, max_num_seqs=max(16, args.concurrency),
                  max_lora_rank=max(16, args.rank))
        print(f"loaded {args.model or 'smollm2'} with {len(names)} adapters of rank "
              f"{args.rank}", flush=True)
        run(llm, [None], 4, 8, "warm-base")  # first steps build kernels and caches
        run(llm, list(names), 4, 8, "warm-lora")
        print("warmed up", flush=True)
        rows = []
        for r in range(args.rounds):
            order = ("base", "lora") if r % 2 == 0 else ("lora", "base")
            got = {}
            for mode in order:
                got[mode] = run(llm, [None] if mode == "base" else list(names),
                                args.concurrency, args.tokens, f"{r}-{mode}")
            ratio = got["lora"]["tok_s"] / got["base"]["tok_s"]
            load = os.getloadavg()[0]  # other work on the machine skews a pair: say how much
            rows.append({"round": r, "order": list(order), **{f"{m}_{k}": v for m in got
                                                               for k, v in got[m].items()},
                         "ratio": ratio, "load1": load})
            print(f"round {r} ({'/'.join(order)}): base {got['base']['tok_s']:.1f} tok/s, "
                  f"lora {got['lora']['tok_s']:.1f} tok/s, ratio {ratio:.3f}, load {load:.1f}",
                  flush=True)
    ratios = [row["ratio"] for row in rows]
    summary = {"median_ratio": statistics.median(ratios), "min_ratio": min(ratios),
               "max_ratio": max(ratios)}
    print(f"lora / base throughput: median {summary['median_ratio']:.3f} "
          f"(min {summary['min_ratio']:.3f}, max {summary['max_ratio']:.3f}) over "
          f"{len(rows)} alternated pairs; {args.adapters} adapters of rank {args.rank}, "
          f"c={args.concurrency}, {args.tokens} tokens each")
    eff = llm.effective_config()
    out = args.out or ROOT / "benchmarks" / "results" / f"lora-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "load": os.getloadavg()},
        "args": {k: str(v) for k, v in vars(args).items()},
        "settings": {k: v["value"] for k, v in eff.get("settings", {}).items()
                     if k in ("dtype", "quantization", "compile", "batch_invariant",
                              "max_num_seqs", "num_threads")},
        "rounds": rows, "summary": summary}, indent=1, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
