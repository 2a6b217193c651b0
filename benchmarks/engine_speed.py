"""In-process engine speed: prefill tok/s (one 512-token prompt), decode tok/s at batch 1/8/32 and
load time, for each weight mode, with and without torch.compile.

    .venv/bin/python benchmarks/engine_speed.py                  # all modes, compile off and on
    .venv/bin/python benchmarks/engine_speed.py --modes bf16,bf16+int4 --compile off --quick

Modes: fp32, bf16, bf16+int8, bf16+int4 (dtype + weight-only quantization), bf16+int4+dense (int4
kernels for small steps, a bf16 copy of the weights for prefill and large batches: the CPU
default). Every runner stays loaded and the measurements go round-robin (rep 1 of every mode,
then rep 2, ...), so modes are compared over the same stretch of a noisy, shared machine; each
number is the best rep, and the JSON keeps every rep. "+compile" reuses the mode's runner,
toggling its compiled decode step, so compiled and eager are measured in the same process on the
same weights.

Results go to benchmarks/results/engine_speed.json (and a table on stdout).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kiln.engine.engine import Engine
from kiln.engine.model_runner import ModelRunner
from kiln.models.loader import open_checkpoint
from kiln.sampling_params import SamplingParams
from kiln.settings.engine_config import EngineConfig

# name -> (dtype, quantization, dense_weights)
MODES = {"fp32": ("float32", "none", False), "bf16": ("bfloat16", "none", False),
         "bf16+int8": ("bfloat16", "int8", False), "bf16+int4": ("bfloat16", "int4", False),
         "bf16+int4+dense": ("bfloat16", "int4", True)}
PREFILL_TOKENS = 512
DECODE_BATCHES = (1, 8, 32)
DECODE_PROMPT = 32  # tokens per decode request's prompt


def default_model() -> str:
    from kiln.resolve.sources import default_model_path

    return str(default_model_path())


class Bench:
    def __init__(self, name: str, model: str, dtype: str, quant: str, dense: bool, compile_: bool,
                 threads: int, max_batch: int, decode_steps: int, reps: int) -> None:
        self.name = name
        kv_tokens = max_batch * (DECODE_PROMPT + decode_steps + 2 * max_batch) + PREFILL_TOKENS
        per_token = 2 * 30 * 3 * 64 * (4 if dtype == "float32" else 2)  # SmolLM2-135M KV bytes
        self.cfg = EngineConfig.of(model=model, dtype=dtype, quantization=quant,
                                   dense_weights=dense, compile=compile_,
                                num_threads=threads, max_model_len=2048, max_num_seqs=max_batch,
                                max_num_batched_tokens=PREFILL_TOKENS,
                                kv_cache_memory=int(kv_tokens * per_token * 1.25),
                                enable_prefix_caching=False)
        t0 = time.monotonic()
        self.runner = ModelRunner(self.cfg, open_checkpoint(model))
        self.runner_seconds = time.monotonic() - t0 - self.runner.compile_seconds
        self.engine = Engine(self.cfg, runner=self.runner)
        self._graphs = self.runner.graphs
        self.ids = itertools.count()
        self.vocab = self.runner.model_config.vocab_size
        self.decode_steps = decode_steps
        self.results: dict[str, dict[str, list[float]]] = {}

    def use_compiled(self, on: bool) -> None:
        self.runner.graphs = self._graphs if on else None

    def _prompt(self, n: int) -> list[int]:
        g = torch.Generator().manual_seed(next(self.ids))
        return torch.randint(100, self.vocab - 100, (n,), generator=g).tolist()

    def prefill(self) -> float:
        eng = self.engine
        eng.add_request(f"p{next(self.ids)}", self._prompt(PREFILL_TOKENS),
                        SamplingParams(temperature=0.0, max_tokens=1))
        t = time.perf_counter()
        while eng.has_unfinished:
            eng.step()
        return PREFILL_TOKENS / (time.perf_counter() - t)

    def decode(self, batch: int) -> float:
        eng = self.engine
        n = self.decode_steps + 4
        ids = [f"d{next(self.ids)}" for _ in range(batch)]
        for rid in ids:
            eng.add_request(rid, self._prompt(DECODE_PROMPT),
                            SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n))
        reqs = [eng.scheduler.requests[r] for r in ids]
        while any(r.num_output_tokens < 2 for r in reqs):  # prefills done, first decode warm
            eng.step()
        t = time.perf_counter()
        for _ in range(self.decode_steps):
            eng.step()
        dt = time.perf_counter() - t
        for rid in ids:
            eng.abort(rid)
        eng.step()
        return batch * self.decode_steps / dt

    def measure(self, label: str, batches: tuple[int, ...]) -> None:
        r = self.results.setdefault(label, {})
        r.setdefault("prefill_tok_s", []).append(self.prefill())
        for b in batches:
            r.setdefault(f"decode_b{b}_tok_s", []).append(self.decode(b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF or HF folder (default: bundled SmolLM2)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--compile", choices=("off", "on", "both"), default="both")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=24)
    ap.add_argument("--batches", default=",".join(map(str, DECODE_BATCHES)))
    ap.add_argument("--quick", action="store_true", help="1 rep, 12 decode steps, batches 1,8")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" /
                    "engine_speed.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.decode_steps, args.batches = 1, 12, "1,8"
    batches = tuple(int(b) for b in args.batches.split(","))
    model = args.model or default_model()
    torch.set_num_threads(args.threads)
    compile_on = args.compile in ("on", "both")
    load_before = os.getloadavg()

    benches: list[Bench] = []
    for name in args.modes.split(","):
        dtype, quant, dense = MODES[name]
        b = Bench(name, model, dtype, quant, dense, compile_on, args.threads, max(batches),
                  args.decode_steps, args.reps)
        print(f"{name}: runner ready in {b.runner_seconds:.2f} s (weights {b.runner.load_seconds:.2f}"
              f" s, {b.runner.weight_bytes / 2**20:.0f} MiB)"
              + (f", compile {b.runner.compile_seconds:.1f} s" if compile_on else ""),
              flush=True)
        benches.append(b)

    variants = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    for rep in range(args.reps):
        for b in benches:
            for on in variants:
                b.use_compiled(on)
                b.measure(b.name + ("+compile" if on else ""), batches)
        print(f"rep {rep + 1}/{args.reps} done", flush=True)

    rows = []
    for b in benches:
        for label, r in b.results.items():
            row = {"mode": label, "load_seconds": round(b.runner.load_seconds, 3),
                   "runner_seconds": round(b.runner_seconds, 3),
                   "weight_mib": round(b.runner.weight_bytes / 2**20, 1)}
            if label.endswith("+compile"):
                row["compile_seconds"] = round(b.runner.compile_seconds, 2)
            for k, v in r.items():
                row[k] = round(max(v), 1)
                row[k.replace("_tok_s", "_median")] = round(statistics.median(v), 1)
            row["reps"] = {k: [round(x, 1) for x in v] for k, v in r.items()}
            rows.append(row)
    cols = ["prefill_tok_s"] + [f"decode_b{b}_tok_s" for b in batches]
    print(f"\n{'mode':<20}" + "".join(f"{c.replace('_tok_s', ''):>12}" for c in cols)
          + f"{'load s':>9}{'MiB':>7}")
    for row in rows:
        print(f"{row['mode']:<20}" + "".join(f"{row[c]:>12.1f}" for c in cols)
              + f"{row['load_seconds']:>9.2f}{row['weight_mib']:>7.0f}")
    out = {"model": model, "threads": args.threads, "torch": torch.__version__,
           "cpu": platform.processor() or platform.machine(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
           "reps": args.reps, "decode_steps": args.decode_steps,
           "prefill_tokens": PREFILL_TOKENS, "decode_prompt_tokens": DECODE_PROMPT,
           "note": "best of reps (medians alongside); modes measured round-robin in one "
                   "process", "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
