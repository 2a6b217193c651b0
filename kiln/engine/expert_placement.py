"""Where each MoE layer's experts live when they are split (`--cpu-offload-experts`): a device
pool on the accelerator and host pools on the CPU (ktransformers' hybrid; llama.cpp's
`--n-cpu-moe` by hand).

    N (experts per layer on the device)   --num-gpu-experts, else from the device memory left
                                          after the dense weights and a KV reserve, divided by
                                          the bytes one expert takes there (measured once the
                                          weights are loaded; estimated from the config for a
                                          dry run); on a CPU "device", half the experts
    which N                               the hottest: ranked by the tokens routed to each
                                          expert in a calibration pass over built-in prompts
                                          (run once, cached per model file); the first N
                                          where there are no statistics
    host pools                            --kt-threadpool-count (one per NUMA node), each a
                                          thread of --kt-cpuinfer threads pinned to its node

The plan is made twice: at planning (dry run, effective config) from the config and any cached
statistics, and when the engine loads, from the measured expert size and the calibration; the
loaded one replaces the first in the effective config. `apply` swaps each layer's Experts for a
SplitExperts (kiln/layers/moe.py), which runs the pools.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("kiln.experts")

GiB = 1 << 30

# Built-in calibration prompts: the kinds of text a local server sees (chat, code, prose,
# numbers, another script), so the ranking is not one genre's. Changing them changes
# CALIBRATION_VERSION, which keys the cache.
CALIBRATION_PROMPTS = (
    ("The quick brown fox jumps over the lazy dog. Write a short story about a fox who learns "
    "to read, and what she finds in the first book she opens."),
    ("def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n"),
    "Explain why the sky is blue in three sentences, then explain it again for a five-year-old.",
    ("Q: A train leaves at 14:05 and arrives at 17:50. How long is the trip? A: 3 hours 45 "
    "minutes. Q: What is 17 * 23? A: 391. Q: Is 221 prime? A:"),
    "请用简短的几句话介绍一下长城的历史，以及它为什么被列为世界文化遗产。",
    ("SELECT name, COUNT(*) AS orders FROM customers JOIN orders USING (customer_id) GROUP BY "
    "name ORDER BY orders DESC LIMIT 10;"),
)
CALIBRATION_VERSION = 1

# Host pools on worker threads even when the "device" is the CPU (they run inline there by
# default: nothing to overlap with). Tests set it to run the threaded path the GPU case takes.
HOST_THREADS_ON_CPU = False

# Pools at all when the "device" is the CPU. By default there they are one: both pools would
# share the same cores, with nothing to overlap, so the layer's experts stay one stack, run by
# one call (the one-call MoE layer where it runs); the plan is still made, reported and traced.
# As two pools (a SplitExperts: two moe_q4 calls and the eager layer around them) the
# Qwen3-MoE-shaped benchmark model decoded one row at 0.51x of one pool (32/32, Zen 4,
# benchmarks/moe_split.py, Dec 6). Tests set it to run the split path the GPU case takes.
POOLS_ON_CPU = False


def pools_run_as_one(device: torch.device | str) -> bool:
    """Whether a split onto `device` (cpu, cuda, cuda:N) keeps one pool (a CPU "device": see
    POOLS_ON_CPU). Then the experts are loaded, fused with a shared expert and cached as
    without a split."""
    return torch.device(device).type == "cpu" and not POOLS_ON_CPU

# A KV cache and activations need room on the device besides the weights: at least this much
# of it stays free of experts when N is chosen automatically.
DEVICE_RESERVE_FRACTION = 0.10
DEVICE_RESERVE_MIN_BYTES = 1 * GiB


@dataclass
class LayerPlacement:
    layer: int
    device_experts: list[int]
    host_experts: list[list[int]]  # one list per host pool
    device_bytes: int
    host_bytes: int
    device_share: float | None = None  # calibrated share of routed tokens the device takes


@dataclass
class PlacementPlan:
    device: str
    num_experts: int
    num_device_experts: int
    rule: str  # why N
    hot: str  # how the N were chosen
    bytes_per_expert: int
    bytes_measured: bool
    host_pools: int
    host_threads: int
    stream_threshold: int | None
    layers: list[LayerPlacement] = field(default_factory=list)
    host_inline: bool = False  # host pools run on the engine's thread (a CPU "device")
    one_pool: bool = False  # a CPU "device": the pools run as one (see POOLS_ON_CPU)
    # What a program matches instead of `rule` and `hot`: num_gpu_experts.<why N> (the code the
    # setting's override carries) and expert_ranking.<how the N were chosen>.
    rule_code: str = ""
    hot_code: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        how = "measured" if self.bytes_measured else "estimated"
        return (f"{self.num_device_experts} of {self.num_experts} experts per layer on "
                f"{self.device}, the rest in {self.host_pools} CPU pool(s) "
                + ("run with it as one pool: both are this CPU" if self.one_pool else
                   "taking turns with it on the engine's threads" if self.host_inline else
                   f"of {self.host_threads} thread(s)")
                + f"; {self.bytes_per_expert / 2**20:.2f} MiB per expert ({how})")

    def describe(self) -> list[str]:
        lines = [f"  {self.summary()}", f"  N: {self.rule}", f"  which: {self.hot}"]
        if self.stream_threshold:
            lines.append(f"  prefill chunks of {self.stream_threshold}+ tokens run every "
                         "expert on the device")
        for lp in self.layers:
            share = (f", {100 * lp.device_share:.0f}% of calibrated routing"
                     if lp.device_share is not None else "")
            lines.append(f"  layer {lp.layer:>3}: device {lp.device_experts} "
                         f"({lp.device_bytes / 2**20:.1f} MiB{share}), host "
                         f"{sum(map(len, lp.host_experts))} experts "
                         f"({lp.host_bytes / 2**20:.1f} MiB)")
        return lines


# --------------------------------------------------------------------------- sizing


def estimate_expert_bytes(hidden: int, intermediate: int, quantization: str,
                          dtype_bytes: int) -> int:
    """Bytes of one SwiGLU expert (3 matrices of hidden x intermediate) in the form kiln runs:
    int4 groups of 32 with fp16 scale and min (0.625 B a weight), int8 rows (1 B + a scale per
    row), else the model dtype."""
    n = 3 * hidden * intermediate
    if quantization == "int4":
        return n * 5 // 8
    if quantization == "int8":
        return n + 4 * (2 * intermediate + hidden)
    return n * dtype_bytes


def auto_device_experts(num_experts: int, moe_layers: int, bytes_per_expert: int,
                        device_total: int, utilization: float, used_bytes: int
                        ) -> tuple[int, str]:
    """N from the device's memory: what `utilization` of it leaves after `used_bytes` (the
    dense weights) and a reserve for the KV cache and activations, in whole experts per layer."""
    reserve = max(DEVICE_RESERVE_MIN_BYTES, int(device_total * DEVICE_RESERVE_FRACTION))
    budget = int(device_total * utilization) - used_bytes - reserve
    per_n = max(1, moe_layers * bytes_per_expert)
    n = max(0, min(num_experts, budget // per_n))
    return n, (f"{device_total / GiB:.1f} GiB x {utilization:.2f} utilization, less "
               f"{used_bytes / GiB:.2f} GiB of dense weights and a {reserve / GiB:.1f} GiB "
               f"reserve for KV and activations, holds {n} experts per layer x {moe_layers} "
               f"layers at {bytes_per_expert / 2**20:.2f} MiB each")


def cpu_device_experts(num_experts: int) -> tuple[int, str]:
    n = num_experts // 2
    return n, ("the device is the CPU: the split runs as two CPU pools (the hybrid path on a "
               "machine without a GPU), half the experts in each")


# --------------------------------------------------------------------------- ranking


def rank(counts: list[int]) -> list[int]:
    """Experts from the most to the least routed (ties: lower id first)."""
    return sorted(range(len(counts)), key=lambda e: (-counts[e], e))


def place_layer(layer: int, counts: list[int] | None, num_experts: int, n: int,
                host_pools: int) -> tuple[list[int], list[list[int]]]:
    """(device experts, host experts per pool). The hottest n go to the device; the rest are
    dealt to the host pools in rank order, so each pool gets a similar load."""
    order = rank(counts) if counts is not None else list(range(num_experts))
    device = sorted(order[:n])
    pools: list[list[int]] = [[] for _ in range(max(1, host_pools))]
    for i, e in enumerate(order[n:]):
        pools[i % len(pools)].append(e)
    return device, [sorted(p) for p in pools if p]


# --------------------------------------------------------------------------- calibration cache


def _model_key(model_file: str, quantization: str) -> str:
    p = Path(model_file).expanduser().resolve()
    try:
        st = p.stat()
        ident = f"{p}|{st.st_size}|{st.st_mtime_ns}"
    except OSError:
        ident = str(p)
    return hashlib.sha256(f"{ident}|{quantization}|v{CALIBRATION_VERSION}".encode()
                          ).hexdigest()[:24]


def calibration_path(model_file: str, quantization: str) -> Path:
    """Where a model's routing statistics are cached: kiln's cache folder, keyed by the model
    file's path, size and mtime (a changed file is calibrated again) and the quantization."""
    from kiln.paths import cache_dir

    return cache_dir("expert-stats", f"{_model_key(model_file, quantization)}.json")


