"""What the model runner decides once at startup (engine/decisions.py): the KV dtype, the decode
path, whether torch.compile compiled anything, dense copies; each with the reason the effective
config records. The layer-kernel path is checked for real in test_kernel_layer.py (where the
kernels run); here the decision logic runs on a tiny fp32 model on any machine."""

from __future__ import annotations

import pytest
from conftest import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("dec") / "llama"))


def runner(model: str, **kw):
    from kiln.engine.model_runner import ModelRunner
    from kiln.models.loader import open_checkpoint
    from kiln.settings.engine_config import EngineConfig

    cfg = EngineConfig.of(model=model, dtype="float32", max_num_batched_tokens=32,
                       kv_cache_memory=80 << 10, **kw)
    return ModelRunner(cfg, open_checkpoint(model))


def test_an_fp32_runner_records_eager_decode_and_the_kv_dtype_of_its_model_dtype(tiny):
    """Without --compile and nothing quantized: eager decode, each decision with its reason."""
    r = runner(tiny)
    d = r.decisions.to_dict()
    assert d["kv_cache_dtype"]["value"] == r.kv_dtype_name == "fp32"
    assert d["kv_cache_dtype"]["code"] == "kv_cache_dtype.model_dtype"
    assert "float32" in d["kv_cache_dtype"]["reason"]  # the dtype it follows
    assert d["decode_path"]["value"] == "eager" and r.decode_kernel_rows == 0
    assert d["decode_path"]["code"] == "decode_path.eager_compile_off"
    assert "--compile" in d["decode_path"]["reason"]  # the flag that changes it
    assert d["compiled"] == {"value": False, "reason": "--compile is off",
                             "code": "compiled.compile_off"}
    assert d["dense_weights"]["value"] is False
    assert d["dense_weights"]["code"] == "dense_weights.nothing_quantized"


def test_kv_cache_dtype_auto_resolves_in_the_settings_table_from_the_dtype():
    from kiln.settings.resolve import resolve_settings
    from kiln.settings.rules import AutoContext

    for cpu_bf16, kv in ((True, "bf16"), (False, "fp32")):
        s = resolve_settings(ctx=AutoContext(cpu_bf16=cpu_bf16))
        assert s["kv_cache_dtype"] == kv and s.source("kv_cache_dtype") == "auto"
        assert s.values["kv_cache_dtype"].code == "kv_cache_dtype.model_dtype"
        assert s["dtype"] in s.values["kv_cache_dtype"].reason
    cli = resolve_settings(cli={"dtype": ("float16", "--dtype")})
    assert cli["kv_cache_dtype"] == "fp16"
    explicit = resolve_settings(cli={"kv_cache_dtype": ("int8", "--kv-cache-dtype")})
    assert explicit["kv_cache_dtype"] == "int8" and explicit.source("kv_cache_dtype") == "cli"
    vllm = resolve_settings(cli={"engine": ("vllm", "--engine")})
    assert vllm["kv_cache_dtype"] == "auto"  # the external engine keeps its own
    assert vllm.values["kv_cache_dtype"].code == "kv_cache_dtype.external_engine"
    # quantized weights on a CPU: fp16 keys and values (llama.cpp's storage, half of fp32)
    q = resolve_settings(ctx=AutoContext(model_quant="Q4_K_M"))
    assert (q["quantization"], q["dtype"], q["kv_cache_dtype"]) == ("int4", "float32", "fp16")
    assert q.values["kv_cache_dtype"].code == "kv_cache_dtype.fp16_for_quantized_cpu"
    exact = resolve_settings(ctx=AutoContext(model_quant="Q4_K_M"),
                             cli={"quantization": ("none", "--quantization")})
    assert exact["kv_cache_dtype"] == "fp32"
    # without kiln's kernels an fp16 pool would be converted per step: the model dtype
    plain = resolve_settings(ctx=AutoContext(model_quant="Q4_K_M", cpu_kernels=False))
    assert plain["kv_cache_dtype"] == "fp32"


