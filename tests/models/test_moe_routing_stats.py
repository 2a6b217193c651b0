"""MoE routing statistics: the engine's per-layer, per-expert token counters, as /metrics renders
them (Prometheus text) and as `kiln bench --offline` reports them. A tiny random Qwen3-MoE (8
experts, top-2, layer 1 dense) runs on CPU in fp32, eager."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY_MOE, add_word_tokenizer, make_tiny_model

TOP_K = TINY_MOE["qwen3_moe"]["num_experts_per_tok"]
EXPERTS = TINY_MOE["qwen3_moe"]["num_experts"]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("moe") / "qwen3_moe")
    add_word_tokenizer(folder)
    return folder


def _engine(model: Path, **kw: Any) -> Any:
    from kiln.engine.engine import Engine
    from kiln.settings.engine_config import EngineConfig

    cfg = EngineConfig.of(model=str(model), dtype="float32", max_num_batched_tokens=64,
                       kv_cache_memory=1 << 20, compile=False, **kw)
    return Engine(cfg)


def _generate(engine: Any, prompts: list[list[int]], max_tokens: int) -> None:
    from conftest import run_to_completion

    from kiln.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    run_to_completion(engine)


PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82, 81], [1, 41, 42, 13, 56, 23]]


def test_every_computed_token_is_routed_to_top_k_experts_of_each_moe_layer(tiny_moe):
    engine = _engine(tiny_moe)
    # Layer 1 is dense (mlp_only_layers): it has no router, so no counters.
    assert engine.moe_layers == [0, 2]
    # The memory profile's dummy prefill at load does not count.
    assert all(sum(c) == 0 for c in engine.routing_stats().values())
    _generate(engine, PROMPTS, max_tokens=5)
    tokens = engine.stats.tokens_computed
    assert tokens == sum(map(len, PROMPTS)) + 3 * 4  # the last sampled token is not computed
    stats = engine.routing_stats()
    assert set(stats) == {0, 2}
    for counts in stats.values():
        assert len(counts) == EXPERTS and sum(counts) == tokens * TOP_K
        assert max(counts) <= tokens  # an expert takes a token at most once


def test_a_dense_model_has_no_routing_stats(tmp_path):
    engine = _engine(make_tiny_model("llama", tmp_path / "llama"))
    assert engine.routing_stats() == {} and engine.routing_counts() is None
    from kiln.server.metrics import render

    assert "moe" not in render(engine.metrics(), "m", engine.routing_stats())


def _parse_prometheus(text: str) -> dict[str, dict[str, Any]]:
    """{name: {"type", "samples": [(labels, value)]}} by prometheus_client's own parser (which
    rejects malformed text); a counter is keyed by its `_total` sample name, as scraped."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, dict[str, Any]] = {}
    for fam in text_string_to_metric_families(text):
        key = fam.name + ("_total" if fam.type == "counter" else "")
        assert key not in families, f"second family {key}"
        families[key] = {"type": fam.type, "samples": [
            (s.labels, s.value) for s in fam.samples if s.name == key]}
    return families


