"""Perplexity of a model as kiln serves it, measured through the server (its `prompt_logprobs`),
for several ways of loading the same GGUF, plus their start time, peak RSS and decode speed.

    .venv/bin/python benchmarks/perplexity.py MODEL.gguf
    .venv/bin/python benchmarks/perplexity.py MODEL.gguf --variant f32="--quantization none" \\
        --variant requant="--no-gguf-kernels" --variant native="" --speed

Each variant is one `kiln serve MODEL <flags>` (fp32 activations on a CPU without bf16, the
machine's defaults otherwise). The text (default benchmarks/data/perplexity.txt: the US
Declaration of Independence, the Gettysburg Address and Genesis 1-2 in the King James
Version, all public domain, typed in for this benchmark) is tokenized by the server
(/tokenize) and cut, as llama.cpp's llama-perplexity does, into non-overlapping windows of
--ctx tokens; each window is one /v1/completions request with the window's token ids as the
prompt and `prompt_logprobs: 0`; the tokens of the second half of each window (positions
ctx/2 + 1 .. ctx - 1, each predicted from at least ctx/2 tokens of context) are scored:
ppl = exp(mean negative log-likelihood). So every variant scores the same tokens with the same
contexts, through the one path the API serves.

The peer to compare with is llama.cpp's `llama-perplexity -m MODEL.gguf -f
benchmarks/data/perplexity.txt -c 512` (it prints `Final estimate: PPL = ...`): same windows
and scored half; it puts a BOS token at the start of each window where the vocabulary asks for
one (Qwen2's does not), so on such models its numbers are a little lower than this script's.

--llama-perplexity PATH runs that binary on the same file, text and window (-c, -t --threads)
and adds its estimate to the results, with each variant's ratio to it.

--speed adds decode throughput: all variants' servers stay up, and rounds alternate between
them (A, B, C, A, B, C, ...): per round and variant, 1 request (c=1) and then 16 at once
(c=16) of --tokens greedy tokens each (ignore_eos); tokens/s = generated tokens / wall time of
the round (the short prompts' prefill included). Reported per variant: each round's value and
the ratio to the first variant in the same round (median and spread).

Writes benchmarks/results/perplexity-<time>.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.compare.peers import Launch
from benchmarks.compare.process import RssSampler, free_port, started, wait_ready

TEXT = ROOT / "benchmarks" / "data" / "perplexity.txt"
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
           "Describe the water cycle.", "List some facts about the moon."]


def tokenize(http: httpx.Client, base: str, model: str, text: str) -> list[int]:
    r = http.post(f"{base}/tokenize", json={"model": model, "prompt": text,
                                            "add_special_tokens": False})
    r.raise_for_status()
    return list(r.json()["tokens"])


def window_nll(http: httpx.Client, base: str, model: str, ids: list[int]) -> list[float]:
    """-log p of tokens ctx/2 + 1 .. ctx - 1 of the window `ids`, from the server."""
    r = http.post(f"{base}/v1/completions", json={
        "model": model, "prompt": ids, "max_tokens": 1, "temperature": 0,
        "prompt_logprobs": 0})
    r.raise_for_status()
    plp = r.json()["choices"][0]["prompt_logprobs"]
    first = len(ids) // 2
    out = []
    for j in range(first + 1, len(ids)):
        entry = plp[j][str(ids[j])]
        out.append(-float(entry["logprob"]))
    return out


def perplexity(base: str, model: str, text: str, ctx: int) -> dict[str, float]:
    with httpx.Client(timeout=600.0) as http:
        ids = tokenize(http, base, model, text)
        n_windows = len(ids) // ctx
        if n_windows == 0:
            raise SystemExit(f"the text has {len(ids)} tokens, fewer than one window of {ctx}")
        nll: list[float] = []
        t0 = time.perf_counter()
        for w in range(n_windows):
            nll.extend(window_nll(http, base, model, ids[w * ctx:(w + 1) * ctx]))
        wall = time.perf_counter() - t0
    mean = sum(nll) / len(nll)
    # standard error of the mean NLL -> of the ppl (delta method), as llama-perplexity prints
    se = statistics.stdev(nll) / math.sqrt(len(nll)) if len(nll) > 1 else 0.0
    return {"ppl": math.exp(mean), "ppl_err": math.exp(mean) * se, "nll": mean,
            "tokens_scored": len(nll), "windows": n_windows, "text_tokens": len(ids),
            "score_s": wall}


def decode_round(base: str, model: str, concurrency: int, tokens: int) -> float:
    """tokens/s of `concurrency` simultaneous greedy requests of `tokens` tokens each."""
    def one(i: int) -> int:
        with httpx.Client(timeout=600.0) as http:
            r = http.post(f"{base}/v1/completions", json={
                "model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        done = sum(pool.map(one, range(concurrency)))
    return done / (time.perf_counter() - t0)


def llama_perplexity(binary: Path, model: str, text: Path, ctx: int, threads: int) -> dict:
    """llama.cpp's llama-perplexity on the same file, text and window: its final estimate."""
    import re
    import subprocess

    t0 = time.perf_counter()
    proc = subprocess.run([str(binary), "-m", model, "-f", str(text), "-c", str(ctx), "-t",
                           str(threads), "-tb", str(threads)], capture_output=True, text=True,
                          timeout=7200, check=False)
    out = proc.stdout + proc.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out)
    if proc.returncode != 0 or not m:
        raise SystemExit(f"llama-perplexity failed (rc {proc.returncode}): {out[-600:]}")
    chunks = re.search(r"calculating perplexity over (\d+) chunks", out)
    return {"ppl": float(m.group(1)), "ppl_err": float(m.group(2)),
            "windows": int(chunks.group(1)) if chunks else None,
            "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a .gguf file (or any MODEL kiln serve takes)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=FLAGS",
                    help="a label and the extra `kiln serve` flags of one variant (repeat); "
                    "default: native='' requant='--no-gguf-kernels' f32='--quantization none'")
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--ctx", type=int, default=512, help="window (llama-perplexity's -c)")
    ap.add_argument("--speed", action="store_true", help="also measure decode tok/s, alternated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="tokens per decode request")
    ap.add_argument("--port", type=int, default=0, help="first port (default: free ones)")
    ap.add_argument("--llama-perplexity", type=Path, default=None, metavar="PATH",
                    help="llama.cpp's llama-perplexity binary: run it on the same file and text")
    ap.add_argument("--threads", type=int, default=2, help="llama-perplexity's -t")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    # SIGTERM (a timeout) unwinds like Ctrl-C, so the servers below are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    variants = [v.split("=", 1) for v in args.variant] or [
        ["native", ""], ["requant", "--no-gguf-kernels"], ["f32", "--quantization none"]]
    text = args.text.read_text(encoding="utf-8")
    logs = ROOT / "benchmarks" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, object]] = {}
    servers = []  # (label, base, model, cm, proc, sampler) kept up for --speed
    try:
        for i, (label, flags) in enumerate(variants):
            port = args.port + i if args.port else free_port()
            cmd = [sys.executable, "-m", "kiln", "serve", args.model, "--host", "127.0.0.1",
                   "--port", str(port), "--max-model-len", str(max(args.ctx + 8, 1024)),
                   *shlex.split(flags)]
            log = logs / f"perplexity-{label}-{port}.log"
            cm = started(Launch(cmd), log)
            t0 = time.perf_counter()
            proc = cm.__enter__()
            sampler = RssSampler(proc.pid).__enter__()
            base = f"http://127.0.0.1:{port}"
            model = wait_ready(proc, base + "/v1", 900, log)
            ready = time.perf_counter() - t0
            res = perplexity(base, model, text, args.ctx)
            res.update(ready_s=ready, peak_rss_mb=sampler.peak / 2**20, flags=flags)
            results[label] = res
            print(f"{label:10s} ppl {res['ppl']:.4f} +/- {res['ppl_err']:.4f} "
                  f"({res['tokens_scored']} tokens, {res['windows']} windows)  ready "
                  f"{ready:.1f} s  peak RSS {res['peak_rss_mb']:.0f} MB", flush=True)
            servers.append((label, base, model, cm, proc, sampler))
            if not args.speed:
                sampler.__exit__(None, None, None)
                cm.__exit__(None, None, None)
                servers.pop()
        if args.llama_perplexity:
            ref = llama_perplexity(args.llama_perplexity, args.model, args.text, args.ctx,
                                   args.threads)
            results["llama-perplexity"] = ref
            print(f"llama-perplexity ppl {ref['ppl']:.4f} +/- {ref['ppl_err']:.4f} "
                  f"({ref['windows']} windows, {ref['seconds']:.0f} s)", flush=True)
            for label in [v[0] for v in variants]:
                if label in results:
                    ratio = results[label]["ppl"] / ref["ppl"]
                    results[label]["ppl_vs_llama_perplexity"] = ratio
                    print(f"{label:10s} / llama-perplexity: {ratio:.4f}", flush=True)
        if args.speed:
            speed: dict[str, dict[str, list[float]]] = {
                s[0]: {"c1": [], "c16": []} for s in servers}
            for r in range(args.rounds):
                for label, base, model, *_ in servers:
                    speed[label]["c1"].append(decode_round(base, model, 1, args.tokens))
                    speed[label]["c16"].append(decode_round(base, model, 16, args.tokens))
                    print(f"round {r + 1} {label:10s} c1 {speed[label]['c1'][-1]:.1f} c16 "
                          f"{speed[label]['c16'][-1]:.1f} tok/s", flush=True)
            first = servers[0][0]
            for label in speed:
                for c in ("c1", "c16"):
                    ratios = [a / b for a, b in zip(speed[label][c], speed[first][c])]
                    results[label][f"tok_s_{c}"] = speed[label][c]
                    results[label][f"ratio_{c}_vs_{first}"] = ratios
                    print(f"{label:10s} {c:4s} tok/s " + " ".join(f"{v:.1f}" for v in
                                                                  speed[label][c])
                          + f"  vs {first}: median {statistics.median(ratios):.2f} "
                          f"[{min(ratios):.2f}-{max(ratios):.2f}]", flush=True)
    finally:
        for _, _, _, cm, _, sampler in servers:
            sampler.__exit__(None, None, None)
            cm.__exit__(None, None, None)
        # written even when cut short (a timeout): what was measured is kept
        out = args.out or ROOT / "benchmarks" / "results" / \
            f"perplexity-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.write_text(json.dumps({"model": args.model, "ctx": args.ctx, "text": str(args.text),
                                   "results": results}, indent=1))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