def load_calibration(model_file: str, quantization: str, layers: int, num_experts: int
                     ) -> list[list[int]] | None:
    path = calibration_path(model_file, quantization)
    try:
        data = json.loads(path.read_text())
        counts = data["counts"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if len(counts) != layers or any(len(c) != num_experts for c in counts):
        return None
    return counts


def save_calibration(model_file: str, quantization: str, counts: list[list[int]],
                     tokens: int) -> Path | None:
    path = calibration_path(model_file, quantization)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"model": str(model_file), "quantization": quantization,
                                   "version": CALIBRATION_VERSION, "tokens": tokens,
                                   "counts": counts}))
        tmp.replace(path)
    except OSError as e:  # a read-only cache only costs the calibration at the next start
        log.warning("could not cache the expert routing statistics at %s: %s", path, e)
        return None
    return path


def calibration_token_ids(tokenizer: Any) -> list[list[int]]:
    return [list(tokenizer.encode(p)) for p in CALIBRATION_PROMPTS]


# --------------------------------------------------------------------------- the plan


def numa_cpus(node: int, sys_root: Path = Path("/sys")) -> set[int] | None:
    """The CPUs of one NUMA node (its cpulist: "0-7,16-23"), None where it cannot be read."""
    try:
        text = (sys_root / f"devices/system/node/node{node}/cpulist").read_text().strip()
    except OSError:
        return None
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus or None