def test_metrics_endpoint_renders_routing_counters_and_a_summary_per_layer(tiny_moe):
    from fastapi.testclient import TestClient

    from kiln.engine.async_engine import AsyncEngine
    from kiln.sampling_params import SamplingParams
    from kiln.server.app import build_app

    engine = _engine(tiny_moe)
    aeng = AsyncEngine(engine).start()
    try:
        async def one(i: int, prompt: list[int]) -> None:
            params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            async for _ in aeng.generate(f"a{i}", prompt, params):
                pass

        async def all_of_them() -> None:
            await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))

        asyncio.run(all_of_them())
        app = build_app(aeng, None, ["tiny-moe"], api_key="k", max_model_len=256, version="t")
        text = TestClient(app).get("/metrics").text
    finally:
        aeng.shutdown()

    fam = _parse_prometheus(text)
    # Every computed token is one or the other (a prompt's last token counts as generation).
    tokens = fam["kiln:prompt_tokens_total"]["samples"][0][1] + fam[
        "kiln:generation_tokens_total"]["samples"][0][1]
    assert tokens == sum(map(len, PROMPTS)) + 3 * 3
    routed = fam["kiln:moe_expert_tokens_total"]
    assert routed["type"] == "counter"
    per_layer: dict[str, float] = {}
    for labels, value in routed["samples"]:
        assert labels["model_name"] == "tiny-moe" and 0 <= int(labels["expert"]) < EXPERTS
        per_layer[labels["layer"]] = per_layer.get(labels["layer"], 0) + value
    assert per_layer == {"0": tokens * TOP_K, "2": tokens * TOP_K}
    assert len(routed["samples"]) == 2 * EXPERTS
    imbalance = fam["kiln:moe_expert_load_imbalance"]
    assert imbalance["type"] == "gauge"
    assert {s[0]["layer"] for s in imbalance["samples"]} == {"0", "2"}
    assert all(1.0 <= v <= EXPERTS for _, v in imbalance["samples"])
    assert fam["kiln:moe_experts_idle"]["type"] == "gauge"


def test_layer_summary_says_min_mean_max_imbalance_and_idle_experts():
    from kiln.server.metrics import moe_layer_summary

    s = moe_layer_summary([0, 2, 6, 0])
    assert s == {"min": 0.0, "mean": 2.0, "max": 6.0, "imbalance": 3.0, "idle": 2.0}
    assert math.isnan(moe_layer_summary([0, 0])["imbalance"])


@pytest.mark.slow
def test_offline_bench_reports_routing_per_moe_layer(tiny_moe, tmp_path):
    from kiln.bench.offline import run_offline
    from kiln.bench.report import format_offline, write_json

    small = {"kv_cache_memory": 4 << 20, "max_model_len": 256, "compile": False,
             "dtype": "float32"}
    result = run_offline(str(tiny_moe), prefill_len=16, batch_sizes=[2], decode_tokens=4,
                         repeats=1, engine_overrides=small)
    assert [r["layer"] for r in result.moe_routing] == [0, 2]
    for r in result.moe_routing:
        assert r["experts"] == EXPERTS and r["tokens"] > 0
        assert r["tokens"] == r["mean"] * EXPERTS and r["min"] <= r["mean"] <= r["max"]
        assert r["imbalance"] == pytest.approx(r["max"] / r["mean"])
    text = format_offline(result)
    assert "MoE routing" in text and "imbalance" in text
    # the roofline counts the experts a 2-row step reads, not all of them
    roof = result.decode[0].roofline
    assert 0 < roof["expert_bytes"] < roof["expert_total_bytes"] < roof["weight_bytes"] + \
        roof["expert_total_bytes"]
    assert "of them experts MB" in text
    data = json.loads(write_json(tmp_path / "b.json", result.to_json()).read_text())
    assert data["moe_routing"][0]["layer"] == 0


def test_roofline_counts_the_experts_a_step_selects():
    """kiln.bench.roofline.expert_bytes: one row reads its k experts (k * p summed is k), many
    rows approach all of them; a skewed routing reads fewer distinct experts at a batch."""
    import torch
    from torch import nn

    from kiln.bench.roofline import expert_bytes
    from kiln.layers.moe import Experts

    model = nn.Module()
    model.config = type("C", (), {"num_experts_per_tok": 2})()
    model.experts = Experts(8, 32, 32)
    per = model.experts.storage_bytes() / 8
    read, total = expert_bytes(model, 1)
    assert total == model.experts.storage_bytes() and read == pytest.approx(2 * per, rel=1e-6)
    assert expert_bytes(model, 256)[0] == pytest.approx(8 * per, rel=1e-3)
    uniform = expert_bytes(model, 4)[0]
    model.experts.tokens_per_expert = torch.tensor([100, 100, 1, 1, 1, 1, 1, 1])
    assert expert_bytes(model, 4)[0] < uniform
