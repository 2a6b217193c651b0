"""benchmarks/moe_model.py: the MoE benchmark models route like trained models. A tiny version
(2 layers, hidden 256, 64 experts of width 64) is written with its routers fitted, and kiln's
engine, reading the written file, spreads text the routers were not fitted on over every expert,
the busiest k taking well under half; the first model's random routers (`--router random`) do
not, so the criterion can fail."""

from __future__ import annotations

from pathlib import Path

import pytest

TINY = ["--layers", "2", "--hidden", "256", "--experts", "64", "--expert-width", "64",
        "--heads", "4", "--head-dim", "64", "--kv-heads", "2"]
TINY_DEEPSEEK = ["--arch", "deepseek2", "--layers", "2", "--hidden", "256", "--experts", "64",
                 "--expert-width", "64", "--heads", "4", "--dense-width", "512",
                 "--q-lora-rank", "128", "--kv-lora-rank", "64", "--nope-dim", "32",
                 "--rope-dim", "32", "--v-dim", "32"]


@pytest.fixture(autouse=True)
def short_texts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shorter fixed texts than the benchmark models' (the test's time): the routers are fitted
    on 1024 tokens of the prose, the report reads 1024 others and decodes 16."""
    import benchmarks.moe_model as mm

    monkeypatch.setattr(mm, "FIT_TOKENS", (0, 1024))
    monkeypatch.setattr(mm, "REPORT_DECODE_TOKENS", 16)


def _report(tmp_path: Path, gguf_path: Path, tokenizer, args: list[str]) -> list:
    from benchmarks.moe_model import main, routing_report

    path = tmp_path / "model.gguf"
    assert main([*args, "--out", str(path), "--tokenizer-from", str(gguf_path)]) == 0
    return routing_report(path, tokenizer)


@pytest.mark.parametrize("args, k, moe_layers", [(TINY, 8, [0, 1]),
                                                 (TINY_DEEPSEEK, 6, [1])],
                         ids=["qwen3moe", "deepseek2"])
def test_fitted_routers_spread_text_they_were_not_fitted_on(tmp_path, gguf_path,
                                                            smollm2_tokenizer, args, k,
                                                            moe_layers):
    from benchmarks.moe_model import LayerRouting

    rows = _report(tmp_path, gguf_path, smollm2_tokenizer, args)
    assert [r.layer for r in rows] == moe_layers
    for r in rows:
        prose = r.counts["prose"]
        assert sum(prose) == 1024 * k
        assert min(prose) > 0, f"layer {r.layer}: an expert never chosen"
        assert LayerRouting.top_share(prose, k) < 0.35
        assert LayerRouting.entropy_bits(prose) > 5.5  # of log2(64) = 6
        decode = r.counts["decode"]
        assert sum(decode) == 16 * k
        assert len([n for n in decode if n]) > 3 * k  # not the same few experts every step


def test_the_first_models_random_routers_send_most_tokens_to_a_few_experts(
        tmp_path, gguf_path, smollm2_tokenizer):
    from benchmarks.moe_model import LayerRouting

    rows = _report(tmp_path, gguf_path, smollm2_tokenizer, [*TINY, "--router", "random"])
    assert max(LayerRouting.top_share(r.counts["prose"], 8) for r in rows) > 0.5


def test_a_deepseek2_gguf_brings_its_tokenizer(tmp_path, gguf_path, smollm2_tokenizer):
    """transformers' GGUF loader refuses the deepseek2 architecture before it reads the
    tokenizer; kiln builds it from the file's tokenizer metadata (DeepSeek-V2/V3 GGUFs served
    as they are): the same ids as the GGUF it was copied from."""
    from benchmarks.moe_model import main
    from kiln.tokenizer import load_tokenizer

    path = tmp_path / "deepseek2.gguf"
    assert main([*TINY_DEEPSEEK, "--out", str(path),
                 "--tokenizer-from", str(gguf_path)]) == 0
    text = "The capital of France is Paris. 123 + 4 = 127!"
    assert load_tokenizer(path).encode(text) == smollm2_tokenizer.encode(text)
