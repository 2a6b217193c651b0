"""Speculative decoding (n-gram, or a draft model) on vs off in kiln's engine, interleaved A/B.

One model load; two engines over the same runner (so the same weights, KV pool and kernels):
"off" (plain decode) and "on" (--speculative-method ngram, or --draft MODEL: the draft model
method, --speculative-model; K fixed or auto). Each pair runs
the same workload on off, then on (the order alternates between pairs, so a drift of the
machine's load does not favour one side), and reports tokens/s of each and the on/off ratio.

Workloads:
  single  one stream, a code-editing prompt (rename a variable in ~40 lines of Python and show
          the whole file): the answer repeats most of the prompt, n-gram's best case
  write   one stream, new code (an LRU cache class): little of the answer is in the prompt
  c2, c4  2 or 4 streams at once (code editing and passage quoting, alternating)
  c16     16 streams at once (each a code-editing or a passage-quoting prompt): throughput

    python benchmarks/speculative.py [MODEL] --pairs 3 --max-tokens 128 --k 4 --threads 2
    python benchmarks/speculative.py QWEN_1.5B.gguf --draft QWEN_0.5B.gguf --workloads single,c4

Each pair's line carries the 1-minute load average before it (other work on the machine).

Greedy (temperature 0) everywhere; the script also checks that each on/off pair produced the
same tokens. Results as JSON lines with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

CODE = '''import csv
from dataclasses import dataclass


@dataclass
class Order:
    order_id: str
    customer: str
    amount: float


def load_orders(path):
    """Read orders from a CSV file with columns order_id, customer, amount."""
    orders = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            orders.append(Order(row["order_id"], row["customer"], float(row["amount"])))
    return orders


def total_by_customer(orders):
    """Sum the amount of every order per customer."""
    totals = {}
    for order in orders:
        totals[order.customer] = totals.get(order.customer, 0.0) + order.amount
    return totals


def largest_orders(orders, n=3):
    """The n orders with the largest amount, largest first."""
    return sorted(orders, key=lambda order: order.amount, reverse=True)[:n]
'''
PASSAGE = ("The harbour of Velmora was built in stone in the twelfth century. Ships from the "
           "southern islands brought salt, wool and glass to the harbour of Velmora, and the "
           "merchants of Velmora sent grain and timber back. When the river silted up, the "
           "harbour of Velmora moved two miles west, and the old quay became a market.")
EDIT = [{"role": "user", "content": "Rename the variable `order` to `o` everywhere in this code "
         "and show the whole file:\n\n" + CODE}]
QUOTE = [{"role": "user", "content": "Repeat this passage word for word, then give it a title:"
          "\n\n" + PASSAGE}]
WRITE = [{"role": "user", "content": "Write a Python class LRUCache with get(key) and "
          "put(key, value) in O(1), a capacity set in __init__, type hints and docstrings, "
          "then three unit tests for it."}]


def run(engine, prompts: list[list[int]], params, cold: bool = False
        ) -> tuple[float, int, list[list[int]], int]:
    """Seconds, output tokens, the tokens of each prompt, steps.

    The two engines share one KV pool but each has its own prefix cache, so each run starts by
    dropping its engine's cache (the other engine has written over those blocks). Warm (the
    default): the prompts are then run untimed (max_tokens=2: the second token is drafted for,
    so a draft model prefills them too), and the timed run measures decoding on both sides;
    `cold`:
    nothing is cached, the timed run includes every prompt's prefill (the draft's as well)."""
    from kiln.sampling_params import SamplingParams

    engine.kv.reset_prefix_cache()
    drafter = getattr(engine, "drafter", None)
    if cold:
        if drafter is not None:
            drafter.kv.reset_prefix_cache()
    else:
        warm = SamplingParams(temperature=0.0, max_tokens=2)
        for i, ids in enumerate(prompts):
            engine.add_request(f"w{time.monotonic_ns()}-{i}", ids, warm)
        while engine.has_unfinished:
            engine.step()
    for i, ids in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", ids, params)
    outs: dict[str, list[int]] = {}
    steps0 = engine.stats.steps
    t0 = time.perf_counter()
    while engine.has_unfinished:
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    dt = time.perf_counter() - t0
    toks = [outs[k] for k in sorted(outs, key=lambda k: int(k.rsplit("-", 1)[1]))]
    return dt, sum(len(t) for t in toks), toks, engine.stats.steps - steps0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="MODEL (default: the shipped SmolLM2)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", default="4", help="K, or auto")
    ap.add_argument("--workloads", default="single,c16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cold", action="store_true",
                    help="time the prompts' prefill too (no prefix cache on either side)")
    ap.add_argument("--draft", default=None,
                    help="draft MODEL (--speculative-model) instead of n-gram drafts")
    ap.add_argument("--vary", default=None, metavar="SETTING=V1,V2",
                    help="one 'on' engine per value of an engine setting, each in every pair "
                    "(e.g. speculative_draft_vocab=0,32768 or speculative_prompt_lookup=0,8)")
    args = ap.parse_args()

    from kiln import LLM
    from kiln.engine.engine import Engine
    from kiln.sampling_params import SamplingParams

    kw = {"max_model_len": 2048, "compile": False}
    if args.threads:
        kw["num_threads"] = args.threads
    if args.dtype:
        kw["dtype"] = args.dtype
    llm = LLM(args.model, **kw)
    off = llm.engine
    k = None if args.k == "auto" else int(args.k)
    if args.draft:
        from kiln.resolve.sources import resolve_model

        src = resolve_model(args.draft)
        method = {"speculative_model": str(src.gguf_file or src.path)}
    else:
        method = {"speculative_method": "ngram"}
    name, _, values = (args.vary or "").partition("=")
    ons = {}  # label -> engine: "on", or "on/SETTING=V" per --vary value
    for v in (values.split(",") if args.vary else [None]):
        extra = {} if v is None else {name: int(v) if v.lstrip("-").isdigit() else v}
        ons["on" if v is None else f"on/{name}={v}"] = Engine(
            off.config.replace(**method, **extra,
                               num_speculative_tokens=k if k is not None else "auto"),
            runner=off.runner, tokenizer=llm.tokenizer)
    edit = llm.tokenizer.apply_chat_template(EDIT)
    quote = llm.tokenizer.apply_chat_template(QUOTE)
    write = llm.tokenizer.apply_chat_template(WRITE)
    workloads = {"single": [edit], "write": [write], "c2": [edit, quote],
                 "c4": [edit if i % 2 == 0 else quote for i in range(4)],
                 "c16": [edit if i % 2 == 0 else quote for i in range(16)]}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    print(f"model={llm.engine.config.model} dtype={off.config.dtype} "
          f"quantization={off.config.quant.method} threads={off.config.num_threads} "
          f"K={args.k} max_tokens={args.max_tokens} draft={args.draft}", flush=True)
    run(off, [edit], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    for on in ons.values():
        run(on, [edit], SamplingParams(temperature=0.0, max_tokens=4))
    lines = []
    for name in args.workloads.split(","):
        ratios: dict[str, list[float]] = {label: [] for label in ons}
        for pair in range(args.pairs):
            res = {}
            load = os.getloadavg()[0]
            order = [("off", off), *ons.items()]
            if pair % 2:
                order.reverse()  # a drift of the machine's load favours no side
            for label, eng in order:
                before = eng.spec.stats.num_draft_tokens if eng.spec else 0
                acc0 = eng.spec.stats.num_accepted_tokens if eng.spec else 0
                rows0 = eng.spec.stats.num_drafts if eng.spec else 0
                dt, n, toks, steps = run(eng, workloads[name], params, cold=args.cold)
                res[label] = {"seconds": dt, "tokens": n, "tok_s": n / dt, "steps": steps,
                              "toks": toks}
                if eng.spec:
                    drafted = eng.spec.stats.num_draft_tokens - before
                    res[label]["acceptance"] = ((eng.spec.stats.num_accepted_tokens - acc0)
                                                / drafted if drafted else 0.0)
                    rows = eng.spec.stats.num_drafts - rows0
                    # tokens a drafted row emits per step: 1 + accepted / drafted rows
                    res[label]["tokens_per_row_step"] = (
                        1 + (eng.spec.stats.num_accepted_tokens - acc0) / rows if rows else 1.0)
            off_toks = res["off"].pop("toks")
            for label in ons:
                same = res[label].pop("toks") == off_toks
                ratio = res[label]["tok_s"] / res["off"]["tok_s"]
                ratios[label].append(ratio)
                lines.append({"workload": name, "pair": pair, "variant": label,
                              "same_tokens": same, "ratio": ratio, "loadavg": load,
                              "off": res["off"], "on": res[label]})
                r = res[label]
                print(f"{name} pair {pair}: off {res['off']['tok_s']:.2f} tok/s "
                      f"({res['off']['steps']} steps), {label} {r['tok_s']:.2f} tok/s "
                      f"({r['steps']} steps, acceptance {r.get('acceptance', 0) * 100:.0f}%, "
                      f"{r.get('tokens_per_row_step', 1):.2f} tok/step per row), "
                      f"ratio {ratio:.2f}, same tokens: {same}, load {load:.1f}", flush=True)
        for label, rs in ratios.items():
            print(f"{name}: {label}/off median {statistics.median(rs):.2f} "
                  f"(min {min(rs):.2f}, max {max(rs):.2f}, {len(rs)} pairs)", flush=True)
    if args.out:
        with args.out.open("a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
