"""Traces, request dumps with `kiln replay`, and diagnostic faults (kiln/obs/).

Engine-level checks run on the session's shared SmolLM2 runner; the server-level ones start real
`kiln serve` processes (tests/server/test_server.py's `_serve`) and drive them with the openai client:
one with every trace and a request dump under 16 concurrent clients, a fresh one to replay the
dump against, one with faults, and one whose startup fails on purpose.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import run_to_completion
from test_server import API_KEY, NAMES, Server, _serve, _wait_idle

from kiln.cli.main import main
from kiln.obs.faults import Fault, parse_fault, parse_faults
from kiln.sampling_params import SamplingParams

PROMPT = list(range(1, 40))


# -- the fault grammar ---------------------------------------------------------------------------


def test_fault_grammar_is_typed_and_errors_name_the_kinds(tmp_path: Path) -> None:
    assert parse_faults(["step_raise:3", "kv_alloc", "startup:kv_allocated"]) == (
        Fault("step_raise", 3), Fault("kv_alloc", 1), Fault("startup", "kv_allocated"))
    assert str(parse_fault("drop_stream:2")) == "drop_stream:2"
    for bad, code, named in (("boom:1", "fault.unknown_kind", "step_raise"),  # the kinds
                             ("step_delay_ms:x", "fault.not_an_integer", "'x'"),
                             ("step_raise:-1", "fault.too_small", "-1"),
                             ("startup:process_start", "fault.unknown_stage", "kv_allocated"),
                             ("step_raise:1,step_raise:2", "fault.given_twice", "step_raise")):
        with pytest.raises(ValueError) as e:
            parse_faults(bad)
        assert e.value.code == code and named in str(e.value)
    # Given as a flag: the setting's error, the rule that refused among its causes.
    eff = tmp_path / "eff.json"
    assert main(["serve", "--dry-run", "--diagnostic-fault", "boom:1",
                 "--effective-config-json", str(eff)]) != 0
    error = json.loads(eff.read_text())["error"]
    assert error["code"] == "config.invalid_value" and error["causes"] == ["fault.unknown_kind"]


# -- engine level ----------------------------------------------------------------------------------


def _greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_engine_traces_record_every_step(make_engine, tmp_path: Path) -> None:
    prof, sched = tmp_path / "p.jsonl", tmp_path / "s.jsonl"
    eng = make_engine(profile_jsonl=str(prof), scheduler_trace_jsonl=str(sched),
                      profile_sample_rate=0.5)
    eng.add_request("a", PROMPT, _greedy())
    eng.add_request("b", PROMPT[:20], _greedy())
    run_to_completion(eng)
    eng.close_traces()
    p = [json.loads(x) for x in prof.read_text().splitlines()]
    s = [json.loads(x) for x in sched.read_text().splitlines()]
    assert p[0]["kind"] == "meta" and p[0]["sample_rate"] == 0.5
    steps = [x for x in p[1:] if x["kind"] == "step"]
    assert len(s) == eng.stats.steps and len(steps) == eng.stats.steps // 2
    for x in steps:
        for phase in ("schedule", "prepare", "forward", "sample", "detokenize"):
            assert x[f"{phase}_ms"] >= 0
        assert x["tokens"] == x["prefill_tokens"] + x["decode_tokens"] and x["rows"] >= 1
    # step 1 prefills both prompts (39 + 20 tokens); later steps decode one token per request
    assert s[0]["prefill_tokens"] == 59 and s[0]["decode_tokens"] == 0
    assert s[-1]["decode_tokens"] == 2 and s[1]["running"] == 2
    assert s[-1]["kv_blocks_free"] < s[-1]["kv_blocks_total"]
    eng.check_idle_integrity()


def test_step_raise_fails_that_steps_requests_and_the_engine_goes_on(make_engine) -> None:
    from kiln.engine.engine import StepFailedError

    want = run_to_completion(_with(make_engine(), "b", PROMPT[:10]))["b"]
    eng = make_engine(diagnostic_faults=(Fault("step_raise", 2),))
    eng.add_request("a", PROMPT, _greedy())
    eng.step()
    eng.step()
    with pytest.raises(StepFailedError) as e:
        eng.step()
    assert e.value.cause.code == "fault.step_raise" and e.value.request_ids == ["a"]
    eng.check_idle_integrity()  # a's blocks came back
    eng.add_request("b", PROMPT[:10], _greedy())
    assert run_to_completion(eng)["b"] == want  # fires once; later requests are untouched
    eng.check_idle_integrity()


def test_kv_alloc_fault_is_survived_by_waiting_or_recompute(make_engine) -> None:
    want = run_to_completion(_with(make_engine(), "a", PROMPT))["a"]
    for nth in (1, 3):  # 1: the admission fails (it waits); 3: a running request is preempted
        eng = make_engine(diagnostic_faults=(Fault("kv_alloc", nth),))
        eng.add_request("a", PROMPT, _greedy())
        got = run_to_completion(eng, check=lambda e: e.kv.check_integrity(
            list(e.scheduler.requests.values())))
        assert got["a"] == want
        eng.check_idle_integrity()
    assert eng.scheduler.stats.num_preemptions == 1


def test_step_delay_slows_each_step(make_engine) -> None:
    eng = make_engine(diagnostic_faults=(Fault("step_delay_ms", 40),))
    eng.add_request("a", PROMPT[:8], _greedy(3))
    t0 = time.perf_counter()
    run_to_completion(eng)
    assert time.perf_counter() - t0 >= 3 * 0.040 and eng.stats.steps == 3


def _with(eng: Any, rid: str, prompt: list[int]) -> Any:
    eng.add_request(rid, prompt, _greedy())
    return eng


# -- a traced server under 16 clients, its dump replayed against a fresh one ----------------------

ENV_HASH = "sha256:" + "ab" * 32


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> dict[str, Any]:
    """Serves with every trace and a request dump, sends 16 concurrent requests (and one
    more after them), stops the
    server (SIGTERM: traces flushed on shutdown) and returns the paths and the answers."""
    tmp = tmp_path_factory.mktemp("traced")
    paths = {"profile": tmp / "profile.jsonl", "memory": tmp / "memory.jsonl",
             "sched": tmp / "sched.jsonl", "dump": tmp / "dump"}
    gen = _serve(tmp, gguf_path, "--profile-jsonl", str(paths["profile"]),
                 "--profile-detail", "layers", "--profile-commit-sha", "abc123",
                 "--profile-env-hash", ENV_HASH, "--profile-model", "smol-test",
                 "--profile-concurrency", "16", "--profile-runtime-flags-json", '{"a": 1}',
                 "--memory-profile-jsonl", str(paths["memory"]),
                 "--scheduler-trace-jsonl", str(paths["sched"]),
                 "--request-dump-dir", str(paths["dump"]))
    server = next(gen)
    answers = asyncio.run(_sixteen_clients(server))
    _wait_idle(server)
    server.proc.terminate()
    assert server.proc.wait(60) == 0, server.log_tail()
    gen.close()
    return {**paths, "answers": answers}


async def _sixteen_clients(server: Server) -> list[Any]:
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY,
                                max_retries=0)

    async def one(i: int) -> Any:
        words = f"Tell me fact number {i} about " + ["the sea", "bread", "owls", "rain"][i % 4]
        if i % 4 == 3:  # sampled: 3 and 11 seeded (comparable), 7 and 15 not
            return await client.completions.create(
                model=NAMES[0], prompt=words, max_tokens=8, temperature=0.8,
                seed=i if i in (3, 11) else None)
        if i % 4 == 2:
            stream = await client.chat.completions.create(
                model=NAMES[0], messages=[{"role": "user", "content": words}], max_tokens=8,
                temperature=0, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream
                            if c.choices])
        return await client.chat.completions.create(
            model=NAMES[0], messages=[{"role": "user", "content": words}], max_tokens=8,
            temperature=0)

    try:
        answers = await asyncio.gather(*(one(i) for i in range(16)))
        # Once they are done, the first again: its prompt is now in the prefix cache.
        return [*answers, await one(0)]
    finally:
        await client.close()


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_profile_trace_has_meta_and_phases(traced: dict[str, Any]) -> None:
    rows = _jsonl(traced["profile"])
    meta = rows[0]
    assert meta["kind"] == "meta" and meta["commit_sha"] == "abc123"
    assert meta["env_hash"] == ENV_HASH and meta["model"] == "smol-test"
    assert meta["concurrency"] == 16 and meta["runtime_flags"] == {"a": 1}
    assert meta["config_hash"].startswith("sha256:") and meta["detail"] == "layers"
    steps = rows[1:]
    assert steps and all(r["kind"] == "step" for r in steps)
    for r in steps:
        assert {"schedule_ms", "prepare_ms", "forward_ms", "sample_ms", "detokenize_ms",
                "rows", "tokens", "total_ms"} <= set(r)
    # eager steps (fp32, no compile, no decode kernel) carry one time per decoder layer (30)
    assert any(len(r.get("layers_ms", [])) == 30 for r in steps)
    assert max(r["rows"] for r in steps) > 1  # the 16 clients were batched


@pytest.mark.slow
def test_memory_trace_has_every_startup_stage_and_shutdown(traced: dict[str, Any]) -> None:
    rows = _jsonl(traced["memory"])
    assert [r["stage"] for r in rows] == ["process_start", "settings_resolved",
                                          "weights_loaded", "kernels_ready", "kv_allocated",
                                          "compiled", "ready", "shutdown"]
    assert all(r["rss_bytes"] > 0 and r["since_start_s"] >= 0 for r in rows)
    assert rows[2]["rss_bytes"] > rows[0]["rss_bytes"]  # the weights are in memory


@pytest.mark.slow
def test_scheduler_trace_counts_every_step(traced: dict[str, Any]) -> None:
    rows = _jsonl(traced["sched"])
    keys = {"step", "running", "waiting", "swapped", "prefill_tokens", "decode_tokens",
            "prefix_cache_hit_tokens", "preemptions", "kv_blocks_free", "kv_blocks_total"}
    assert rows and all(keys <= set(r) for r in rows)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert sum(r["prefill_tokens"] for r in rows) > 0 and sum(r["decode_tokens"] for r in rows)
    assert max(r["running"] for r in rows) > 1
    # the 17th request repeats the first, whose prompt blocks are cached by then
    assert sum(r["prefix_cache_hit_tokens"] for r in rows) > 0


@pytest.mark.slow
def test_request_dump_has_one_sanitized_bundle_per_request(traced: dict[str, Any]) -> None:
    bundles = [json.loads(p.read_text()) for p in sorted(traced["dump"].glob("*.json"))]
    assert len(bundles) == 17
    text = json.dumps(bundles)
    assert API_KEY not in text and "authorization" not in text.lower()
    for b in bundles:
        assert b["endpoint"] in ("chat/completions", "completions") and b["error"] is None
        assert b["effective_config_hash"].startswith("sha256:")
        assert b["timings"]["total_s"] > 0
        c = b["choices"][0]
        assert c["prompt_token_ids"] and 1 <= len(c["output_token_ids"]) <= 8
        assert c["sampling_params"]["max_tokens"] == 8
        assert c["finish_reason"] == ("length" if len(c["output_token_ids"]) == 8 else "stop")
    streamed = [b for b in bundles if b["request"].get("stream")]
    assert len(streamed) == 4
    assert sorted(b["choices"][0]["text"] for b in streamed) == sorted(
        a for a in traced["answers"] if isinstance(a, str))


@pytest.mark.slow
def test_replay_against_a_fresh_server_matches_greedy_and_seeded(
        traced: dict[str, Any], tmp_path: Path, gguf_path: Path) -> None:
    gen = _serve(tmp_path, gguf_path)
    server = next(gen)
    try:
        r = subprocess.run([sys.executable, "-m", "kiln", "replay", str(traced["dump"]),
                            "--url", server.base_url, "--api-key", API_KEY, "--json"],
                           check=False, capture_output=True, text=True, timeout=600)
    finally:
        gen.close()
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["requests"] == 17 and report["differences"] == 0 and not report["failed"]
    assert report["matched"] == 15 and report["not_comparable"] == 2


# -- faults while serving ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> Any:
    yield from _serve(tmp_path_factory.mktemp("faulty"), gguf_path,
                      "--diagnostic-fault", "step_raise:3", "--diagnostic-fault", "drop_stream:2")


def _integrity(server: Server) -> dict[str, Any]:
    """/health once the engine went idle and checked its KV cache (faults on: kv_integrity)."""
    deadline = time.monotonic() + 30
    while True:
        h = _wait_idle(server)
        if h.get("kv_integrity") == "ok" and h["kv_blocks_free"] == h["kv_blocks_total"]:
            return h
        if time.monotonic() > deadline:
            pytest.fail(f"KV blocks leaked or not checked: {h}")
        time.sleep(0.2)


@pytest.mark.slow
def test_step_raise_is_a_500_for_that_request_and_the_server_goes_on(faulty: Server) -> None:
    """First test on `faulty`: the server's 4th model step raises (this request's 4th)."""
    client = faulty.client()
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=NAMES[0], max_tokens=8, temperature=0,
                                       messages=[{"role": "user", "content": "Hi"}])
    err = e.value.body
    assert err["code"] == "engine_step_failed" and "step_raise:3" in err["message"]
    _integrity(faulty)
    ok = client.chat.completions.create(model=NAMES[0], max_tokens=8, temperature=0,
                                        messages=[{"role": "user", "content": "Hi"}])
    assert ok.choices[0].finish_reason == "length" and faulty.proc.poll() is None


@pytest.mark.slow
def test_drop_stream_cuts_one_stream_and_others_finish(faulty: Server) -> None:
    async def both() -> tuple[list[str], Any]:
        async with httpx.AsyncClient(base_url=faulty.base_url, timeout=60,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            async def stream() -> list[str]:
                lines: list[str] = []
                body = {"model": NAMES[0], "prompt": "Once upon a time", "max_tokens": 16,
                        "temperature": 0, "stream": True}
                try:
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                lines.append(line[6:])
                except httpx.HTTPError:
                    pass  # the cut connection
                return lines

            async def plain() -> Any:
                await asyncio.sleep(0.05)
                r = await http.post("/v1/completions", json={
                    "model": NAMES[0], "prompt": "The sea", "max_tokens": 16,
                    "temperature": 0})
                return r.json()

            return await asyncio.gather(stream(), plain())

    lines, other = asyncio.run(both())
    assert len(lines) == 2 and "[DONE]" not in lines  # cut after 2 chunks
    assert other["choices"][0]["finish_reason"] == "length"
    _integrity(faulty)
    assert faulty.proc.poll() is None


@pytest.mark.slow
def test_startup_fault_fails_with_a_clear_error_and_writes_the_artifacts(
        tmp_path: Path, gguf_path: Path) -> None:
    eff, trace, mem = (tmp_path / "eff.json", tmp_path / "trace.jsonl",
                       tmp_path / "mem.jsonl")
    r = subprocess.run(
        [sys.executable, "-m", "kiln", "serve", str(gguf_path), "--port", "1", "--device", "cpu",
         "--dtype", "float32", "--no-compile", "--kv-cache-memory", "64MiB",
         "--max-model-len", "1024", "--diagnostic-fault", "startup:kv_allocated",
         "--effective-config-json", str(eff), "--decision-trace-jsonl", str(trace),
         "--memory-profile-jsonl", str(mem)],
        check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert "kiln: error (load): " in r.stderr and "startup:kv_allocated" in r.stderr
    assert "Traceback" not in r.stderr
    doc = json.loads(eff.read_text())
    assert doc["status"] == "failed" and doc["error"]["type"] == "DiagnosticFault"
    assert doc["error"]["code"] == "fault.startup"
    assert doc["settings"]["diagnostic_faults"]["value"] == ["startup:kv_allocated"]
    last = _jsonl(trace)[-1]
    assert last["decision"] == "startup" and last["status"] == "failed"
    assert [x["stage"] for x in _jsonl(mem)][-2:] == ["kv_allocated", "shutdown"]
