"""What kiln picks when nobody chose: the auto rules of the settings table (kiln/settings/table.py).

Each rule reads the `AutoContext` (hardware probe, model source, what was set explicitly) and the
values of the settings resolved before it (table order: dtype reads device), and returns
(value, reason, code); the reason is what --dry-run and the effective config show, the code
(`dtype.cpu_native_bf16`) says which branch of the rule chose, for the decision trace and tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GiB = 1 << 30


@dataclass
class AutoContext:
    """What auto rules may look at: filled from the hardware probe and the model source."""

    device: str = "cpu"  # already resolved device type: "cpu" or "cuda"
    physical_cores: int = 1
    ram_available_bytes: int = 8 * GiB
    gpu_count: int = 0
    gpu_memory_bytes: int = 0  # per GPU
    gpu_bf16: bool = False
    cpu_bf16: bool = False  # AVX-512 BF16 / AMX granted: bf16 matmuls are fast (kernel layer's probe)
    model_max_len: int | None = None  # from the model config
    weight_bytes: int = 0  # weight bytes on disk
    model_max_tp: int | None = None  # from the registry
    is_moe: bool = False
    numa_nodes: int = 1
    cpu_amx: bool = False  # AMX in the CPU flags (as check_kt tests): kt-kernel's AMX methods
    cpu_kernels: bool = True  # kiln's CPU kernels run here (kiln.layers.kernels: AVX2 or better)
    model_quant: str | None = None  # the checkpoint's own quantization, e.g. GGUF "Q4_1"
    # What the model's files say it is for (kiln.kinds.detect_kind): (kind, reason).
    model_kind: tuple[str, str] | None = None
    # The names a client may ask for the model by: MODEL as given, then its registry id and HF
    # repo (kiln/startup.py); empty when no model is known yet (kiln config show).
    model_names: tuple[str, ...] = ()
    # The model's own Python code its config.json's auto_map names ("" when none).
    model_code: str = ""
    # Settings a person set (cli, env, file; any row of the table): filled by resolve_settings
    # before any rule runs, so a rule can tell "asked for" from "defaulted".
    explicit: set[str] = field(default_factory=set)


# (value, reason, code): the reason in words a person acts on (the flag, the number), the code
# `<setting>.<why>`, stable, naming the rule's branch that chose (the decision trace carries it;
# tests and tools match it instead of the words).
AutoRule = Callable[[AutoContext, dict[str, Any]], tuple[Any, str, str]]


def auto_device(ctx: AutoContext, _: dict[str, Any]) -> tuple[Any, str, str]:
    if ctx.gpu_count:
        return "cuda", f"{ctx.gpu_count} CUDA GPU(s) found", "device.cuda_found"
    return "cpu", "no CUDA GPU found", "device.no_cuda"


def auto_dtype(ctx: AutoContext, v: dict[str, Any]) -> tuple[Any, str, str]:
    if v.get("device") == "cuda":
        if ctx.gpu_bf16:
            return "bfloat16", "GPU supports bf16 (compute capability >= 8.0)", "dtype.gpu_bf16"
        return "float16", "GPU lacks fast bf16", "dtype.gpu_no_bf16"
    if ctx.cpu_kernels and _quantized_checkpoint(ctx.model_quant):
        return ("float32", ("a quantized checkpoint on CPU: kiln's kernels (every ISA level) take "
                            "fp32 activations against its quantized weights"),
                "dtype.quantized_checkpoint_cpu")
    if ctx.cpu_bf16:
        return ("bfloat16", "CPU has AVX-512 BF16/AMX: bf16 matmuls are faster than fp32",
                "dtype.cpu_native_bf16")
    return "float32", "CPU has no native bf16: fp32 is faster and exact", "dtype.cpu_no_native_bf16"


def _quantized_checkpoint(quant: str | None) -> bool:
    return bool(quant) and quant.upper() not in ("F32", "F16", "BF16", "FP32", "FP16")


def auto_quantization(ctx: AutoContext, v: dict[str, Any]) -> tuple[Any, str, str]:
    quant = (ctx.model_quant or "").upper()
    if v.get("engine") in ("vllm", "sglang"):
        return ("none", "the external engine serves the checkpoint as it is",
                "quantization.external_engine")
    if v.get("device") == "cuda":
        return "none", "GPU: dense weights in the model dtype", "quantization.gpu"
    if "dtype" in ctx.explicit and v.get("dtype") == "float32":
        # The quantized kernels compute with bf16 activations: not what float32 asks for.
        return ("none", ("--dtype float32 asks for float32 math: the weights are dequantized to "
                         "float32 (the int4/int8 kernels compute in bf16)"),
                "quantization.float32_asked")
    if not _quantized_checkpoint(quant):
        return "none", "the checkpoint is not quantized", "quantization.not_quantized"
    if quant.startswith(("Q4_0", "Q4_1")):
        return ("int4", (f"CPU and a {quant} GGUF: its 4-bit blocks feed the int4 kernels as they "
                         "are (no requantization); decode reads 4x fewer weight bytes than bf16"),
                "quantization.gguf_4bit_blocks")
    # (the tensors kiln's GGUF-block kernels read stay as they are: see gguf_kernels)
    kept = " (its Q8_0/Q5_x/Q4_K/Q5_K/Q6_K tensors run as they are where --gguf-kernels)"
    if quant.startswith(("Q2", "Q3", "Q4", "IQ")):
        return ("int4", f"CPU and a {quant} GGUF: re-quantized to int4 groups of 32 at load" + kept,
                "quantization.gguf_to_int4")
    return ("int8", f"CPU and a {quant} GGUF: re-quantized to int8 per channel at load" + kept,
            "quantization.gguf_to_int8")


def auto_dense_weights(ctx: AutoContext, v: dict[str, Any]) -> tuple[Any, str, str]:
    if v.get("quantization") in (None, "none"):
        return False, "nothing is quantized", "dense_weights.nothing_quantized"
    if v.get("device") == "cuda":
        return False, "GPU: quantized weights only", "dense_weights.gpu"
    # Upper bound of the bf16 copy: 4-bit weights on disk grow ~4x (int8: 2x).
    copy = ctx.weight_bytes * (4 if v.get("quantization") == "int4" else 2)
    if copy and copy <= ctx.ram_available_bytes // 4:
        return True, (f"the bf16 copy (~{copy / GiB:.2f} GiB at most) fits in a quarter of the "
                      "available RAM: prefill (and, without kiln's CPU kernels, steps of >= 4 "
                      "rows) runs dense (oneDNN-packed) GEMMs, faster there than the quantized "
                      "kernels; int4 layers on kiln's kernels keep none (their int8-activation "
                      "kernel is faster)"), "dense_weights.fits_in_ram"
    return (False, "a bf16 copy of the weights would take over a quarter of the available RAM",
            "dense_weights.too_big")


# The model dtype's name -> the KV cache storing it as it is computed.
_KV_DTYPE_OF = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def auto_kv_cache_dtype(ctx: AutoContext, v: dict[str, Any]) -> tuple[Any, str, str]:
    # The model runner applies this rule too, for an EngineConfig built with "auto" (tests).
    if v.get("engine") in ("vllm", "sglang"):
        return ("auto", "the external engine keeps its KV cache in the model dtype",
                "kv_cache_dtype.external_engine")
    dtype = v["dtype"]
    if (v.get("device") == "cpu" and ctx.cpu_kernels and dtype == "float32"
            and v.get("quantization") in ("int4", "int8")):
        return ("fp16", ("CPU with quantized weights: keys and values stored in fp16, as "
                         "llama.cpp keeps them, half the memory of fp32 (RSS grows by the blocks "
                         "in use); kiln's CPU kernels write and read them converted in place, a "
                         "rounding (2^-11 relative) far below the weights' own"),
                "kv_cache_dtype.fp16_for_quantized_cpu")
    return (_KV_DTYPE_OF[dtype], (f"the model dtype ({dtype}): keys and values are stored as "
                                  "they are computed, no conversion per step"),
            "kv_cache_dtype.model_dtype")


def auto_cpu_isa(ctx: AutoContext, v: dict[str, Any]) -> tuple[Any, str, str]:
    # The value stays "auto" (the runner takes the best level whose library builds, else
    # PyTorch's paths); the reason names the level the probe expects, and the effective
    # config's `cpu_kernels` decision records what ran.
    if v.get("device") == "cuda":
        return "auto", "GPU: kiln's CPU kernels do not run", "cpu_isa.gpu"
    from kiln.layers.kernels.isa import LEVELS, cpu_runs

    for lv in LEVELS:
        if (why := cpu_runs(lv)) is None:
            return ("auto", f"{lv.name}, the best level this CPU and OS run: {lv.about}",
                    "cpu_isa.best_level")
    return "auto", f"no level runs here ({why}): PyTorch's paths", "cpu_isa.no_level"


def auto_threads(ctx: AutoContext, _: dict[str, Any]) -> tuple[Any, str, str]:
    return (ctx.physical_cores, f"{ctx.physical_cores} physical core(s)",
            "num_threads.physical_cores")


def auto_max_model_len(ctx: AutoContext, _: dict[str, Any]) -> tuple[Any, str, str]:
    if ctx.model_max_len:
        return (ctx.model_max_len, "the model's max_position_embeddings / context_length",
                "max_model_len.model")
    return 4096, "the model does not say; 4096", "max_model_len.unknown"


def _gpu_or_cpu(gpu: tuple[Any, str, str], cpu: tuple[Any, str, str]) -> AutoRule:
    """The rule of a setting whose default depends on the device alone: the GPU's
    (value, reason, code) on CUDA, else the CPU's."""

    def rule(_: AutoContext, v: dict[str, Any]) -> tuple[Any, str, str]:
        return gpu if v.get("device") == "cuda" else cpu

    return rule


