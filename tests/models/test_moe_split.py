"""Experts split into pools in kiln's own engine (`--cpu-offload-experts`): a device pool and CPU
host pools, each layer's hottest experts (by a calibration pass) on the device. On this machine
the "device" is the CPU too, so the split path runs as two CPU executors: the device pool on the
engine's thread, the host pool on its own worker thread. Tiny random Qwen3-MoE (8 experts, top-2,
layers 0 and 2 MoE), float32 safetensors and a Q4_0 GGUF (int4 experts: kiln's moe_q4 kernel on
AVX2 CPUs, whose -1 ids skip the other pool's pairs)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_MOE, add_word_tokenizer, make_tiny_model, run_to_completion

from kiln.engine import expert_placement
from kiln.engine.engine import Engine
from kiln.engine.expert_placement import CALIBRATION_PROMPTS, place_layer, rank
from kiln.engine.model_runner import ModelRunner
from kiln.i18n import msg
from kiln.layers.moe import experts_of, reset_routing_counts
from kiln.layers.moe_pools import SplitExperts
from kiln.models.gguf_writer import write_gguf
from kiln.models.loader import iter_tensors, open_checkpoint
from kiln.sampling_params import SamplingParams
from kiln.settings.engine_config import EngineConfig

EXPERTS = TINY_MOE["qwen3_moe"]["num_experts"]
TOP_K = TINY_MOE["qwen3_moe"]["num_experts_per_tok"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("split")
    folder = make_tiny_model("qwen3_moe", root / "qwen3_moe")
    add_word_tokenizer(folder)
    ck = open_checkpoint(folder)
    q4 = write_gguf(root / "qwen3_moe-q4_0.gguf", ck.config, iter_tensors(ck), qtype="Q4_0")
    return {"f32": folder, "q4": q4}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))  # calibration cache per test
    # The pools as a GPU runs them: on a CPU "device" they are one pool by default (the last
    # test), which would leave the split path these tests cover unrun.
    monkeypatch.setattr(expert_placement, "POOLS_ON_CPU", True)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CALIBRATION = [_prompt(24, 100), _prompt(16, 101)]


def _config(path: Path, quant: str, **kw: Any) -> EngineConfig:
    return EngineConfig.of(model=str(path), dtype="float32", quantization=quant,
                        kv_cache_memory=4 << 20, max_num_batched_tokens=16, compile=False, **kw)


def _split(**kw: Any) -> dict[str, Any]:
    return {"cpu_offload_experts": True, "num_gpu_experts": 2, "kt_cpuinfer": 1,
            "kt_threadpool_count": 1, **kw}


@pytest.mark.parametrize("form,quant", [("f32", "none"), ("q4", "int4")])
def test_split_logits_match_one_pool(tiny, form, quant):
    """2 of 8 experts per layer on the "device", 6 on the host pool: the logits of a 40-token
    prompt are those of all experts in one pool (within 1e-3; float sums in another order)."""
    path = tiny[form]
    prompt = _prompt(40, 3)
    one = ModelRunner(_config(path, quant), open_checkpoint(path))
    want = one.prompt_logits(prompt)
    split = ModelRunner(_config(path, quant, **_split()), open_checkpoint(path),
                        calibration_ids=CALIBRATION)
    got = split.prompt_logits(prompt)
    assert (got - want).abs().max().item() < 1e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    plan = split.placement
    assert plan is not None and plan.num_device_experts == 2 and plan.bytes_measured
    layers = experts_of(split.model)
    assert [m.layer for m in layers] == [0, 2] and all(isinstance(m, SplitExperts)
                                                       for m in layers)
    for lp, m in zip(plan.layers, layers):
        # every expert in exactly one pool; the device pool holds the plan's two
        assert sorted(lp.device_experts + [e for g in lp.host_experts for e in g]) == \
            list(range(EXPERTS))
        assert m.device_ids == lp.device_experts and m.device_pool.num_experts == 2
        assert sum(p.num_experts for p in m.host_pools) == EXPERTS - 2
        dev_bytes, host_bytes = m.pool_bytes()
        assert dev_bytes * 3 == host_bytes  # 2 vs 6 experts of one size


def test_device_experts_are_the_calibrated_hottest(tiny):
    """The calibration pass counts each MoE layer's routing over the built-in prompts; the device
    pool gets each layer's two most-routed experts, and its calibrated share is reported."""
    path = tiny["f32"]
    one = ModelRunner(_config(path, "none"), open_checkpoint(path))
    reset_routing_counts(experts_of(one.model))  # not the memory profile's prefill
    for ids in CALIBRATION:  # what the calibration pass sees, counted by the plain model
        one.prompt_logits(ids)
    counts = [m.tokens_per_expert.tolist() for m in experts_of(one.model)]
    assert all(sum(c) == TOP_K * sum(map(len, CALIBRATION)) for c in counts)
    split = ModelRunner(_config(path, "none", **_split()), open_checkpoint(path),
                        calibration_ids=CALIBRATION)
    plan = split.placement
    assert plan.hot_code == "expert_ranking.calibrated" and "40" in plan.hot  # its tokens
    for lp, c in zip(plan.layers, counts):
        assert lp.device_experts == sorted(rank(c)[:2])
        assert lp.device_share == pytest.approx(sum(c[e] for e in lp.device_experts) / sum(c),
                                                abs=1e-4)


