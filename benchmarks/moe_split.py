"""MoE experts in one pool vs split across two pools (`--cpu-offload-experts`), in one process.

    .venv/bin/python benchmarks/moe_split.py                      # the MoE benchmark GGUF
    .venv/bin/python benchmarks/moe_split.py --model X.gguf --num-gpu-experts 32 --reps 3

Three engines over the same GGUF stay loaded and are measured round-robin (rep 1 of each, then
rep 2, ...), so they share the same stretch of a noisy machine:
  one     every expert in one pool (the default)
  even    split, the first N experts of each layer on the "device" pool, the rest on the host
          pool (--expert-calibration off): both pools get real work
  hot     split, the N hottest experts (calibration pass) on the device pool
On a machine without a GPU the "device" pool is the CPU too: by default both pools then run as
one (kiln/engine/expert_placement.py POOLS_ON_CPU), and the point is that a split costs nothing
there (issue 41: batch-1 decode >= 0.97x of one pool); with --pools they run as the two pools a
GPU machine runs (the device pool on the engine's threads, the host pool inline or a worker
thread), which measures the split path's own overhead. Each rep times one generate call per figure and mode, back to back (prefill:
one prompt; decode: batch 1 and 16, short prompts); a ratio is the median of the per-rep
ratios, which a drifting machine moves little. The GIL switch interval is set
as `kiln serve` sets it. Also printed: the calibration's routing load per layer (the share of
routed tokens the hot device pool takes).

Results: benchmarks/results/moe-split-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kiln.bench.offline import _timed_generate, random_prompts, word_token_pool
from kiln.engine.async_engine import GIL_SWITCH_INTERVAL_S
from kiln.llm import LLM


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="an MoE GGUF (default: the MoE benchmark model)")
    p.add_argument("--num-gpu-experts", type=int, default=None,
                   help="experts per layer on the device pool (default: half)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--prefill-len", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--kt-cpuinfer", type=int, default=None, help="host pool threads")
    p.add_argument("--pools", action="store_true",
                   help="on a CPU, run the split as two pools (the GPU path) instead of one")
    args = p.parse_args()
    if args.pools:
        from kiln.engine import expert_placement

        expert_placement.POOLS_ON_CPU = True
    model = args.model or _bench_model()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    base = {"kv_cache_memory": 256 << 20}
    split = {"cpu_offload_experts": True}
    if args.num_gpu_experts is not None:
        split["num_gpu_experts"] = args.num_gpu_experts
    if args.kt_cpuinfer is not None:
        split["kt_cpuinfer"] = args.kt_cpuinfer
    modes = {"one": base, "even": {**base, **split, "expert_calibration": "off"},
             "hot": {**base, **split}}
    llms = {}
    for name, kw in modes.items():
        t0 = time.perf_counter()
        llms[name] = LLM(model, **kw)
        print(f"loaded {name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    # Short measurements, round-robin: the machine's speed drifts (up to 2x within an hour, and
    # other work comes and goes), so each rep measures every mode within a few seconds, and the
    # ratios are taken rep by rep (median over reps).
    rng = random.Random(0)
    pool = word_token_pool(llms["one"])
    shapes = {"prefill": (1, args.prefill_len, 1), "decode_b1": (1, 8, args.decode_tokens),
              "decode_b16": (16, 8, args.decode_tokens)}
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    for llm in llms.values():  # warm every shape
        for batch, plen, gen in shapes.values():
            _timed_generate(llm, random_prompts(pool, batch, plen, rng), min(gen, 2))
    for rep in range(args.reps):
        for fig, (batch, plen, gen) in shapes.items():
            prompts = random_prompts(pool, batch, plen, rng)
            for name, llm in llms.items():
                seconds, produced = _timed_generate(llm, prompts, gen)
                tok_s = batch * plen / seconds if fig == "prefill" else produced / seconds
                runs[name].append({"rep": rep, "figure": fig, "tok_s": tok_s})
        print(f"rep {rep + 1}: " + "; ".join(
            f"{name} " + ", ".join(f"{r['figure']} {r['tok_s']:.1f}" for r in rs[-3:])
            for name, rs in runs.items()), file=sys.stderr)
    figures = list(shapes)

    def series(name: str, fig: str) -> list[float]:
        return [r["tok_s"] for r in runs[name] if r["figure"] == fig]

    med = {name: {fig: statistics.median(series(name, fig)) for fig in figures} for name in modes}
    ratio = {name: {fig: statistics.median(a / b for a, b in zip(series(name, fig),
                                                                  series("one", fig)))
                    for fig in figures} for name in ("even", "hot")}
    print(f"\nmodel: {model}\n{args.reps} reps; tok/s medians, ratios = median of per-rep "
          "ratios to one pool (prefill: whole call; decode: whole call of an 8-token prompt "
          f"and {args.decode_tokens} new tokens a sequence)\n")
    print("| figure (tok/s) | one pool | split, first N | ratio | split, hottest N | ratio |")
    print("|---|---|---|---|---|---|")
    for k in figures:
        print(f"| {k} | {med['one'][k]:.1f} | {med['even'][k]:.1f} | {ratio['even'][k]:.2f}x | "
              f"{med['hot'][k]:.1f} | {ratio['hot'][k]:.2f}x |")
    plans = {name: llms[name].effective_config().get("moe_placement") for name in ("even", "hot")}
    for name, plan in plans.items():
        print(f"\n{name}: {plan['num_device_experts']} of {plan['num_experts']} experts per layer"
              f" on the device pool; which: {plan['hot']}")
    hot_layers = plans["hot"]["layers"]
    even_share = _shares(llms["hot"], plans["even"])
    print("\nrouting load from the calibration pass (share of routed tokens on the device pool)")
    print("| layer | hottest N | first N |")
    print("|---|---|---|")
    for lp, share in zip(hot_layers, even_share):
        print(f"| {lp['layer']} | {100 * (lp['device_share'] or 0):.0f}% | {100 * share:.0f}% |")
    out = ROOT / "benchmarks" / "results" / f"moe-split-{time.strftime('%Y%m%d-%H%M%S')}.json"
    placement = {name: {k: v for k, v in plan.items() if k != "layers"}
                 for name, plan in plans.items()}
    placement["device_share"] = {
        "hot": [lp["device_share"] for lp in hot_layers], "even": even_share}
    out.write_text(json.dumps({"model": model, "modes": modes, "runs": runs, "median": med,
                               "ratio": ratio, "placement": placement}, indent=2, default=str))
    print(f"\n{out}")
    return 0


def _bench_model() -> str:
    """The MoE benchmark GGUF (benchmarks/moe_model.py writes it on first use)."""
    import subprocess

    script = str(ROOT / "benchmarks" / "moe_model.py")
    subprocess.run([sys.executable, script], check=True)
    out = subprocess.run([sys.executable, script, "--print-path"], check=True,
                         capture_output=True, text=True)
    return out.stdout.strip()


def _shares(hot_llm: LLM, even_plan: dict) -> list[float]:
    """The calibrated share of routed tokens that the first-N placement puts on the device."""
    from kiln.engine.expert_placement import load_calibration

    cfg = hot_llm.engine.config
    counts = load_calibration(cfg.gguf_file or cfg.model, cfg.quant.method,
                              len(even_plan["layers"]), even_plan["num_experts"]) or []
    return [sum(c[e] for e in lp["device_experts"]) / max(1, sum(c))
            for lp, c in zip(even_plan["layers"], counts)]


if __name__ == "__main__":
    raise SystemExit(main())
