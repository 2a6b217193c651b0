"""Prefix caching benchmark: 16 requests sharing a 1,000-token system prompt, time to first token
with prefix caching on vs off, measured in one run over one loaded model.

    .venv/bin/python benchmarks/prefix_cache.py            # SmolLM2 (embedded GGUF), CPU, fp32
    .venv/bin/python benchmarks/prefix_cache.py --burst    # also: all 16 arrive at once

Sequential mode (the default): each request arrives when the previous one has finished, as turns
of many users behind one system prompt do. TTFT = from `add_request` to the step that returns the
request's first token. With caching on, the first request is cold and the other 15 reuse the
system prompt's blocks; the ratio is mean TTFT off / mean TTFT on. Burst mode adds all 16 at once
(TTFT from the common start), with and without prefix rendezvous.

Prints a table and writes benchmarks/results/prefix_cache.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "prefix_cache.json"

SYSTEM_SEED = (
    "You are the support assistant of Northwind Outfitters, a shop for hiking and camping gear. "
    "Follow these rules. Greet the customer by name when you know it. Answer in at most three "
    "sentences. Never promise delivery dates; say that the warehouse confirms them by email. "
    "Returns are accepted within 30 days with the receipt; worn boots can be returned only if "
    "they are defective. Offer the size guide for boots and jackets. Do not discuss competitors. "
    "If the customer is angry, apologise once and offer a callback. Prices include VAT. "
)
QUESTIONS = [
    "Can I return a tent I used once?", "Do you ship to Norway?", "What size boots for 27 cm?",
    "Is the Alpine jacket waterproof?", "When will my order 1182 arrive?",
    "Do you price match?", "Can I pay in installments?", "Is there a student discount?",
    "My stove leaks gas, what now?", "Do you rent sleeping bags?", "How warm is the Polar bag?",
    "Can I change my delivery address?", "Do you sell gift cards?", "Are the socks merino?",
    "Where is your nearest store?", "Can I cancel my order?",
]


def build_prompts(tokenizer, system_tokens: int) -> tuple[list[int], list[list[int]]]:
    sys_ids: list[int] = []
    i = 0
    while len(sys_ids) < system_tokens:
        sys_ids = tokenizer.encode(" ".join(f"Rule set {k}. {SYSTEM_SEED}" for k in range(i + 1)))
        i += 1
    sys_ids = sys_ids[:system_tokens]
    return sys_ids, [sys_ids + tokenizer.encode("\nCustomer: " + q + "\nAssistant:",
                                                add_special_tokens=False) for q in QUESTIONS]


def run_sequential(engine, prompts, params) -> dict:
    ttft, outputs = [], []
    for i, ids in enumerate(prompts):
        t0 = time.perf_counter()
        engine.add_request(f"r{i}", ids, params)
        first = None
        toks: list[int] = []
        while engine.has_unfinished:
            for o in engine.step():
                if first is None and (o.outputs[0].token_ids or o.finished):
                    first = time.perf_counter() - t0
                toks.extend(o.outputs[0].token_ids)
        ttft.append(first)
        outputs.append(toks)
    return {"ttft": ttft, "outputs": outputs}


def run_burst(engine, prompts, params) -> dict:
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    first: dict[str, float] = {}
    toks: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for o in engine.step():
            if o.request_id not in first and (o.outputs[0].token_ids or o.finished):
                first[o.request_id] = time.perf_counter() - t0
            toks.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    order = [f"r{i}" for i in range(len(prompts))]
    return {"ttft": [first[r] for r in order], "outputs": [toks[r] for r in order]}


def summarize(name: str, res: dict, metrics: dict) -> dict:
    t = res["ttft"]
    return {
        "mode": name,
        "mean_ttft_s": statistics.mean(t),
        "p50_ttft_s": statistics.median(t),
        "first_ttft_s": t[0],
        "rest_mean_ttft_s": statistics.mean(t[1:]),
        "prefill_tokens": int(metrics["prefill_tokens"]),
        "prefix_hit_tokens": int(metrics["prefix_cache_hits_tokens"]),
        "prefix_query_tokens": int(metrics["prefix_cache_queries_tokens"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file or folder (default: embedded SmolLM2)")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--burst", action="store_true", help="also run all 16 arriving at once")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    from kiln.engine.engine import Engine
    from kiln.engine.model_runner import ModelRunner
    from kiln.models.loader import open_checkpoint
    from kiln.resolve.sources import default_model_path
    from kiln.sampling_params import SamplingParams
    from kiln.settings.engine_config import EngineConfig
    from kiln.tokenizer import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else default_model_path()
    base = {"model": str(model), "dtype": "float32", "device": "cpu", "max_model_len": 2048,
            "kv_cache_memory": 512 << 20, "max_num_seqs": 32, "max_num_batched_tokens": 512}
    t0 = time.perf_counter()
    runner = ModelRunner(EngineConfig.of(**base), open_checkpoint(model))
    load_s = time.perf_counter() - t0
    tok = load_tokenizer(model)
    sys_ids, prompts = build_prompts(tok, args.system_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    def engine(**kw) -> Engine:
        return Engine(EngineConfig.of(**{**base, **kw}), runner=runner)

    warm = engine(enable_prefix_caching=False)  # first-call allocations stay out of the numbers
    warm.add_request("warm", tok.encode("Warm up the kernels. " * 30), params)
    while warm.has_unfinished:
        warm.step()

    runs: list[dict] = []
    outputs: dict[str, list[list[int]]] = {}
    plan = [("sequential, cache off", run_sequential, {"enable_prefix_caching": False}),
            ("sequential, cache on", run_sequential, {"enable_prefix_caching": True})]
    if args.burst:
        plan += [("burst, cache off", run_burst, {"enable_prefix_caching": False}),
                 ("burst, cache on", run_burst, {"enable_prefix_caching": True}),
                 ("burst, cache on + rendezvous", run_burst,
                  {"enable_prefix_caching": True, "prefix_rendezvous_max_wait_ms": 10_000})]
    for name, fn, kw in plan:
        eng = engine(**kw)
        res = fn(eng, prompts, params)
        outputs[name] = res["outputs"]
        runs.append(summarize(name, res, eng.metrics()))
        print(f"  {name}: mean TTFT {runs[-1]['mean_ttft_s']:.3f} s", file=sys.stderr)

    by = {r["mode"]: r for r in runs}
    off, on = by["sequential, cache off"], by["sequential, cache on"]
    ratios = {
        "sequential_mean_ttft_off_over_on": off["mean_ttft_s"] / on["mean_ttft_s"],
        # Requests 2-16 only: the first one is cold in both modes.
        "sequential_warm_mean_ttft_off_over_on": off["rest_mean_ttft_s"] / on["rest_mean_ttft_s"],
        "sequential_p50_ttft_off_over_on": off["p50_ttft_s"] / on["p50_ttft_s"],
    }
    if args.burst:
        for mode in ("burst, cache on", "burst, cache on + rendezvous"):
            ratios[f"burst_mean_ttft_off_over_{mode.split(', ')[1].replace(' + ', '_')}"] = (
                by["burst, cache off"]["mean_ttft_s"] / by[mode]["mean_ttft_s"])
    ref = outputs["sequential, cache off"]
    identical = all(o == ref for o in outputs.values())

    print(f"\nprefix cache: {len(prompts)} requests, {len(sys_ids)}-token shared system prompt, "
          f"{args.max_tokens} new tokens each; {model.name}, fp32, "
          f"{torch.get_num_threads()} threads (model load {load_s:.1f} s)\n")
    head = f"{'mode':<30} {'mean TTFT':>10} {'p50':>8} {'first':>8} {'rest':>8} " \
           f"{'prefilled':>10} {'hit tok':>8}"
    print(head)
    print("-" * len(head))
    for r in runs:
        print(f"{r['mode']:<30} {r['mean_ttft_s']:>9.3f}s {r['p50_ttft_s']:>7.3f}s "
              f"{r['first_ttft_s']:>7.3f}s {r['rest_mean_ttft_s']:>7.3f}s "
              f"{r['prefill_tokens']:>10} {r['prefix_hit_tokens']:>8}")
    print()
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    print(f"greedy outputs identical across modes: {identical}")

    result = {
        "benchmark": "prefix_cache",
        "model": model.name,
        "device": "cpu",
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "num_requests": len(prompts),
        "system_prompt_tokens": len(sys_ids),
        "prompt_tokens": [len(p) for p in prompts],
        "max_tokens": args.max_tokens,
        "max_num_batched_tokens": base["max_num_batched_tokens"],
        "runs": runs,
        "ratios": ratios,
        "outputs_identical": identical,
        "note": "TTFT in seconds; sequential: each request arrives after the previous finished",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