auto_max_num_seqs = _gpu_or_cpu(
    (256, "GPU: vLLM's default", "max_num_seqs.gpu"),
    (32, "CPU: batches past ~32 sequences stop raising throughput on few cores",
     "max_num_seqs.cpu"))


def auto_num_speculative_tokens(ctx: AutoContext, v: dict[str, Any]) -> tuple[Any, str, str]:
    if v.get("speculative_method") is None and v.get("speculative_model") is None:
        return None, "speculative decoding is off", "num_speculative_tokens.off"
    if v.get("engine") != "kiln":
        return (None, "the external engine needs a number (--num-speculative-tokens K)",
                "num_speculative_tokens.external_needs_number")
    return "auto", ("kiln's engine picks K each step from the acceptance measured so far "
                    "(kiln/engine/spec.py)"), "num_speculative_tokens.adaptive"


def auto_spec_disable_by_batch_size(ctx: AutoContext, v: dict[str, Any]) -> tuple[Any, str, str]:
    if v.get("speculative_model") is None or v.get("engine") != "kiln" or v.get("device") == "cuda":
        return None, "drafting at every batch size", "speculative_disable_by_batch_size.always"
    # Measured on 2 CPU cores, Qwen2.5-Coder 0.5B drafting for 1.5B, K=4 (README, Speculative
    # decoding): one stream 1.34x, 2 streams 1.03x (0.95-1.07), 4 streams 0.85x, 16 streams 0.55x: the
    # verify rows and the draft's steps cost compute that a batch already keeps busy. (Since the
    # kernels' prefetch made plain decode faster, one stream is 1.20x with the auto K, and
    # 1.51x on code editing with --speculative-prompt-lookup.)
    return (1, ("a draft model on CPU pays off for a single stream only (measured with K=4: 1.34x "
                "at 1 stream, 1.03x at 2, 0.85x at 4, 0.55x at 16)"),
            "speculative_disable_by_batch_size.single_stream")


