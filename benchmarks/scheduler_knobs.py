"""ferrum's scheduler knobs under load (issue 43 item 7): TTFT p50/p99 and throughput at c=16 with
mixed prompt lengths, each knob alone against kiln's plain rule, on one `kiln serve`.

    python benchmarks/scheduler_knobs.py                  # SmolLM2 (embedded), all arms
    python benchmarks/scheduler_knobs.py --model M --threads 2 --requests 48

The load is two closed loops at once through kiln.bench (the client benchmarks/compare uses):
12 short prompts (~48 tokens) and 4 long ones (~640) in flight, 32 output tokens each, so long
prefills land while short requests decode. TTFT is reported for all requests and for each class;
throughput is output tokens per second of wall time while both loops run.

Measured (SmolLM2-135M Q4_1, 2 threads, the shared 2-core Zen 4 dev machine, 48 requests per
arm, each arm on a fresh server after an 8-request warm-up; 2026-12-06). The machine ran other
sessions' work meanwhile (load average 2-5), which moved the plain rule's own throughput from
51 to 140 tok/s between passes, so each knob is given against the plain rule of its own pass
(TTFT p50 / TTFT p99 / output tok/s, as ratios; three passes, the last in reverse order):

    knob (--...)                            pass A             pass B             pass C
    plain rule (absolute)               3.06s 7.88s  52    1.64s 4.59s  79    1.07s 2.62s 140
    scheduler-prefill-step-chunk 128     0.36  0.95  0.90   0.47  1.12  0.96   0.40  1.02  0.98
    scheduler-active-decode-prefill-chunk 64
                                         1.55  1.53  0.76   1.44  1.25  1.00   1.79  1.60  0.69
    scheduler-prefill-first-until-active 8
                                         0.75  0.91  1.07   0.81  0.65  1.62   0.92  0.94  1.08
    sequence-fit-policy full-input-must-fit
                                         1.09  0.92  1.06   0.48  0.51  1.83   2.29  2.59  0.37

Measured again on the quiet machine (2026-12-06 11:21, nothing else running, same load, 48
requests per arm, absolute values):

    knob (--...)                              TTFT p50  p99     short p50 / p99   long p50 / p99   tok/s
    plain rule                                1.31 s  3.39 s    1.15 / 3.39       1.74 / 3.23      121.5
    scheduler-prefill-step-chunk 128          0.57    3.06      0.34 / 2.97       2.44 / 3.12      121.4
    scheduler-active-decode-prefill-chunk 64  1.82    4.45      1.81 / 1.96       1.89 / 4.81      100.3
    scheduler-prefill-first-until-active 8    1.30    3.12      1.25 / 3.13       1.51 / 3.00      122.1
    sequence-fit-policy full-input-must-fit   1.24    3.49      1.24 / 1.80       1.45 / 3.77      113.4

What holds in every pass: a per-request prefill chunk halves the short prompts' TTFT (p50 0.4-0.9 s
against 0.9-2.7 s) and lengthens the long ones' (1.6-1.8x), throughput within 10%; capping the
prefill of decoding steps at 64 tokens raises TTFT 1.4-1.8x and never raises throughput;
prefill-first until 8 decode lowers TTFT p50 (0.75-0.92x) at equal or better throughput.
full-input-must-fit changes nothing this load can show (the KV pool holds every prompt, so it
never holds one back; its swings follow the machine's load): it matters when the pool is short,
where it trades waiting for the preemptions test_scheduler_knobs.py counts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kiln.bench.client import BenchConfig, run_benchmark
from kiln.bench.stats import percentile
from kiln.bench.workloads import WorkloadConfig

ARMS: list[tuple[str, list[str]]] = [
    ("kiln's rule (no knob)", []),
    ("--scheduler-prefill-step-chunk 128", ["--scheduler-prefill-step-chunk", "128"]),
    ("--scheduler-active-decode-prefill-chunk 64",
     ["--scheduler-active-decode-prefill-chunk", "64"]),
    ("--scheduler-prefill-first-until-active 8",
     ["--scheduler-prefill-first-until-active", "8"]),
    ("--sequence-fit-policy full-input-must-fit",
     ["--sequence-fit-policy", "full-input-must-fit"]),
]


def start_server(model: str | None, port: int, threads: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kiln", "serve", *([model] if model else []), "--port", str(port),
           "--threads", str(threads), "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
           "--no-ui", *extra]
    # Its log goes to a file: an unread pipe would stall the server once it fills.
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"scheduler_knobs-{port}.log"
    with log.open("w") as f:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"kiln serve exited ({proc.returncode}); its log: {log}")
        try:
            # trust_env=False: no proxy from the environment answers for 127.0.0.1.
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2,
                         trust_env=False).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("kiln serve did not answer in 300 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def load(port: int, requests: int, seed: int) -> dict[str, float]:
    base = f"http://127.0.0.1:{port}/v1"
    short, long_ = requests * 3 // 4, requests // 4

    def cfg(conc: int, n: int, input_len: int, s: int) -> BenchConfig:
        return BenchConfig(base_url=base, workload=WorkloadConfig("fixed", "completions",
                                                                  input_len, 32),
                           concurrency=[conc], num_requests=n, warmup=0, seed=s,
                           progress=False)

    t0 = time.perf_counter()
    a, b = await asyncio.gather(run_benchmark(cfg(12, short, 48, seed)),
                                run_benchmark(cfg(4, long_, 640, seed + 1)))
    wall = time.perf_counter() - t0
    recs = {"short": a.levels[0].records, "long": b.levels[0].records}
    out: dict[str, float] = {}
    every = [r.ttft for rs in recs.values() for r in rs if r.ok and r.ttft is not None]
    out["ttft_p50"], out["ttft_p99"] = percentile(every, 50), percentile(every, 99)
    for k, rs in recs.items():
        t = [r.ttft for r in rs if r.ok and r.ttft is not None]
        out[f"{k}_ttft_p50"], out[f"{k}_ttft_p99"] = percentile(t, 50), percentile(t, 99)
    tokens = sum(r.completion_tokens or 0 for rs in recs.values() for r in rs if r.ok)
    out["output_tok_s"] = tokens / wall
    out["errors"] = sum(1 for rs in recs.values() for r in rs if not r.ok)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="MODEL for kiln serve (default: the embedded)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--requests", type=int, default=48, help="per arm (3/4 short, 1/4 long)")
    p.add_argument("--port", type=int, default=18431)
    p.add_argument("--arms", default=None, help="indices of ARMS to run, e.g. 0,3")
    args = p.parse_args()
    arms = ARMS if args.arms is None else [ARMS[int(i)] for i in args.arms.split(",")]
    rows = []
    for i, (label, flags) in enumerate(arms):
        proc = start_server(args.model, args.port, args.threads, flags)
        try:
            asyncio.run(load(args.port, 8, seed=1000 + i))  # warm-up: compiled paths, caches
            got = asyncio.run(load(args.port, args.requests, seed=2000 + i))
        finally:
            stop_server(proc)
        rows.append((label, got))
        print(f"{label}: {got}", file=sys.stderr, flush=True)
    print("| arm | TTFT p50 (s) | TTFT p99 (s) | short p50 / p99 | long p50 / p99 | output tok/s |")
    print("|---|---|---|---|---|---|")
    for label, g in rows:
        print(f"| {label} | {g['ttft_p50']:.2f} | {g['ttft_p99']:.2f} | "
              f"{g['short_ttft_p50']:.2f} / {g['short_ttft_p99']:.2f} | "
              f"{g['long_ttft_p50']:.2f} / {g['long_ttft_p99']:.2f} | {g['output_tok_s']:.1f} |"
              + (f" ({int(g['errors'])} errors)" if g["errors"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