def test_calibration_is_cached_then_reused_and_can_be_turned_off(tiny, tmp_path):
    path = tiny["f32"]
    first = ModelRunner(_config(path, "none", **_split()), open_checkpoint(path),
                        calibration_ids=CALIBRATION).placement
    cached = list((tmp_path / "cache" / "expert-stats").glob("*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["tokens"] == 40
    again = ModelRunner(_config(path, "none", **_split()), open_checkpoint(path),
                        calibration_ids=None).placement
    assert again.hot_code == "expert_ranking.cached"
    assert [lp.device_experts for lp in again.layers] == [lp.device_experts
                                                          for lp in first.layers]
    off = ModelRunner(_config(path, "none", **_split(expert_calibration="off")),
                      open_checkpoint(path), calibration_ids=CALIBRATION).placement
    assert off.hot_code == "expert_ranking.calibration_off"
    # off means off: the cached ranking is not used either
    assert all(lp.device_experts == [0, 1] for lp in off.layers)


def test_place_layer_deals_host_experts_to_pools_by_rank():
    counts = [5, 90, 3, 40, 0, 70, 8, 1]
    device, pools = place_layer(0, counts, 8, 3, host_pools=2)
    assert device == [1, 3, 5]  # the three hottest
    # the rest in rank order (6, 0, 2, 7, 4) dealt alternately: similar loads per pool
    assert pools == [[2, 4, 6], [0, 7]]
    assert place_layer(0, None, 8, 3, host_pools=1) == ([0, 1, 2], [[3, 4, 5, 6, 7]])


def _greedy(engine: Engine, prompts: list[list[int]], max_tokens: int = 12) -> dict[str, list]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    return run_to_completion(engine)


@pytest.mark.parametrize("quant", ["none", "int4"])
@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "threads"])
def test_split_greedy_tokens_identical_batched_chunked_and_streamed(tiny, quant, threaded,
                                                                     monkeypatch):
    """Five prompts batched, prefill chunked at 16 tokens: the same greedy tokens with the experts
    in one pool, split across two pools, split across three (two host pools), and split with
    long chunks run with every expert on the device (--kt-gpu-prefill-token-threshold 8). The
    host pools run on the engine's thread (a CPU "device"'s default) or, as with a GPU, on their
    own worker threads."""
    monkeypatch.setattr(expert_placement, "HOST_THREADS_ON_CPU", threaded)
    path = tiny["f32" if quant == "none" else "q4"]
    prompts = [_prompt(n, 10 + n) for n in (5, 23, 9, 31, 14)]
    want = _greedy(Engine(_config(path, quant)), prompts)
    seen: set[str] = set()
    for kw in (_split(), _split(kt_threadpool_count=2), _split(kt_gpu_prefill_token_threshold=8)):
        engine = Engine(_config(path, quant, **kw))
        assert engine.runner.placement.host_inline is not threaded
        for m in experts_of(engine.runner.model):
            for pool in m.host_pools:
                pool.register_forward_hook(
                    lambda *a: seen.add(threading.current_thread().name))
        assert _greedy(engine, prompts) == want, kw
    # the host pools ran on their own threads, or inline; streamed, on the engine's
    assert any(name.startswith("kiln-experts-") for name in seen) is threaded
    assert threading.current_thread().name in seen