def make_plan(*, device: str, num_experts: int, moe_layers: list[int], bytes_per_expert: int,
              bytes_measured: bool, n: int, rule: tuple[str, str],
              counts: list[list[int]] | None, hot: tuple[str, str], host_pools: int,
              host_threads: int, stream_threshold: int | None,
              host_inline: bool = False, one_pool: bool = False) -> PlacementPlan:
    """`rule` and `hot` are (reason, code) pairs."""
    plan = PlacementPlan(device=device, num_experts=num_experts, num_device_experts=n,
                         rule=rule[0], hot=hot[0], bytes_per_expert=bytes_per_expert,
                         bytes_measured=bytes_measured, host_pools=host_pools,
                         host_threads=host_threads, stream_threshold=stream_threshold,
                         host_inline=host_inline, one_pool=one_pool, rule_code=rule[1],
                         hot_code=hot[1])
    for i, layer in enumerate(moe_layers):
        row = counts[i] if counts is not None else None
        dev, host = place_layer(layer, row, num_experts, n, host_pools)
        share = None
        if row is not None and sum(row):
            share = round(sum(row[e] for e in dev) / sum(row), 4)
        plan.layers.append(LayerPlacement(
            layer=layer, device_experts=dev, host_experts=host,
            device_bytes=len(dev) * bytes_per_expert,
            host_bytes=(num_experts - len(dev)) * bytes_per_expert, device_share=share))
    return plan


