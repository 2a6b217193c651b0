"""Per-layer speed of kiln's GGUF-block kernel (kiln/layers/kernels/kquant.cpp `kq_linear`) on
Qwen2.5-0.5B's layer shapes and types: the 8-row tiles (`gguf_blocks.pack`, the default), the raw
rows (the row-at-a-time kernel, what ran before the tiles) and the int4 re-quantization
(`--no-gguf-kernels`: q4_tiles.cpp's `q4_linear` on the same weights re-quantized).

    PYTHONPATH=. .venv/bin/python benchmarks/kquant_kernel.py [--threads 1] [--rounds 3]
        [--rows 1,16,64] [--lm-head]
    PYTHONPATH=. .venv/bin/python benchmarks/kquant_kernel.py --model MODEL.gguf [--rounds 3]

--model: the whole model instead, loaded twice in one process (the file's blocks, the default,
and --no-gguf-kernels' int4 re-quantization), then `kiln bench --offline`'s measurement
(kiln.bench.offline.run_offline: prefill, decode tok/s at c=1 and c=16) on each, alternated
per round; every pair is printed with the load average.

Each round times every (shape, rows, variant) as the minimum of --reps calls, the variants one
after the other (tiles, raw, int4, tiles, raw, int4, ...), so the machine's drift hits them
alike; printed per round with the ratios to int4, then the median over rounds. The weights are
random blocks with sane scales (speed does not depend on the values).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kiln.layers import kernels
from kiln.layers.kernels import ops, reference
from kiln.layers.quant import gguf_blocks
from kiln.layers.quant.linear import quantize_int4_groups

# (name, out rows, in features, ggml type): one Qwen2.5-Coder-0.5B Q4_K_M layer's linears
SHAPES = [("q", 896, 896, "Q5_0"), ("gate_up", 9728, 896, "Q5_0"), ("v", 128, 896, "Q8_0"),
          ("down", 896, 4864, "Q4_K"), ("down", 896, 4864, "Q6_K")]
LM_HEAD = ("lm_head", 151936, 896, "Q8_0")


def best(fn, reps: int) -> float:
    fn()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return min(t)


def whole_model(path: str, rounds: int, out: Path | None) -> None:
    from kiln.bench.offline import run_offline
    from kiln.llm import LLM

    llms = {}
    for name, kw in [("native", {}), ("requant", {"gguf_kernels": False})]:
        t0 = time.perf_counter()
        llms[name] = LLM(path, kv_cache_memory="256MiB", max_model_len=1024, **kw)
        print(f"{name} loaded in {time.perf_counter() - t0:.1f} s, load {os.getloadavg()}",
              flush=True)
    rows = []
    for r in range(rounds):
        for name, llm in llms.items():
            res = run_offline(llm=llm, prefill_len=256, batch_sizes=(1, 16), decode_tokens=32,
                              repeats=1)
            row = {"round": r, "variant": name, "load": os.getloadavg()[0],
                   "prefill_tok_s": res.prefill_tok_s, **{f"c{d.batch}": d.tok_s for d in res.decode}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if out:
        out.write_text(json.dumps(rows, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--lm-head", action="store_true", help="add the 151936 x 896 Q8_0 lm_head")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--model", help="a GGUF: whole-model decode, native vs re-quantized")
    args = ap.parse_args()
    if args.model:
        whole_model(args.model, args.rounds, args.json)
        return
    assert kernels.available(), "needs kiln's CPU kernels"
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    layers = []
    for name, n, k, t in SHAPES + ([LM_HEAD] if args.lm_head else []):
        b = reference.random_blocks(n, k, t, g)
        gq = quantize_int4_groups(b.dequantize())
        layers.append((f"{name} {n}x{k} {t}", b, gguf_blocks.pack(b),
                       reference.pack_q4(gq.q, gq.scale, gq.min)))
    ms = [int(m) for m in args.rows.split(",")]
    res: dict[str, dict[str, list[float]]] = {}
    print(f"threads {args.threads}, load average {os.getloadavg()}")
    for r in range(args.rounds):
        for label, b, tiles, q4 in layers:
            n, k = b.shape
            for m in ms:
                x = torch.randn(m, k, generator=g)
                calls = {
                    "tiles": lambda x=x, w=tiles, t=b.type_id, n=n: gguf_blocks.kq_linear(x, [w], [t], [n]),
                    "rows": lambda x=x, w=b.raw, t=b.type_id, n=n: gguf_blocks.kq_linear(x, [w], [t], [n]),
                    "int4": lambda x=x, w=q4, n=n: ops.q4_linear(x, w, n)}
                v = {name: best(fn, args.reps) for name, fn in calls.items()}
                key = f"{label} M={m}"
                for name, s in v.items():
                    res.setdefault(key, {}).setdefault(name, []).append(s)
                print(f"round {r} {key:34s} tiles {v['tiles'] * 1e6:8.0f} us  rows "
                      f"{v['rows'] * 1e6:8.0f} us  int4 {v['int4'] * 1e6:8.0f} us   tiles/int4 "
                      f"{v['tiles'] / v['int4']:.2f}  rows/int4 {v['rows'] / v['int4']:.2f}",
                      flush=True)
    print(f"median over {args.rounds} rounds (load average {os.getloadavg()}):")
    for key, v in res.items():
        md = {name: statistics.median(s) for name, s in v.items()}
        print(f"  {key:34s} tiles {md['tiles'] * 1e6:8.0f} us  rows {md['rows'] * 1e6:8.0f} us  "
              f"int4 {md['int4'] * 1e6:8.0f} us  tiles/int4 "
              f"{statistics.median(a / c for a, c in zip(v['tiles'], v['int4'])):.2f}  "
              f"rows/tiles {statistics.median(a / c for a, c in zip(v['rows'], v['tiles'])):.2f}")
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "results": res}, indent=1))


if __name__ == "__main__":
    main()