auto_batched_tokens = _gpu_or_cpu(
    (8192, "GPU: large prefill chunks keep the GPU busy", "max_num_batched_tokens.gpu"),
    (512, "CPU: 512-token chunks keep decode latency low while prefilling",
     "max_num_batched_tokens.cpu"))


def auto_tp(ctx: AutoContext, _: dict[str, Any]) -> tuple[Any, str, str]:
    if ctx.gpu_count <= 1:
        return 1, f"{ctx.gpu_count} GPU(s)", "tensor_parallel_size.one_gpu"
    tp = ctx.gpu_count
    while tp & (tp - 1):  # tensor parallel sizes are powers of two in practice
        tp -= 1
    if ctx.model_max_tp and tp > ctx.model_max_tp:
        return (ctx.model_max_tp, f"{ctx.gpu_count} GPUs, capped by the model's maximum TP",
                "tensor_parallel_size.model_cap")
    return tp, f"{ctx.gpu_count} GPUs", "tensor_parallel_size.gpus"


def auto_engine(ctx: AutoContext, v: dict[str, Any]) -> tuple[Any, str, str]:
    # Only `--engine auto` gets here (the default is kiln). Which engine depends on the GPUs
    # the parallel settings ask for, resolved later in the table: `kiln serve` decides once
    # they are known (kiln.backends.launch.choose_engine) and records that choice over this.
    return "auto", ("decided once the parallel settings are known: kiln for one device, vLLM "
                    "for several GPUs or nodes"), "engine.after_parallel"


