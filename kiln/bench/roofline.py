"""The memory roofline of decode (`kiln bench --offline`): a decode step reads every weight the
step uses once (whatever its row count) plus each row's KV context, so on a CPU its speed is
bounded by bytes read per step / the machine's read bandwidth. The benchmark reports, per batch
size, the bytes a step reads, the bandwidth the measured step rate implies, and its fraction of
the read bandwidth measured here, in the same process and with the engine's thread count.

What counts as read per step:
  weights   every parameter and buffer of the model on its device, except the tables a step
            only looks rows up in: an input embedding the head does not share, RoPE's cos/sin;
            of a MoE layer's experts only those a step of B rows reads: its shared experts and
            the expected number of distinct routed ones, sum_e 1 - (1 - p_e)^B with p_e the
            share of tokens the layer sent to expert e so far (its routing counters; k at B=1)
  KV        each row's context (prompt + generated so far, averaged over the measured tokens)
            x the pool's bytes per token (all layers)
Activations, the sampler and logits are left out (they stay in cache at these sizes), so the
fraction is an upper bound on how close to the memory limit the step runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

# The buffer the bandwidth is measured on: far larger than any CPU cache.
_PROBE_BYTES = 256 << 20
_PROBE_RUNS = 5


@dataclass
class Roofline:
    bytes_per_step: int  # weights + KV read by one decode step
    weight_bytes: int  # of which the experts': expert_bytes
    kv_bytes: int
    achieved_gbs: float  # bytes_per_step x steps per second
    read_gbs: float  # the machine's read bandwidth, measured
    fraction: float  # achieved / read
    expert_bytes: int = 0  # the MoE experts' weights a step reads (of expert_total_bytes)
    expert_total_bytes: int = 0


def measure_read_bandwidth(threads: int | None = None) -> float:
    """GB/s (1e9 bytes) of a streaming read with `threads` (torch's count when None): the best of
    a few sums over a 256 MiB int64 buffer (vectorized, one pass, no writes)."""
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        x = torch.ones(_PROBE_BYTES // 8, dtype=torch.int64)
        x.sum()  # first touch and warm-up
        best = float("inf")
        for _ in range(_PROBE_RUNS):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)
    return _PROBE_BYTES / best / 1e9


def decode_weight_bytes(model: torch.nn.Module, device_type: str = "cpu") -> int:
    """Bytes of the weights a decode step reads (see the module notes)."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]
               if t.device.type == device_type and t.numel()}
    head = getattr(model, "lm_head", None)
    shared = ({t.data_ptr() for t in [*head.parameters(), *head.buffers()]}
              if head is not None else set())
    from kiln.layers.rotary import RotaryEmbedding

    # row lookups: the input embedding (unless it is the head's) and the RoPE tables
    lookups = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is not None:
        lookups.append(embed)
    for m in lookups:
        for t in [*m.parameters(), *m.buffers()]:
            if t.data_ptr() not in shared:
                tensors.pop(t.data_ptr(), None)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def expert_bytes(model: torch.nn.Module, batch: int) -> tuple[int, int]:
    """(bytes a decode step of `batch` rows reads of the MoE experts, bytes of all of them): per
    layer, its shared (absorbed) experts plus the expected distinct routed ones under the
    routing its counters saw (uniform where they saw nothing). (0, 0) for a dense model."""
    from kiln.layers.moe import Experts

    read = total = 0
    for ex in model.modules():
        if not isinstance(ex, Experts) or not ex.counts_routing:
            continue
        size = ex.storage_bytes()
        e, s = ex.num_experts, ex.num_shared
        per = size / (e + s)
        counts = ex.tokens_per_expert.double()
        p = counts / counts.sum() if counts.sum() > 0 else torch.ones(e, dtype=torch.float64) / e
        k = _top_k(model)
        # a token picks k distinct experts: expert e with probability k * p_e
        distinct = float((1 - (1 - (k * p).clamp(max=1.0)) ** batch).sum())
        read += int(per * (distinct + s))
        total += size
    return read, total


def _top_k(model: torch.nn.Module) -> int:
    cfg = getattr(model, "config", None)
    return int(getattr(cfg, "num_experts_per_tok", 0) or 1)


def roofline(runner: Any, batch: int, context: float, tok_s: float, read_gbs: float
             ) -> Roofline:
    """The roofline figures of a decode step of `batch` rows at mean `context` tokens that ran
    at `tok_s` (whole batch) on `runner` (a ModelRunner)."""
    read, total_experts = expert_bytes(runner.model, batch)
    weights = decode_weight_bytes(runner.model, runner.device.type) - total_experts + read
    kv = int(batch * context * runner.kv_bytes_per_token())
    total = weights + kv
    achieved = total * (tok_s / batch) / 1e9
    return Roofline(bytes_per_step=total, weight_bytes=weights, kv_bytes=kv,
                    achieved_gbs=achieved, read_gbs=read_gbs,
                    fraction=achieved / read_gbs if read_gbs > 0 else 0.0,
                    expert_bytes=read, expert_total_bytes=total_experts)