def test_split_counts_routing_in_global_expert_ids(tiny):
    engine = Engine(_config(tiny["f32"], "none", **_split()))
    prompts = [_prompt(12, 7), _prompt(6, 8)]
    _greedy(engine, prompts, max_tokens=4)
    stats = engine.routing_stats()
    computed = engine.stats.tokens_computed
    assert set(stats) == {0, 2}
    assert all(len(c) == EXPERTS and sum(c) == TOP_K * computed for c in stats.values())


def test_llm_with_split_experts_records_the_measured_plan(tiny):
    """Through the front-ends' path (LLM = kiln serve's resolution and build): the calibration
    prompts are tokenized by the model's tokenizer, the text equals the one-pool text, and the
    effective config carries the measured plan and its reasons."""
    from kiln.llm import LLM

    kw = {"dtype": "float32", "compile": False, "kv_cache_memory": 4 << 20,
          "max_model_len": 256}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    text = "the quick brown fox jumps over the lazy dog"
    want = LLM(str(tiny["f32"]), **kw).generate([text], params)[0].outputs[0].text
    llm = LLM(str(tiny["f32"]), cpu_offload_experts=True, num_gpu_experts=3, **kw)
    assert llm.generate([text], params)[0].outputs[0].text == want
    eff = llm.effective_config()
    plan = eff["moe_placement"]
    assert plan["num_device_experts"] == 3 and plan["bytes_measured"]
    assert len(plan["layers"]) == 2 and all(len(lp["device_experts"]) == 3
                                            for lp in plan["layers"])
    tokens = sum(len(llm.tokenizer.encode(p)) for p in CALIBRATION_PROMPTS)
    assert plan["hot_code"] == "expert_ranking.calibrated" and str(tokens) in plan["hot"]
    assert eff["settings"]["num_gpu_experts"]["value"] == 3
    assert eff["settings"]["num_gpu_experts"]["source"] == "cli"
    assert "moe_placement" in eff["decisions"]


def test_dry_run_prints_the_placement_plan(tiny, tmp_path, capsys):
    """`kiln serve MOE --cpu-offload-experts --dry-run`: the plan (per layer: experts and bytes
    per pool, the rule that chose N) in the text, the effective config and the decision trace.
    With no --num-gpu-experts on a CPU, half the experts go to the device pool, and why."""
    from kiln.cli.main import main

    eff, trace = tmp_path / "eff.json", tmp_path / "trace.jsonl"
    rc = main(["serve", str(tiny["f32"]), "--cpu-offload-experts", "--dry-run",
               "--effective-config-json", str(eff), "--decision-trace-jsonl", str(trace)])
    out = capsys.readouterr().out
    assert rc == 0
    assert msg("dry.moe_placement") in out
    assert "layer   0: device [0, 1, 2, 3]" in out and "layer   2:" in out
    data = json.loads(eff.read_text())
    plan = data["moe_placement"]
    assert plan["num_device_experts"] == 4 and not plan["bytes_measured"]
    assert plan["rule_code"] == "num_gpu_experts.cpu_half"
    assert plan["layers"][0]["device_bytes"] == 4 * plan["bytes_per_expert"]
    s = data["settings"]
    assert s["num_gpu_experts"]["value"] == 4
    assert s["num_gpu_experts"]["code"] == "num_gpu_experts.cpu_half"
    assert s["kt_cpuinfer"]["value"] >= 1 and s["kt_threadpool_count"]["value"] >= 1
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert any(r["decision"] == "moe_placement" and "4 of 8" in r["chosen"] for r in rows)


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_on_a_cpu_device_the_pools_run_as_one(tiny, quant, monkeypatch):
    """By default a CPU "device" keeps the layer's experts one pool (issue 41's "two pools without
    a tax: one call for both pools"): the plan is made and reported as for a GPU, no layer gets a
    SplitExperts, int4 decode steps run the one-call MoE layers, and the greedy tokens are those
    of no split at all."""
    from kiln.layers.moe import Experts

    monkeypatch.setattr(expert_placement, "POOLS_ON_CPU", False)
    path = tiny["f32" if quant == "none" else "q4"]
    prompts = [_prompt(n, 20 + n) for n in (5, 23, 9)]
    want = _greedy(Engine(_config(path, quant)), prompts)
    engine = Engine(_config(path, quant, **_split()))
    plan = engine.runner.placement
    assert plan is not None and plan.one_pool and plan.num_device_experts == 2
    assert len(plan.layers) == 2
    assert all(type(m) is Experts for m in experts_of(engine.runner.model))
    if quant == "int4":
        assert engine.runner.decode_kernel_rows > 0
    assert _greedy(engine, prompts) == want