# --------------------------------------------------------------------------- hybrid MoE (kt-kernel)
# kt-cli's defaults (ktransformers' `kt run`), so a kiln hand-off to SGLang + kt-kernel starts the
# way kt-cli would start it. They apply only where SGLang runs the model: kiln's own engine and
# vLLM have no kt-kernel, and a value there would only be noise in the dry run.

KT_METHOD_DEFAULT = "AMXINT4"
KT_PREFILL_THRESHOLD_DEFAULT = 4096
KT_CPUINFER_FRACTION = 0.8


def _not_sglang(v: dict[str, Any]) -> str | None:
    if v.get("engine") != "sglang":
        return "only SGLang's kt-kernel runs experts on the CPU"
    return None


def _device(ctx: AutoContext, v: dict[str, Any]) -> str:
    """"cpu" or "cuda": the device setting as resolved so far, auto read from the hardware."""
    d = str(v.get("device") or "auto")
    return ctx.device if d == "auto" else ("cuda" if d.startswith("cuda") else d)


def _no_host_pools(v: dict[str, Any]) -> str | None:
    """Why the CPU expert pools' knobs have no value: neither SGLang's kt-kernel nor kiln's own
    split (--cpu-offload-experts with --engine kiln) runs experts on the CPU."""
    if v.get("engine") == "kiln":
        return None if v.get("cpu_offload_experts") else "kiln's engine keeps every expert " \
            "in one pool (--cpu-offload-experts splits them)"
    return _not_sglang(v)


def auto_kt_method(ctx: AutoContext, v: dict[str, Any]) -> tuple[Any, str, str]:
    if (why := _not_sglang(v)) is not None:
        return None, why, "kt_method.not_sglang"
    if ctx.cpu_amx:
        return (KT_METHOD_DEFAULT, "kt-cli's default: int4 experts on this CPU's AMX tiles",
                "kt_method.amx")
    # Kept (not silently swapped for another method): startup refuses it with what to do, as
    # the other methods need other weights.
    return (KT_METHOD_DEFAULT, "kt-cli's default (this CPU has no AMX: startup says what to use)",
            "kt_method.no_amx")


def auto_kt_threadpool_count(ctx: AutoContext, v: dict[str, Any]) -> tuple[Any, str, str]:
    if (why := _no_host_pools(v)) is not None:
        return None, why, "kt_threadpool_count.no_host_pools"
    n = max(1, ctx.numa_nodes)
    return (n, f"one kt-kernel thread pool per NUMA node ({n} found), as kt-cli does",
            "kt_threadpool_count.numa_nodes")


def auto_kt_cpuinfer(ctx: AutoContext, v: dict[str, Any]) -> tuple[Any, str, str]:
    if (why := _no_host_pools(v)) is not None:
        return None, why, "kt_cpuinfer.no_host_pools"
    nodes = max(1, ctx.numa_nodes)
    used = min(nodes, int(v.get("kt_threadpool_count") or nodes))
    cores = ctx.physical_cores * used // nodes
    if v.get("engine") == "kiln" and _device(ctx, v) != "cuda":
        return cores, (f"all {cores} physical cores: the device pool is the CPU too, and the "
                       "pools take turns on it"), "kt_cpuinfer.all_cores"
    n = max(1, int(cores * KT_CPUINFER_FRACTION))
    return (n, (f"80% of the {cores} physical cores of the {used} NUMA node(s) used, as kt-cli "
                "does (the rest keep SGLang's scheduler and the GPU feeding)"),
            "kt_cpuinfer.kt_cli_share")


