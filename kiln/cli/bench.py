"""`kiln bench`: serving benchmark against any OpenAI-compatible URL, or `--offline` in-process."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from kiln.cli import add_lang_flag
from kiln.errors import ConfigError, KilnError

DESCRIPTION = """\
Measure a server that speaks the OpenAI API (kiln, vLLM, llama.cpp, ...): TTFT, TPOT, ITL and
end-to-end latency (mean, p50/p90/p99), tokens/s and requests/s per load level. Requests stream
(SSE) and token counts come from the server's usage. Prompts are fresh for every run.

  kiln bench --concurrency 1,16 --num-requests 64
  kiln bench --workload shared-prefix --prefix-len 900 --concurrency 16 --json out.json
  kiln bench --request-rate 2,8 --max-duration 60
  kiln bench --offline                  # the engine in-process: prefill and decode tok/s
"""


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected integers like 1,16, got {text!r}") from err
    if not values:
        raise argparse.ArgumentTypeError("expected at least one value")
    return values


def _rate_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]  # float("inf") parses
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected rates like 1,4.5,inf, got {text!r}") from err
    if not values:
        raise argparse.ArgumentTypeError("expected at least one value")
    return values


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object like '{\"top_k\": 1}'")
    return value


def _key_value(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value: Any = json.loads(raw)  # numbers, true/false, null
    except json.JSONDecodeError:
        value = raw
    return key.strip().replace("-", "_"), value


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark a running OpenAI-compatible server, or the engine with --offline",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                   help="OpenAI base URL, including /v1 (default: %(default)s)")
    g.add_argument("--model", default=None,
                   help="model name to request (default: the first of GET /v1/models); "
                   "with --offline, the model to load")
    g.add_argument("--api-key", default=None, help="sent as a Bearer token")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=["fixed", "shared-prefix", "multi-turn"], default="fixed")
    w.add_argument("--input-len", type=int, default=128,
                   help="tokens of each (unique) user turn, approximate without --tokenizer")
    w.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    w.add_argument("--prefix-len", type=int, default=512,
                   help="shared-prefix: tokens of the prefix shared within a level")
    w.add_argument("--turns", type=int, default=3, help="multi-turn: turns per conversation")
    w.add_argument("--tokenizer", default=None,
                   help="HF id/folder or .gguf file to make prompt lengths exact")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ignore_eos=true, run to max_tokens)")
    w.add_argument("--extra-body", type=_json_object, default={}, metavar="JSON",
                   help="fields merged into every request body")
    w.add_argument("--seed", type=int, default=None,
                   help="pin the prompts (runs are then no longer fresh for server caches)")

    ld = p.add_argument_group("load")
    ld.add_argument("--concurrency", type=_int_list, default=None, metavar="N[,N...]",
                    help="closed-loop levels (default: 1 unless --request-rate is given)")
    ld.add_argument("--request-rate", type=_rate_list, default=None, metavar="R[,R...]",
                    help="open-loop levels: Poisson arrivals per second (inf: all at once)")
    ld.add_argument("--num-requests", type=int, default=64, help="per level")
    ld.add_argument("--max-duration", type=float, default=None,
                    help="seconds per level; stop issuing after it")
    ld.add_argument("--warmup", type=int, default=2,
                    help="requests per level before measuring, excluded")

    o = p.add_argument_group("output")
    o.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                   help="write all raw numbers and the config as JSON")
    o.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar on stderr")

    off = p.add_argument_group("offline (--offline)")
    off.add_argument("--offline", action="store_true",
                     help="measure the engine in-process through kiln.llm.LLM, no HTTP")
    off.add_argument("--prefill-len", type=int, default=512)
    off.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 32], metavar="B[,B...]")
    off.add_argument("--decode-tokens", type=int, default=128,
                     help="tokens per sequence of the timed decode")
    off.add_argument("--repeats", type=int, default=3, help="prefill runs (median)")
    off.add_argument("--engine-arg", dest="engine_args", action="append", default=[],
                     type=_key_value, metavar="KEY=VALUE",
                     help="a setting for the engine by its table name, as kiln serve takes it, "
                     "e.g. kv_cache_memory=128MiB (repeatable)")
    add_lang_flag(p)
    p.set_defaults(func=main)


def config_from_args(args: argparse.Namespace) -> Any:
    from kiln.bench.client import BenchConfig
    from kiln.bench.workloads import WorkloadConfig

    workload = WorkloadConfig(kind=args.workload, endpoint=args.endpoint,
                              input_len=args.input_len, output_len=args.output_len,
                              prefix_len=args.prefix_len, turns=args.turns)
    cfg = BenchConfig(base_url=args.base_url, model=args.model, api_key=args.api_key,
                      workload=workload, concurrency=args.concurrency or [],
                      request_rates=args.request_rate or [], num_requests=args.num_requests,
                      max_duration=args.max_duration, warmup=args.warmup,
                      temperature=args.temperature, ignore_eos=args.ignore_eos,
                      extra_body=args.extra_body, timeout=args.timeout, seed=args.seed,
                      tokenizer=args.tokenizer, progress=args.progress)
    cfg.validate()
    return cfg


def _run_offline(args: argparse.Namespace) -> int:
    from kiln.bench.offline import run_offline
    from kiln.bench.report import format_offline, write_json

    if args.prefill_len < 1 or args.decode_tokens < 1 or any(b < 1 for b in args.batch_sizes):
        raise ConfigError("--prefill-len, --decode-tokens and --batch-sizes must be positive")
    try:
        import kiln.llm  # noqa: F401
    except ImportError as err:
        raise KilnError(f"--offline needs kiln.llm, which failed to import: {err}") from err
    result = run_offline(args.model, prefill_len=args.prefill_len, batch_sizes=args.batch_sizes,
                         decode_tokens=args.decode_tokens, repeats=args.repeats, seed=args.seed,
                         engine_overrides=dict(args.engine_args))
    if args.json_path:
        print(f"wrote {write_json(args.json_path, result.to_json())}", file=sys.stderr)
    print(format_offline(result))
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        if args.offline:
            return _run_offline(args)
        from kiln.bench.client import run_benchmark
        from kiln.bench.report import format_result, write_json

        cfg = config_from_args(args)
        result = asyncio.run(run_benchmark(cfg))
    except KilnError as e:
        print(f"kiln bench: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("kiln bench: interrupted", file=sys.stderr)
        return 130
    if args.json_path:  # first: the raw numbers must survive a closed stdout pipe
        print(f"wrote {write_json(args.json_path, result.to_json())}", file=sys.stderr)
    print(format_result(result))
    # Exit non-zero when nothing succeeded, so scripts notice a dead or misconfigured server.
    return 0 if any(lv.summary.completed for lv in result.levels) else 1