@pytest.mark.parametrize(("max_num_seqs", "compile_", "path", "code", "buckets"), [
    (4, True, "kernel", "decode_path.kernel_every_batch", ()),
    (256, True, "kernel+compiled", "decode_path.kernel_then_compiled", (128, 256)),
    (256, False, "kernel+eager", "decode_path.kernel_then_eager", ()),
])
def test_layers_that_run_the_kernel_choose_it_and_compile_only_what_it_leaves(
        tiny, monkeypatch, max_num_seqs, compile_, path, code, buckets):
    """decide() over layers that say they run kiln's decode-layer kernel up to 64 rows (as int4
    bf16 layers on a kernel-read pool do): those batches need no graph."""
    from kiln.engine.decisions import choose_kv_cache_dtype, decide
    from kiln.models import llama
    from kiln.settings.engine_config import EngineConfig

    r = runner(tiny)
    monkeypatch.setattr(llama.LlamaDecoderLayer, "decode_kernel_rows", lambda self: 64)
    cfg = EngineConfig.of(model=tiny, dtype="float32", max_num_seqs=max_num_seqs,
                       compile=compile_, batch_invariant=False)
    d = decide(cfg, r.model, r.device, choose_kv_cache_dtype(cfg, r.device))
    assert d.decode_path.value == path and d.decode_kernel_rows == 64
    assert d.decode_path.code == code and "up to 64 rows" in d.decode_path.reason
    assert d.compile_buckets == buckets and d.compiled.value is bool(buckets)
    if compile_ and not buckets:
        assert d.compiled.code == "compiled.layer_kernel" and "up to 64 rows" in d.compiled.reason
    if buckets:
        assert d.compiled.code == "compiled.buckets"
        assert "[128, 256]" in d.decode_path.reason and "[128, 256]" in d.compiled.reason


def test_an_unknown_kv_cache_dtype_is_refused_with_the_choices():
    import torch

    from kiln.engine.decisions import choose_kv_cache_dtype
    from kiln.errors import ConfigError
    from kiln.settings.engine_config import EngineConfig

    with pytest.raises(ConfigError) as e:
        choose_kv_cache_dtype(EngineConfig.of(model="m", kv_cache_dtype="int3"),
                              torch.device("cpu"))
    assert e.value.hint is not None and "int8" in e.value.hint


@pytest.mark.parametrize(("dense", "value", "code", "words"), [
    (True, True, "dense_weights.kept", "9 of 9"),  # 2 layers x 4, the head
    (False, False, "dense_weights.off", "dense_weights off"),  # the setting to turn on
])
def test_dense_copies_are_reported_as_kept_or_not(tiny, dense, value, code, words):
    # --no-batch-invariant: with it, the int8 head runs q8_linear, no copy (below)
    r = runner(tiny, quantization="int8", dense_weights=dense, batch_invariant=False)
    d = r.decisions.dense_weights
    assert d.value is value and d.code == code and words in d.reason, d.reason


def test_a_batch_invariant_int8_head_keeps_no_dense_copy_and_says_why(tiny, kernel_level):
    r = runner(tiny, quantization="int8", dense_weights=True)
    assert r.model.lm_head.q8
    d = r.decisions.dense_weights
    assert d.value is True and d.code == "dense_weights.kept" and "8 of 9" in d.reason
    assert "--batch-invariant" in d.reason  # why the head keeps none
    k = r.decisions.cpu_kernels
    assert k.value == kernel_level and k.code == "cpu_kernels.chosen"
    assert "9 on " in k.reason, k.reason


def test_a_moe_model_asked_to_compile_decodes_eagerly_and_says_why(tmp_path):
    """The experts' forward is data-dependent (which experts run depends on the routing), so
    an MoE runner turns --compile off with the reason, which the effective config records."""
    moe = str(make_tiny_model("mixtral", tmp_path / "mixtral"))
    r = runner(moe, compile=True)
    d = r.decisions
    assert d.compiled.value is False and d.compile_buckets == () and r.graphs is None
    assert d.compiled.code == "compiled.moe" and "8 experts" in d.compiled.reason
    assert d.decode_path.value == "eager" and d.decode_path.code == "decode_path.eager_uncompilable"
    # Without --compile nothing is turned off: the usual reason.
    assert runner(moe).decisions.compiled.code == "compiled.compile_off"