def auto_kt_gpu_prefill_token_threshold(ctx: AutoContext, v: dict[str, Any]) -> tuple[Any, str, str]:
    if (why := _no_host_pools(v)) is not None:
        return None, why, "kt_gpu_prefill_token_threshold.no_host_pools"
    return (KT_PREFILL_THRESHOLD_DEFAULT, ("kt-cli's default: longer prompts prefill with the "
                                           "experts streamed to the GPU"),
            "kt_gpu_prefill_token_threshold.kt_cli")


def auto_cpu_offload_experts(ctx: AutoContext, v: dict[str, Any]) -> tuple[Any, str, str]:
    if v.get("engine") == "kiln":
        if not ctx.is_moe:
            return False, "a dense model: no experts to split", "cpu_offload_experts.dense_model"
        if _device(ctx, v) != "cuda":
            return (False, ("one device, the CPU: every expert in one pool "
                            "(--cpu-offload-experts splits them into two CPU pools)"),
                    "cpu_offload_experts.one_cpu_device")
        budget = ctx.gpu_memory_bytes * float(v.get("gpu_memory_utilization") or 0.9)
        if ctx.weight_bytes and ctx.weight_bytes > 0.8 * budget:
            return (True, (f"the model's {ctx.weight_bytes / 2**30:.1f} GiB leave too little of "
                           f"the GPU's {budget / 2**30:.1f} GiB usable for the KV cache: the "
                           "hottest experts stay on the GPU, the rest run on the CPU"),
                    "cpu_offload_experts.gpu_too_small")
        return False, "the whole model fits on the GPU", "cpu_offload_experts.fits_on_gpu"
    if (why := _not_sglang(v)) is not None:
        return False, why, "cpu_offload_experts.not_sglang"
    if ctx.is_moe:
        return (True, ("an MoE model on SGLang: kt-kernel keeps the hot experts on the GPU and "
                       "runs the rest on the CPU, as kt-cli does (--no-cpu-offload-experts: off)"),
                "cpu_offload_experts.moe_on_sglang")
    given = [n for n in ("kt_weight_path", "kt_cpuinfer") if n in ctx.explicit]
    if given:
        return (True, f"{', '.join('--' + n.replace('_', '-') for n in given)} given",
                "cpu_offload_experts.kt_flags_given")
    return False, "a dense model: every weight stays on the GPU", "cpu_offload_experts.dense_on_gpu"


def auto_kind(ctx: AutoContext, _: dict[str, Any]) -> tuple[Any, str, str]:
    if ctx.model_kind is None:
        return ("generate", "no model files to read: generating is the default",
                "kind.no_model_files")
    return (*ctx.model_kind, "kind.from_model_files")


def auto_lang(_: AutoContext, __: dict[str, Any]) -> tuple[Any, str, str]:
    from kiln.i18n import lang_from_locale

    found = lang_from_locale()
    if found is None:
        return "en", "no locale set (LC_ALL, LC_MESSAGES, LANG)", "lang.no_locale"
    return found[0], f"locale {found[1]}", "lang.locale"


def auto_served_model_name(ctx: AutoContext, _: dict[str, Any]) -> tuple[Any, str, str]:
    if not ctx.model_names:
        return None, "the model's name, once MODEL is resolved", "served_model_name.unresolved"
    if len(ctx.model_names) == 1:
        return list(ctx.model_names), "the name MODEL was given as", "served_model_name.as_given"
    return list(ctx.model_names), ("the name MODEL was given as, then its registry id and HF "
                                   "repo: a client may ask by any (ferrum serves the requested "
                                   "name and the canonical id)"), "served_model_name.with_aliases"


def auto_trust_remote_code(ctx: AutoContext, v: dict[str, Any]) -> tuple[Any, str, str]:
    if v.get("engine") == "kiln":
        return (False, "kiln's engine runs only the model code kiln itself ships",
                "trust_remote_code.kiln_engine")
    if ctx.model_code:
        return True, (f"config.json's auto_map names the model's own code ({ctx.model_code}): "
                      "the engine must run it"), "trust_remote_code.model_code"
    return False, ("the engine's own code runs this architecture (kt-cli passes "
                   "--trust-remote-code for every model; kiln only where the model ships code "
                   "of its own)"), "trust_remote_code.engine_code"
