"""SGLang: `python -m sglang.launch_server --model-path MODEL ...`.

For an MoE model (kt-kernel is on by default there, as with kt-cli; `--no-cpu-offload-experts`
turns it off), the kt-kernel flags put the hot experts on GPU and the rest on CPU
(ktransformers' hybrid MoE). Those flags exist only in kvcache-ai's SGLang build
(`sglang-kt`), which check_plan() notices from --help.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

# The converters and rows every engine shares, as T.*; the table machinery by name.
from kiln.backends import table as T
from kiln.backends.discovery import is_python, python_with_module
from kiln.backends.table import Arg, Backend, EngineCommand, Map, Out, PlanContext, Untranslatable
from kiln.i18n import msg

MODULE = "sglang.launch_server"

KV_CHOICES = ("auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16", "fp4_e2m1")
KV_LITERALS = {"bf16": "bf16"}

SPEC_ALGORITHMS = {None: "STANDALONE", "draft": "STANDALONE", "eagle": "EAGLE",
                   "eagle3": "EAGLE3", "ngram": "NGRAM", "mtp": "NEXTN"}

# kiln's load-time weight-only quantization is torchao's int8/int4 weight-only, which SGLang
# applies through --torchao-config.
TORCHAO = {"int8": "int8wo", "int4": "int4wo-128"}

# These kt methods read the model's own checkpoint (no converted CPU copy).
NATIVE_KT_METHODS = frozenset({"BF16", "FP8", "FP8_PERCHANNEL", "RAWINT4"})

INSTALL = 'pip install "sglang[all]"'
KT_INSTALL = ("hybrid CPU/GPU MoE needs kt-kernel and kvcache-ai's SGLang build: "
              "pip install kt-kernel sglang-kt")


# --------------------------------------------------------------------------- command


def default_command() -> EngineCommand:
    return EngineCommand("sglang", ("python", "-m", MODULE), "--model-path", "default")


def discover() -> EngineCommand | None:
    if importlib.util.find_spec("sglang") is not None:
        return EngineCommand("sglang", (sys.executable, "-m", MODULE), "--model-path",
                             "kiln's venv")
    exe = python_with_module("sglang")
    if exe is not None:
        return EngineCommand("sglang", (exe, "-m", MODULE), "--model-path", "PATH")
    return None


def from_user_command(parts: list[str], source: str) -> EngineCommand:
    if len(parts) == 1 and is_python(parts[0]):
        return EngineCommand("sglang", (parts[0], "-m", MODULE), "--model-path", source)
    return EngineCommand("sglang", tuple(parts), "--model-path", source)


# --------------------------------------------------------------------------- rows


def _names(_: Any, ctx: PlanContext) -> list[Out]:
    names = T.served_names(ctx)
    if not names:
        return []
    if len(names) > 1 and ctx.explicit("served_model_name"):
        # kiln's own extra names (registry id, HF repo) go quietly; names a person gave, not.
        ctx.warn(msg("handoff.sglang_one_name", name=repr(names[0]),
                     aliases=", ".join(names[1:])))
    return [Arg("--served-model-name", names[0])]


def _quant(value: str, _: PlanContext) -> str | None:
    return TORCHAO.get(value)


def _total_tokens(tokens: int | None, ctx: PlanContext) -> list[Out]:
    """--max-total-tokens from --max-total-tokens itself or --kv-max-blocks x --block-size,
    whichever comes from the higher source (a person's --kv-max-blocks beats preset kt's
    40000 tokens; a person's --max-total-tokens beats anything)."""
    blocks = ctx.value("kv_max_blocks")
    if blocks is not None and (tokens is None or ctx.outranks("kv_max_blocks",
                                                              "max_total_tokens")):
        return [Arg("--max-total-tokens", int(blocks) * int(ctx.value("block_size") or 16),
                    "kv_max_blocks")]
    return [Arg("--max-total-tokens", tokens)] if tokens is not None else []


def _tp(tp: int | None, ctx: PlanContext) -> list[Out]:
    """1 is SGLang's default, so it is left out, except with kt-kernel: kt-cli spells the TP
    out on every launch, and the GPU experts (--kt-num-gpu-experts) are sized for it."""
    if not tp or (tp == 1 and not ctx.explicit("tensor_parallel_size")
                  and not _offload_active(ctx)):
        return []
    return [Arg("--tp-size", tp)]


def _nodes(nnodes: int | None, ctx: PlanContext) -> list[Out]:
    if not nnodes or nnodes <= 1:
        return []
    addr = ctx.value("dist_init_addr")
    if not addr:
        raise Untranslatable("error", "SGLang on several nodes needs --dist-init-addr HOST:PORT "
                             "(the rank-0 node's address, the same on every node)",
                             "handoff.sglang_needs_dist_init_addr")
    return [Arg("--nnodes", nnodes), Arg("--node-rank", ctx.value("node_rank") or 0, "node_rank"),
            Arg("--dist-init-addr", addr, "dist_init_addr")]


def _lora(value: Any, ctx: PlanContext) -> list[Out]:
    pairs = T.lora_pairs(value, ctx) if value else []
    return [Arg("--lora-paths", pairs)] if pairs else []


def _speculative(model: str | None, ctx: PlanContext) -> list[Out]:
    k = T.speculative_tokens(model, ctx)
    if k is None:
        return []
    method = ctx.value("speculative_method")
    algo = SPEC_ALGORITHMS.get(method)
    if algo is None:
        raise Untranslatable("error", f"SGLang has no speculative method {method!r}",
                             "handoff.sglang_speculative_method")
    src = "speculative_method" if method is not None else "speculative_model"
    outs: list[Out] = [Arg("--speculative-algorithm", algo, src)]
    if model is not None:
        outs.append(Arg("--speculative-draft-model-path", model, "speculative_model"))
    if algo == "NGRAM":
        outs.append(Arg("--speculative-num-draft-tokens", k, "num_speculative_tokens"))
    else:
        # A chain of k drafted tokens: k draft steps of top-1, verified as k+1 tokens (the
        # verify pass includes the last accepted one), which is SGLang's topk=1 invariant.
        outs += [Arg("--speculative-num-steps", k, "num_speculative_tokens"),
                 Arg("--speculative-eagle-topk", 1, "num_speculative_tokens"),
                 Arg("--speculative-num-draft-tokens", k + 1, "num_speculative_tokens")]
    return outs


def _offload_active(ctx: PlanContext) -> bool:
    return bool(ctx.value("cpu_offload_experts")) and ctx.model.is_moe


def _kt(offload: bool | None, ctx: PlanContext) -> list[Out]:
    if not offload:
        given = [n for n in T.KT_SETTINGS if ctx.explicit(n)]
        if given:
            raise Untranslatable("warn", msg("handoff.kt_needs_offload", flags=", ".join(
                "--" + n.replace("_", "-") for n in given)))
        return []
    if not ctx.model.is_moe:
        raise Untranslatable("warn", msg("handoff.kt_dense"))
    method = ctx.value("kt_method")
    method = str(method).upper() if method else None
    weights = ctx.value("kt_weight_path")
    if not weights:
        # kt-cli's default: kt-kernel reads the experts from the model itself (startup records
        # this for a local folder; a repo id or an exported GGUF lands here).
        weights = ctx.model.path
        if method not in NATIVE_KT_METHODS:
            ctx.warn(msg("handoff.kt_weights_default", method=method or "CPU", path=weights))
    outs: list[Out] = [Arg("--kt-weight-path", weights, "kt_weight_path")]
    if method:
        outs.append(Arg("--kt-method", method, "kt_method"))
    if ctx.value("kt_cpuinfer"):
        outs.append(Arg("--kt-cpuinfer", ctx.value("kt_cpuinfer"), "kt_cpuinfer"))
    elif ctx.value("num_threads"):
        # A plain settings mapping without kt_cpuinfer: --threads is the CPU's share.
        outs.append(Arg("--kt-cpuinfer", ctx.value("num_threads"), "num_threads"))
    if ctx.value("kt_threadpool_count"):
        outs.append(Arg("--kt-threadpool-count", ctx.value("kt_threadpool_count"),
                        "kt_threadpool_count"))
    if ctx.value("num_gpu_experts") is not None:
        outs.append(Arg("--kt-num-gpu-experts", ctx.value("num_gpu_experts"), "num_gpu_experts"))
    else:
        ctx.warn(msg("handoff.kt_no_gpu_experts"))
    if ctx.value("kt_gpu_prefill_token_threshold") is not None:
        outs.append(Arg("--kt-gpu-prefill-token-threshold",
                        ctx.value("kt_gpu_prefill_token_threshold"),
                        "kt_gpu_prefill_token_threshold"))
    return outs


def _number(value: float) -> int | float:
    """3000.0 -> 3000: the line reads as kt-cli's does."""
    return int(value) if float(value).is_integer() else value


def _threads(_: Any, ctx: PlanContext) -> list[Out]:
    if _offload_active(ctx):
        return []  # became --kt-cpuinfer
    raise Untranslatable("warn", msg("handoff.sglang_threads"))


TABLE: tuple[Map, ...] = (
    *T.server_rows(_names),
    Map("device", "--device", convert=lambda v, _: None if v == "auto" else v),
    Map("dtype", "--dtype"),
    Map("seed", "--random-seed"),
    Map("max_model_len", "--context-length"),
    Map("max_num_seqs", "--max-running-requests"),
    Map("max_num_batched_tokens", "--chunked-prefill-size"),
    Map("max_queue", "--max-queued-requests"),
    Map("block_size", "--page-size"),
    Map("gpu_memory_utilization", "--mem-fraction-static"),
    T.kv_cache_dtype_row(KV_LITERALS, KV_CHOICES),
    Map("max_total_tokens", emit=_total_tokens, also=("kv_max_blocks",)),
    Map("enable_prefix_caching", emit=T.switch(off="--disable-radix-cache")),
    Map("compile", emit=T.switch(on="--enable-torch-compile")),
    Map("quantization", "--torchao-config", convert=_quant),
    Map("tensor_parallel_size", emit=_tp, always=True),
    *T.parallel_rows("--tp-size", "--pp-size", _nodes)[1:],
    *T.extension_rows(_lora, _speculative, _kt),
    Map("max_loras", "--max-loras-per-batch"),
    Map("enable_lora_runtime_updates", emit=T.switch(on="--enable-lora")),
    Map("num_threads", emit=_threads),
    # kt-cli's fixed flags, each a setting (preset kt gives them kt-cli's values).
    Map("attention_backend", "--attention-backend"),
    Map("watchdog_timeout", "--watchdog-timeout", convert=lambda v, _: _number(v)),
    Map("enable_mixed_chunk", emit=T.switch(on="--enable-mixed-chunk")),
    Map("enable_p2p_check", emit=T.switch(on="--enable-p2p-check")),
    Map("disable_shared_experts_fusion", emit=T.switch(on="--disable-shared-experts-fusion")),
    Map("trust_remote_code", emit=T.switch(on="--trust-remote-code"), engine_default=False),
    Map("log_level", "--log-level"),
    Map("offline", emit=T.offline_env),
    *T.ignored_rows(
        kv_cache_memory="SGLang sizes its KV pool by --mem-fraction-static or --max-total-tokens; "
        "use --gpu-memory-utilization or --kv-max-blocks",
        cpu_memory_utilization="SGLang sizes memory by --mem-fraction-static on the device",
        # ferrum's scheduler knobs steer kiln's scheduler; SGLang schedules by its own rules.
        sequence_fit_policy="SGLang admits a request by its own rule (KV for the prompt and an "
        "estimate of the output; --schedule-conservativeness tunes it)",
        scheduler_prefill_first_until_active="SGLang already runs waiting prompts' prefill "
        "before the decodes",
        scheduler_prefill_step_chunk="SGLang has no per-request prefill cap; "
        "--chunked-prefill-size (kiln's --max-num-batched-tokens) caps a step's prefill",
        scheduler_active_decode_prefill_chunk="SGLang caps every step's prefill alike, by "
        "--chunked-prefill-size (kiln's --max-num-batched-tokens)",
    ),
)

# name, label, then this module's table and command functions, in Backend's field order
BACKEND = Backend("sglang", "SGLang", TABLE, default_command, discover, from_user_command,
                  help_args=(("--help",),), install_hint=INSTALL,
                  upgrade_hint='pip install -U "sglang[all]"', flag_hints={"--kt-": KT_INSTALL},
                  tokenizer_flag="--tokenizer-path")