# How the N device experts were picked, (reason, code), where the words never vary.
OFF = ("the first N: calibration is off (--expert-calibration off)",
       "expert_ranking.calibration_off")
CACHED = ("the hottest, from cached routing statistics", "expert_ranking.cached")
AT_LOAD = (("the first N for now: the engine calibrates the ranking when it loads (built-in "
            "prompts, then cached)"), "expert_ranking.at_load")


def plan_from_config(mc: Any, s: Any, hw: Any, model_file: str) -> PlacementPlan:
    """The plan before any weight is loaded (dry run, effective config): expert bytes estimated
    from the config and the quantization, the ranking from a cached calibration if any."""
    moe_layers = [i for i in range(mc.num_hidden_layers) if mc.is_moe_layer(i)]
    quant = s.get("quantization") or "none"
    dtype_bytes = 4 if s.get("dtype") == "float32" else 2
    per = estimate_expert_bytes(mc.hidden_size, mc.moe_intermediate_size, quant, dtype_bytes)
    device = s.get("device") or "cpu"
    gpus = getattr(hw, "gpus", None) or []
    n, rule, rule_code = _choose_n(
        s.get("num_gpu_experts"), s.source("num_gpu_experts"), device, mc.num_experts,
        moe_layers, per, float(s.get("gpu_memory_utilization") or 0.9),
        min((g.total_memory_bytes for g in gpus), default=0),
        _dense_bytes_estimate(mc, per, moe_layers))
    counts = None
    if s.get("expert_calibration") == "off":
        hot = OFF
    else:
        counts = load_calibration(model_file, quant, len(moe_layers), mc.num_experts)
        hot = CACHED if counts is not None else AT_LOAD
    return make_plan(device=device, num_experts=mc.num_experts, moe_layers=moe_layers,
                     bytes_per_expert=per, bytes_measured=False, n=n, rule=(rule, rule_code),
                     counts=counts, hot=hot, host_pools=int(s.get("kt_threadpool_count") or 1),
                     host_threads=int(s.get("kt_cpuinfer") or 1),
                     stream_threshold=s.get("kt_gpu_prefill_token_threshold"),
                     host_inline=not str(device).startswith("cuda") and not HOST_THREADS_ON_CPU,
                     one_pool=pools_run_as_one(device))


def _dense_bytes_estimate(mc: Any, per_expert: int, moe_layers: list[int]) -> int:
    """What the dense part (attention, embeddings, shared experts) takes on the device,
    roughly: the expert-to-dense ratio of bytes follows the weights' ratio."""
    h = mc.hidden_size
    attn = 4 * h * h
    per_weight = per_expert / max(1, 3 * h * mc.moe_intermediate_size)
    shared = 3 * h * (mc.shared_expert_intermediate_size or 0)
    dense_layers = mc.num_hidden_layers - len(moe_layers)
    total = (mc.num_hidden_layers * (attn + shared) + dense_layers * 3 * h * mc.intermediate_size
             + 2 * mc.vocab_size * h)
    return int(total * per_weight)


def _choose_n(asked: int | None, asked_how: str, device: str, num_experts: int,
              moe_layers: list[int], per_expert: int, utilization: float, device_total: int,
              dense_bytes: int) -> tuple[int, str, str]:
    """N, why and the code of why: asked for (capped at the layer's experts), half on a CPU
    "device", else what the device memory holds (auto_device_experts)."""
    if asked is not None:
        n = min(int(asked), num_experts)
        if n < int(asked):
            why = f"--num-gpu-experts {asked} ({asked_how}), capped at the layer's {num_experts}"
            return n, why, "num_gpu_experts.capped"
        return n, f"--num-gpu-experts {asked} ({asked_how})", "num_gpu_experts.asked"
    if not str(device).startswith("cuda"):
        return (*cpu_device_experts(num_experts), "num_gpu_experts.cpu_half")
    return (*auto_device_experts(num_experts, len(moe_layers), per_expert, device_total,
                                 utilization, dense_bytes), "num_gpu_experts.device_memory")


# --------------------------------------------------------------------------- applying it


