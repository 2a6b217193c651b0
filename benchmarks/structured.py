"""Structured output's cost: the grammar's milliseconds per constrained row per step, and c=16
throughput with every request constrained vs none, in alternating runs over one loaded model.

    .venv/bin/python benchmarks/structured.py                 # SmolLM2 (embedded GGUF), defaults
    .venv/bin/python benchmarks/structured.py --rounds 3 --tokens 96
    .venv/bin/python benchmarks/structured.py --constraint tool  # a forced tool call instead

Each run adds 16 requests at once (different prompts, sampled at temperature 0.8 with a seed
each) and steps the engine until all are done; every request makes exactly --tokens tokens:
the free ones with ignore_eos, the constrained ones under a JSON schema (an array of at least
100 person objects: keys, strings, integers, enums, nested arrays) that cannot be complete
before then (--constraint tool: the same schema as the arguments of a call that tool_choice
forces, in the hermes <tool_call> format: the grammar kiln builds for a named tool_choice,
kiln/server/tool_parsers.py). Runs alternate free, constrained, constrained, free, ... so a
drift of the machine's speed lands on both. Reported:

  * ms per constrained row: the engine's own counters of grammar work (filling the rows'
    bitmasks with llguidance, adding them to the logits, advancing the matchers by the sampled
    tokens) over each constrained run's sampled rows; the median of the runs;
  * step time and throughput (output tokens / wall time, prefill included), per mode, and the
    ratio constrained / free of each round's two runs (back to back), with their median.

Prints a table and writes benchmarks/results/structured-<time>.json.
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

ROOT = Path(__file__).resolve().parent.parent

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "city": {"type": "string"},
    "hobbies": {"type": "array", "items": {"enum": ["chess", "hiking", "music", "cooking"]}}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
SCHEMA = {"type": "array", "minItems": 100, "items": PERSON}
TOPICS = ["a football club", "a chess club", "a school class", "a choir", "a hiking group",
          "a startup", "a band", "a family", "a lab", "a kitchen crew", "a film crew", "a team",
          "a book club", "a village council", "a ship's crew", "a theatre troupe"]


def constraint(kind: str) -> object:
    from kiln.sampling_params import StructuredOutputsParams
    from kiln.server.tool_parsers import HermesParser

    if kind == "json":
        return StructuredOutputsParams(json=SCHEMA)
    args = {"type": "object", "properties": {"members": SCHEMA}, "required": ["members"]}
    return StructuredOutputsParams(grammar=HermesParser().call_grammar([("list_members", args)],
                                                                       1))


def run(llm, so: object | None, concurrency: int, tokens: int, tag: str) -> dict[str, float]:
    from kiln.sampling_params import SamplingParams

    eng = llm.engine
    before = eng.metrics()
    constrained = so is not None
    t0 = time.perf_counter()
    for i in range(concurrency):
        msgs = [{"role": "user", "content": f"List the members of {TOPICS[i % len(TOPICS)]} "
                 "as JSON: name, age, city, hobbies."}]
        ids = llm.tokenizer.apply_chat_template(msgs)
        eng.add_request(f"{tag}-{i}", ids, SamplingParams(
            temperature=0.8, seed=i, max_tokens=tokens, ignore_eos=not constrained,
            structured_outputs=so))
    out_tokens = 0
    while eng.has_unfinished:
        for o in eng.step():
            out_tokens += len(o.outputs[0].token_ids) + (o.outputs[0].stop_token_id is not None)
    wall = time.perf_counter() - t0
    after = eng.metrics()
    rows = after["structured_rows"] - before["structured_rows"]
    steps = after["steps"] - before["steps"]
    return {"wall_s": wall, "tokens": out_tokens, "tok_s": out_tokens / wall, "steps": steps,
            "step_ms": 1e3 * (after["step_seconds"] - before["step_seconds"]) / steps,
            "rows": rows,
            "grammar_s": after["structured_seconds"] - before["structured_seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="MODEL (default: embedded SmolLM2)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48, help="output tokens per request")
    ap.add_argument("--rounds", type=int, default=4, help="pairs of runs (after a warm-up pair)")
    ap.add_argument("--constraint", choices=["json", "tool"], default="json",
                    help="json: a JSON schema; tool: that schema as a forced call's arguments")
    ap.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE",
                    help="a kiln setting, as LLM(**settings) takes it (repeatable)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from kiln import LLM

    settings = dict(s.split("=", 1) for s in args.setting)
    settings.setdefault("kv_cache_memory", "512MiB")
    llm = LLM(args.model, **settings)
    print(f"loaded; {llm.config.dtype}, quantization {llm.config.quant.method}, "
          f"{llm.config.num_threads or 'default'} threads, "
          f"max_num_seqs {llm.config.scheduler.max_num_seqs}", flush=True)
    so = constraint(args.constraint)
    run(llm, None, args.concurrency, 8, "warm-free")  # kernels, caches
    run(llm, so, args.concurrency, 8, "warm-json")  # and the grammar's vocabulary, compile
    results: dict[str, list[dict[str, float]]] = {"free": [], "json": []}
    order = [("free", "json"), ("json", "free")]
    for r in range(args.rounds):
        for mode in order[r % 2]:
            res = run(llm, so if mode == "json" else None, args.concurrency, args.tokens,
                      f"{mode}{r}")
            results[mode].append(res)
            print(f"round {r} {mode:4s}: {res['tok_s']:7.1f} tok/s, step {res['step_ms']:6.1f} "
                  f"ms, wall {res['wall_s']:5.1f} s", flush=True)
    free, js = results["free"], results["json"]
    # Medians: on a shared machine one slow run should not move the figure. The ratio is taken
    # per round (its two runs are back to back), then the median of those.
    per_row = [1e3 * r["grammar_s"] / r["rows"] for r in js]
    ratios = [j["tok_s"] / f["tok_s"] for f, j in zip(free, js)]
    med = statistics.median
    summary = {"grammar_ms_per_row": med(per_row), "grammar_ms_per_row_runs": per_row,
               "grammar_ms_per_step_c": med(per_row) * args.concurrency,
               "tok_s_free": med(r["tok_s"] for r in free),
               "tok_s_json": med(r["tok_s"] for r in js),
               "throughput_ratio": med(ratios), "throughput_ratio_rounds": ratios,
               "step_ms_free": med(r["step_ms"] for r in free),
               "step_ms_json": med(r["step_ms"] for r in js)}
    print(f"\ngrammar work: {summary['grammar_ms_per_row']:.3f} ms per constrained row, median "
          f"(runs: {', '.join(f'{x:.3f}' for x in per_row)}); "
          f"{summary['grammar_ms_per_step_c']:.2f} ms per {args.concurrency}-row step")
    print(f"c={args.concurrency}: free {summary['tok_s_free']:.1f} tok/s, constrained "
          f"{summary['tok_s_json']:.1f} tok/s (medians); constrained / free per round: "
          f"{', '.join(f'{x:.3f}' for x in ratios)}, median {summary['throughput_ratio']:.3f}; "
          f"step {summary['step_ms_free']:.1f} vs {summary['step_ms_json']:.1f} ms")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = ROOT / "benchmarks" / "results" / f"structured-{stamp}.json"
    path.write_text(json.dumps({
        "args": vars(args), "machine": {"platform": platform.platform(),
                                        "cpus": os.cpu_count()},
        "config": {"dtype": llm.config.dtype, "quantization": llm.config.quant.method,
                   "num_threads": llm.config.num_threads,
                   "max_num_seqs": llm.config.scheduler.max_num_seqs},
        "runs": results, "summary": summary}, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
