"""kiln.bench: statistics, workloads, SSE parsing, load shapes, and runs against kiln itself."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kiln.bench.client import (
    BenchClient,
    BenchConfig,
    ServerUnreachableError,
    SSEDecoder,
    discover_model,
    parse_chunk,
    run_benchmark,
)
from kiln.bench.report import format_result, format_summaries, write_json
from kiln.bench.stats import Distribution, RequestRecord, percentile, summarize
from kiln.bench.workloads import (
    WORDS,
    Session,
    WorkloadConfig,
    chat_messages,
    completion_prompt,
    make_sessions,
    make_text,
    new_salt,
)
from kiln.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------------------------
# stats


def test_percentile_matches_numpy_linear_interpolation() -> None:
    import numpy as np  # a transformers dependency, so always there

    rng = random.Random(1)
    for n in (1, 2, 7, 100):
        xs = [rng.random() for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_of_nothing_is_nan_and_bad_q_raises() -> None:
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    assert Distribution.of([]).count == 0 and math.isnan(Distribution.of([]).p50)


def test_ttft_tpot_itl_come_from_chunk_timestamps_and_usage() -> None:
    rec = RequestRecord(
        start=10.0,
        end=11.2,
        ok=True,
        chunk_times=[10.5, 10.6, 10.8, 11.1],
        completion_tokens=5,  # one chunk carried two tokens: TPOT uses usage, ITL uses chunks
        usage_reported=True,
    )
    assert rec.ttft == pytest.approx(0.5)
    assert rec.e2e == pytest.approx(1.2)
    assert rec.tpot == pytest.approx((1.2 - 0.5) / 4)
    assert rec.itls == pytest.approx([0.1, 0.2, 0.3])
    one = RequestRecord(start=0.0, end=1.0, ok=True, chunk_times=[0.4], completion_tokens=1)
    assert one.tpot is None and one.itls == []


def test_summary_counts_throughput_errors_and_missing_usage() -> None:
    ok1 = RequestRecord(
        0.0, 2.0, True, [0.5, 1.0], prompt_tokens=10, completion_tokens=4, usage_reported=True
    )
    ok2 = RequestRecord(1.0, 4.0, True, [1.5, 2.0, 3.0], prompt_tokens=10, completion_tokens=3)
    bad = [RequestRecord(0.5, 0.6, False, error="HTTP 500: boom") for _ in range(3)]
    bad.append(RequestRecord(0.5, 0.7, False, error="timeout"))
    s = summarize([ok1, ok2, *bad], label="c=2", concurrency=2)
    assert (s.completed, s.errors) == (2, 4)
    assert s.error_messages == ["HTTP 500: boom", "timeout"]  # deduplicated, in order
    assert s.duration_s == pytest.approx(4.0)
    assert s.output_tokens == 7 and s.input_tokens == 20
    assert s.output_tok_s == pytest.approx(7 / 4)
    assert s.total_tok_s == pytest.approx(27 / 4)
    assert s.requests_per_s == pytest.approx(0.5)
    assert s.ttft.p50 == pytest.approx(0.5)
    assert s.itl.count == 3 and s.e2e.max == pytest.approx(3.0)
    assert s.usage_missing == 1
    assert s.short_outputs == 0
    cut = RequestRecord(0.0, 1.0, True, [0.5], completion_tokens=1, expected_tokens=64)
    assert summarize([cut, ok1], label="x").short_outputs == 1
    assert "cut them short" in format_summaries([summarize([cut], label="x")])
    text = format_summaries([s])
    assert "c=2" in text and "HTTP 500: boom" in text and "no usage" in text


# ---------------------------------------------------------------------------------------------
# workloads


def test_text_length_is_one_word_per_token_without_a_counter() -> None:
    text = make_text(random.Random(0), 137)
    assert len(text.split()) == 137
    assert set(text.split()) <= set(WORDS)


def test_text_length_is_exact_with_a_counter() -> None:
    def counter(t: str) -> int:  # a tokenizer that splits long words in two
        return sum(2 if len(w) > 6 else 1 for w in t.split())

    for n in (1, 50, 512):
        assert counter(make_text(random.Random(n), n, counter)) == n


def test_prompts_are_fresh_across_runs_and_unique_within_a_run() -> None:
    cfg = WorkloadConfig(kind="fixed", input_len=64)
    run1 = make_sessions(cfg, 20, new_salt())
    run2 = make_sessions(cfg, 20, new_salt())
    heads = [" ".join(s.turns[0].split()[:8]) for s in run1 + run2]
    assert len(set(heads)) == 40  # every request differs from its first tokens on
    pinned = make_sessions(cfg, 3, "seed7")
    assert [s.turns for s in pinned] == [s.turns for s in make_sessions(cfg, 3, "seed7")]


def test_shared_prefix_is_shared_within_a_level_and_fresh_across_levels() -> None:
    cfg = WorkloadConfig(kind="shared-prefix", prefix_len=300, input_len=40)
    level = make_sessions(cfg, 8, "run-L0")
    assert len({s.prefix for s in level}) == 1
    assert len(level[0].prefix.split()) == 300  # type: ignore[union-attr]
    assert len({s.turns[0] for s in level}) == 8
    warm = make_sessions(cfg, 2, "run-L0", tag="warmup")
    assert warm[0].prefix == level[0].prefix  # warmup primes the prefix ...
    assert not {s.turns[0] for s in warm} & {s.turns[0] for s in level}  # ... not the turns
    assert make_sessions(cfg, 1, "run-L1")[0].prefix != level[0].prefix
    prompt = completion_prompt(level[3], 0, [])
    assert prompt.startswith(level[0].prefix) and prompt.endswith(level[3].turns[0])  # type: ignore[arg-type]


def test_multi_turn_sessions_add_up_to_num_requests_and_resend_history() -> None:
    cfg = WorkloadConfig(kind="multi-turn", turns=3, input_len=5)
    sessions = make_sessions(cfg, 7, "s")
    assert [len(s.turns) for s in sessions] == [3, 3, 1]
    msgs = chat_messages(sessions[0], 2, ["first reply", "second reply"])
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    assert msgs[1]["content"] == "first reply" and msgs[4]["content"] == sessions[0].turns[2]
    prompt = completion_prompt(sessions[0], 1, ["first reply"])
    assert prompt.endswith("Assistant:") and "Assistant: first reply" in prompt


def test_bad_workload_settings_raise_config_errors() -> None:
    with pytest.raises(ConfigError):
        make_sessions(WorkloadConfig(kind="nope"), 1, "s")
    with pytest.raises(ConfigError):
        make_sessions(WorkloadConfig(input_len=0), 1, "s")


@pytest.mark.slow
def test_word_prompts_are_about_one_token_per_word_for_a_real_tokenizer(gguf_path: Path) -> None:
    from kiln.bench.workloads import hf_token_counter

    count = hf_token_counter(str(gguf_path))
    n = count(make_text(random.Random(3), 500))
    assert 450 <= n <= 550
    assert count(make_text(random.Random(4), 107, count)) == 107


# ---------------------------------------------------------------------------------------------
# SSE


def test_sse_decoder_handles_comments_multiline_data_crlf_and_missing_final_blank() -> None:
    dec = SSEDecoder()
    lines = [": keep-alive", 'data: {"a":', "data: 1}", "", "event: x", "data:[DONE]\r", ""]
    out = [p for line in lines for p in dec.feed(line)]
    assert out == ['{"a":\n1}', "[DONE]"]
    assert dec.feed("data: tail") == [] and dec.flush() == ["tail"] and dec.flush() == []


def test_parse_chunk_reads_completions_chat_usage_done_and_errors() -> None:
    c = parse_chunk('{"choices":[{"index":0,"text":"Hi","finish_reason":null}]}')
    assert c.text == "Hi" and c.finish_reason is None and c.usage is None
    role_only = parse_chunk('{"choices":[{"index":0,"delta":{"role":"assistant"}}]}')
    assert role_only.text == ""  # a role-only first chunk must not count as the first token
    chat = parse_chunk('{"choices":[{"delta":{"content":" there"},"finish_reason":"length"}]}')
    assert chat.text == " there" and chat.finish_reason == "length"
    usage = parse_chunk('{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}')
    assert usage.usage == {"prompt_tokens": 7, "completion_tokens": 3} and usage.text == ""
    assert parse_chunk("[DONE]").done
    assert "boom" in (parse_chunk('{"error":{"message":"boom"}}').error or "")
    assert parse_chunk("not json").error


# ---------------------------------------------------------------------------------------------
# load shapes (the network part is replaced by a timed sleep; the scheduling is what is tested)


class _SleepClient(BenchClient):
    """BenchClient whose `send` sleeps instead of talking HTTP, recording what it was sent."""

    def __init__(self, cfg: BenchConfig, delay: float = 0.02) -> None:
        super().__init__(cfg, http=None, model="m")  # type: ignore[arg-type]
        self.delay = delay
        self.in_flight = 0
        self.peak = 0
        self.bodies: list[dict[str, Any]] = []

    async def send(self, url: str, body: dict[str, Any], record: RequestRecord) -> None:
        self.bodies.append(body)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        record.chunk_times = [time.perf_counter()]
        record.end = time.perf_counter()
        record.completion_tokens, record.usage_reported, record.ok = 1, True, True
        record.text = f"reply{len(self.bodies)}"


def test_closed_loop_keeps_concurrency_and_num_requests() -> None:
    cfg = BenchConfig(workload=WorkloadConfig(input_len=4, output_len=3))
    client = _SleepClient(cfg)
    sessions = make_sessions(cfg.workload, 10, "s")
    records = asyncio.run(client.closed_loop(sessions, 4, None))
    assert len(records) == 10 and client.peak == 4
    body = client.bodies[0]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 3 and body["temperature"] == 0.0


def test_max_duration_stops_issuing_new_requests() -> None:
    cfg = BenchConfig(workload=WorkloadConfig(input_len=4))
    client = _SleepClient(cfg, delay=0.05)
    deadline = time.perf_counter() + 0.12
    records = asyncio.run(client.closed_loop(make_sessions(cfg.workload, 100, "s"), 1, deadline))
    assert 2 <= len(records) <= 4


def test_open_loop_arrivals_follow_the_rate() -> None:
    cfg = BenchConfig(workload=WorkloadConfig(input_len=4))
    client = _SleepClient(cfg, delay=0.001)
    sessions = make_sessions(cfg.workload, 40, "s")
    t0 = time.perf_counter()
    records = asyncio.run(client.open_loop(sessions, 400.0, None, random.Random(0)))
    elapsed = time.perf_counter() - t0
    assert len(records) == 40
    assert 0.03 < elapsed < 1.0  # 40 arrivals at 400/s: ~0.1 s, never all at once
    starts = sorted(r.start for r in records)
    assert starts[-1] - starts[0] > 0.02


def test_multi_turn_sends_the_replies_back_as_history() -> None:
    cfg = BenchConfig(workload=WorkloadConfig(kind="multi-turn", endpoint="chat", turns=2))
    client = _SleepClient(cfg)
    asyncio.run(client.closed_loop(make_sessions(cfg.workload, 2, "s"), 1, None))
    second = client.bodies[1]["messages"]
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[1]["content"] == "reply1"


def test_extra_body_is_merged_and_session_helpers_agree() -> None:
    cfg = BenchConfig(extra_body={"logit_bias": {"2": -100}}, ignore_eos=False)
    client = BenchClient(cfg, http=None, model="m")  # type: ignore[arg-type]
    s = Session(id=0, turns=["hello"], max_tokens=5)
    url, body = client.body(s, 0, [])
    assert url.endswith("/v1/completions") and body["prompt"] == "hello"
    assert body["logit_bias"] == {"2": -100} and "ignore_eos" not in body


# ---------------------------------------------------------------------------------------------
# CLI and reports


def _parse(argv: list[str]) -> argparse.Namespace:
    from kiln.cli import bench

    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def test_cli_parses_level_lists_into_a_config() -> None:
    from kiln.cli.bench import config_from_args

    args = _parse(
        [
            "--concurrency",
            "1,16",
            "--request-rate",
            "2,inf",
            "--workload",
            "shared-prefix",
            "--prefix-len",
            "900",
            "--extra-body",
            '{"top_k": 1}',
        ]
    )
    cfg = config_from_args(args)
    assert cfg.levels() == [(1, None), (16, None), (None, 2.0), (None, math.inf)]
    assert cfg.workload.prefix_len == 900 and cfg.extra_body == {"top_k": 1}
    assert config_from_args(_parse([])).levels() == [(1, None)]
    off = _parse(["--offline", "--engine-arg", "kv-cache-memory=1024", "--engine-arg", "dtype=x"])
    assert off.offline and off.engine_args == [("kv_cache_memory", 1024), ("dtype", "x")]
    with pytest.raises(SystemExit):
        _parse(["--concurrency", "a,b"])
    with pytest.raises(ConfigError):
        config_from_args(_parse(["--concurrency", "0"]))


def test_cli_reports_an_unreachable_server_as_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    from kiln.cli.bench import main

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    rc = main(_parse(["--base-url", url, "--no-progress"]))
    assert rc != 0 and f"{url}/models" in capsys.readouterr().err  # the address it tried

    async def discover() -> str:
        import httpx

        async with httpx.AsyncClient(timeout=10) as http:
            return await discover_model(http, url, None)

    with pytest.raises(ServerUnreachableError) as e:  # what the CLI printed, by its code
        asyncio.run(discover())
    assert e.value.code == "bench.unreachable"


def test_json_output_is_strict_json(tmp_path: Path) -> None:
    path = write_json(tmp_path / "r" / "out.json", {"x": math.nan, "y": [math.inf, 1.5]})
    assert json.loads(path.read_text()) == {"x": None, "y": ["inf", 1.5]}


# ---------------------------------------------------------------------------------------------
# end to end against kiln's own server (no fake server: a server that does not start fails here)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def kiln_server(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> Any:
    import httpx

    port = _free_port()
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "w+")  # noqa: SIM115
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kiln",
            "serve",
            str(gguf_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"kiln serve exited with {proc.returncode}:\n{log.read()[-3000:]}")
            try:
                if httpx.get(f"{base}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("kiln serve did not become healthy in 240 s")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.mark.slow
def test_bench_measures_kiln_serve_over_http(kiln_server: str, tmp_path: Path) -> None:
    cfg = BenchConfig(
        base_url=kiln_server,
        workload=WorkloadConfig(kind="shared-prefix", input_len=24, output_len=8, prefix_len=64),
        concurrency=[1, 2],
        num_requests=4,
        warmup=1,
        progress=False,
    )
    result = asyncio.run(run_benchmark(cfg))
    for level in result.levels:
        s = level.summary
        assert (s.completed, s.errors) == (4, 0), s.error_messages
        assert s.usage_missing == 0  # kiln must send usage when include_usage is asked
        assert all(r.completion_tokens == 8 for r in level.records)  # ignore_eos honoured
        assert s.ttft.p50 > 0 and s.tpot.p50 > 0 and s.output_tok_s > 0
        assert all(r.prompt_tokens and r.prompt_tokens >= 64 for r in level.records)
    assert "c=2" in format_result(result)
    data = json.loads(write_json(tmp_path / "b.json", result.to_json()).read_text())
    assert len(data["levels"][1]["requests"]) == 4


@pytest.mark.slow
def test_bench_multi_turn_chat_against_kiln_serve(kiln_server: str) -> None:
    cfg = BenchConfig(
        base_url=kiln_server,
        workload=WorkloadConfig(
            kind="multi-turn", endpoint="chat", turns=2, input_len=16, output_len=6
        ),
        concurrency=[2],
        num_requests=4,
        warmup=0,
        progress=False,
    )
    level = asyncio.run(run_benchmark(cfg)).levels[0]
    assert level.summary.completed == 4, level.summary.error_messages
    first, second = (
        sorted(r.prompt_tokens or 0 for r in level.records if r.turn == t) for t in (0, 1)
    )
    assert min(second) > max(first)  # the second turn resent the history


@pytest.mark.slow
def test_offline_bench_reports_prefill_and_decode_rates(gguf_path: Path) -> None:
    from kiln.bench.offline import run_offline

    # run_offline(None) serves the default model, the GGUF that gguf_path finds.
    # A small KV pool: sizing it from system memory is what makes a default LLM() slow to load.
    # Eager decode: compiling the batch buckets at load is not what this test measures.
    small = {"kv_cache_memory": 128 * 2**20, "max_model_len": 1024, "compile": False}
    result = run_offline(
        None, prefill_len=32, batch_sizes=[2], decode_tokens=4, repeats=1, engine_overrides=small
    )
    assert result.prefill_tok_s > 0 and len(result.prefill_seconds) == 1
    assert [d.batch for d in result.decode] == [2]
    assert all(d.tok_s > 0 for d in result.decode)
    # It measured the served configuration: the same rule as `kiln serve` picks int4 for the
    # Q4_1 GGUF, and the report names each value's source.
    assert result.settings["quantization"]["value"] == "int4"
    assert result.settings["quantization"]["source"] == "auto"
    assert result.settings["compile"] == {**result.settings["compile"], "value": False,
                                          "source": "cli"}
    # The roofline: SmolLM2's int4 layers (66.4 MB packed) and int8 head (28.3 MB) are what a
    # step reads; the embedding's rows and RoPE's tables are lookups, not counted.
    roof = result.decode[0].roofline
    assert roof is not None and 90e6 < roof["weight_bytes"] < 100e6
    assert roof["kv_bytes"] > 0 and roof["read_gbs"] > 0
    steps_s = result.decode[0].tok_s / 2
    assert roof["achieved_gbs"] == pytest.approx(roof["bytes_per_step"] * steps_s / 1e9)
    assert roof["fraction"] == pytest.approx(roof["achieved_gbs"] / roof["read_gbs"])
    from kiln.bench.report import format_offline

    assert "memory roofline" in format_offline(result)


# ---------------------------------------------------------------------------------------------
# benchmarks/compare: the figures and ratios, and the command line (no peer is started here)


def test_compare_cli_parses_its_flags_without_starting_a_peer() -> None:
    # The script re-executes itself under the repo's .venv when there is one; its --help runs
    # the whole import chain (peers, process, measure, report) all the same.
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "compare" / "run.py"), "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    for flag in ("--peers", "--markdown", "--quick", "--no-install", "--install-only"):
        assert flag in out.stdout


def _peer(tok_s: float, ttft: float, tpot: float, ready: float, rss_mib: float) -> dict[str, Any]:
    summary = {
        "output_tok_s": tok_s,
        "ttft": {"p50": ttft},
        "tpot": {"p50": tpot},
    }
    prefill = {"summary": summary, "requests": [{"ok": True, "ttft": ttft, "prompt_tokens": 512}]}
    return {
        "status": "ok",
        "ready_s": ready,
        "peak_rss_bytes": rss_mib * 2**20,
        "workloads": {
            "c1": {"summary": summary},
            "c16": {"summary": summary},
            "prefix": {"summary": summary},
            "prefill": prefill,
        },
    }


def test_compare_ratios_pick_the_best_peer_per_direction() -> None:
    from benchmarks.compare import report

    peers = {
        "kiln": _peer(100.0, 0.2, 0.01, 30.0, 900.0),
        "llama-server": _peer(200.0, 0.1, 0.005, 3.0, 300.0),
        "llama-cpp-python": _peer(50.0, 0.4, 0.02, 5.0, 200.0),
        "vllm": {"status": "install failed: no wheel", "peak_rss_bytes": 1},  # not counted
    }
    rows = {r[0]: r for r in report.ratio_rows(peers)}
    assert rows["c=16 output throughput (tok/s)"][3:] == ["llama-server 200.0", "0.50x"]
    assert rows["c=16 TTFT p50 (ms)"][3:] == ["llama-server 100.0", "2.00x"]
    assert rows["peak RSS (MiB)"][3:] == ["llama-cpp-python 200.0", "4.50x"]
    assert rows["c=1 decode speed (tok/s)"][2] == "100.0"  # 1 / TPOT
    assert rows["prefill 512 tokens (tok/s)"][2] == "2,560.0"  # 512 tokens / 0.2 s
    md = report.markdown_table(peers, 2, "model.gguf")
    assert md.startswith("| figure | better | kiln | llama-server | llama-cpp-python | vllm |")
    assert "vllm: install failed: no wheel" in md
    assert "TTFT 8192-token prompt (ms)" not in rows  # a workload no peer ran has no row


def test_compare_rounds_report_each_rounds_ratio_and_their_median() -> None:
    """--rounds 3: a figure's kiln / best peer per round (the peers measured side by side in
    each) and the median of those, in the table and the JSON record."""
    from benchmarks.compare import report

    rounds = [{"kiln": _peer(100.0 * f, 0.2, 0.01, 30.0, 900.0),
               "llama-server": _peer(50.0, 0.1, 0.005, 3.0, 300.0)} for f in (1.0, 1.3, 0.9)]
    ratios = report.round_ratios(rounds)
    assert [round(r, 2) for r in ratios["c16_out"]] == [2.0, 2.6, 1.8]
    md = report.rounds_table(rounds, 2, "model.gguf")
    assert "| c=16 output throughput (tok/s) | higher | 2.00x, 2.60x, 1.80x | 2.00x |" in md
    assert "3 rounds" in md
    rec = report.result_record(rounds[-1], started_at="t", model="m", threads=2, quick=False,
                               rounds=rounds)
    assert len(rec["rounds"]) == 3 and rec["ratios"]["c16_out"] == ratios["c16_out"]
    assert "rounds" not in report.result_record(rounds[0], started_at="t", model="m", threads=2,
                                                quick=False, rounds=rounds[:1])


def test_compare_long_prompts_size_llama_server_to_them(tmp_path: Path) -> None:
    """--workloads ttft8k: llama-server started from --llama-cpp-dir with one slot whose
    context holds the 8k prompt (the default workloads: 16 slots of 2048); its TTFT is a row."""
    from benchmarks.compare import measure, report
    from benchmarks.compare.peers import Context, LlamaServerPeer

    (tmp_path / "llama-server").write_text("")
    longs = measure.chosen(["ttft8k", "c1"])
    assert [w.key for w in longs] == ["c1", "ttft8k"]
    assert measure.longest_request(measure.chosen(["ttft8k"])) == 8193
    assert measure.longest_request(measure.chosen(list(measure.DEFAULT_WORKLOADS))) == 900 + 107 + 128

    def launch(workloads: list[Any]) -> list[str]:
        ctx = Context(gguf=tmp_path / "m.gguf", threads=2, quick=True, logs=tmp_path, install=False,
                      reinstall=False, install_timeout=1.0, build_jobs=1, llama_cpp_dir=tmp_path,
                      longest_prompt=measure.longest_request(workloads),
                      concurrency=max(w.concurrency for w in workloads))
        assert LlamaServerPeer().installed(ctx)
        cmd = LlamaServerPeer().launch(ctx, 1234).cmd
        assert cmd[0] == str(tmp_path / "llama-server")
        return cmd

    cmd = launch(measure.chosen(["ttft2k", "ttft8k"]))
    assert cmd[cmd.index("--parallel") + 1] == "1" and cmd[cmd.index("-c") + 1] == "8448"
    cmd = launch(measure.chosen(list(measure.DEFAULT_WORKLOADS)))
    assert cmd[cmd.index("--parallel") + 1] == "16" and cmd[cmd.index("-c") + 1] == "32768"
    peer = {"status": "ok", "ready_s": 1.0, "workloads": {
        "ttft8k": {"summary": {"ttft": {"p50": 40.0}}}}}
    rows = {r[0]: r for r in report.ratio_rows({"kiln": peer, "llama-server": peer})}
    assert rows["TTFT 8192-token prompt (ms)"][2:] == ["40,000.0", "llama-server 40,000.0", "1.00x"]