def place_experts(runner: Any, calibration_ids: list[list[int]] | None) -> PlacementPlan | None:
    """Splits the loaded model's experts as planned (ModelRunner calls it after loading, before
    the memory plan): measures the bytes per expert, calibrates (or reads the cached ranking),
    chooses N, and swaps every layer's Experts for a SplitExperts (not on a CPU "device", where
    the pools are one: POOLS_ON_CPU). None for a dense model."""
    from kiln.layers.moe import Experts, reset_routing_counts, routing_counts
    from kiln.layers.moe_pools import HostExecutor, SplitExperts

    config, model, device = runner.config, runner.model, runner.device
    blocks = [m for m in model.modules() if isinstance(getattr(m, "experts", None), Experts)]
    if not blocks:
        return None
    blocks.sort(key=lambda m: m.experts.layer)
    experts = [b.experts for b in blocks]
    num_experts = experts[0].num_experts
    moe_layers = [e.layer for e in experts]
    per = max(1, sum(e.storage_bytes() for e in experts) // (len(experts) * num_experts))
    device_total = dense = 0
    if device.type == "cuda":
        device_total = torch.cuda.get_device_properties(device).total_memory
        dense = torch.cuda.memory_allocated(device)
    n, rule, rule_code = _choose_n(
        config.experts.num_gpu, "asked for", str(device), num_experts, moe_layers, per,
        config.cache.gpu_memory_utilization, device_total, dense)
    model_file = config.gguf_file or config.model
    quant = config.quant.method
    calibrate = config.experts.calibration == "on"
    counts = load_calibration(model_file, quant, len(experts), num_experts) if calibrate \
        else None
    hot = CACHED
    pools = max(1, int(config.experts.kt_threadpool_count or 1))
    threads = max(1, int(config.experts.kt_cpuinfer or 1))
    # On a CPU "device" the host pools run inline (see HostExecutor) unless a test asks for
    # the worker threads the GPU case uses.
    inline = device.type == "cpu" and not HOST_THREADS_ON_CPU
    executors = [HostExecutor(threads, numa_cpus(i) if pools > 1 else None, name=str(i),
                              inline=inline) for i in range(pools)]
    if counts is None and calibrate and calibration_ids:
        if device.type == "cuda":
            # The experts are in host memory (only their device share will fit): calibrate
            # through the split path itself with every expert on the host.
            for b in blocks:
                b.experts = SplitExperts(b.experts, [], [list(range(num_experts))], device,
                                         executors[:1])
        counters = [b.experts for b in blocks]
        reset_routing_counts(counters)
        tokens = 0
        for ids in calibration_ids:
            runner._scratch_forward(torch.tensor(ids, dtype=torch.long, device=device), None)
            tokens += len(ids)
        counts = routing_counts(counters).tolist()
        reset_routing_counts(counters)
        where = save_calibration(model_file, quant, counts, tokens)
        hot = (f"the hottest, from a calibration pass over {tokens} tokens of built-in prompts"
               + (f" (cached at {where})" if where else ""), "expert_ranking.calibrated")
        if device.type == "cuda":
            experts = [b.experts.host_pools[0] for b in blocks]
            for b, e in zip(blocks, experts):
                e.counts_routing = True
                b.experts = e
    elif counts is None:
        hot = OFF if not calibrate else ("the first N: no tokenizer to calibrate with",
                                         "expert_ranking.no_tokenizer")
    plan = make_plan(device=str(device), num_experts=num_experts, moe_layers=moe_layers,
                     bytes_per_expert=per, bytes_measured=True, n=n, rule=(rule, rule_code),
                     counts=counts, hot=hot, host_pools=pools, host_threads=threads,
                     stream_threshold=config.experts.kt_gpu_prefill_token_threshold,
                     host_inline=inline, one_pool=pools_run_as_one(device))
    log.info("experts: %s", plan.summary())
    if plan.one_pool:
        for e in executors:
            e.shutdown()
        return plan
    for b, lp in zip(blocks, plan.layers):
        b.experts = SplitExperts(b.experts, lp.device_experts, lp.host_experts, device,
                                 executors, stream_threshold=plan.stream_threshold)
    runner.expert_executors = executors
    return plan
