"""A layer's experts split into pools (--cpu-offload-experts): a device pool on the accelerator
and host pools on the CPU, run at once and summed (ktransformers' hybrid). Where each expert goes
is kiln/engine/expert_placement.py's plan; a pool is an Experts (kiln/layers/moe.py) of some of
the layer's experts, `Experts.select`ed onto its device."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kiln.layers.eager import eager_only
from kiln.layers.moe import Experts


class HostExecutor:
    """A CPU thread pool that runs host experts beside the model's step: one worker thread whose
    OpenMP team has `threads` threads, pinned to `cpus` (one NUMA node's cores) where given, so
    a pool reads the experts in its node's memory. The engine thread is the only one that
    submits to it, so a layer's host work is queued behind the previous layer's.

    `inline`: run on the calling thread instead (no worker). When the "device" is the CPU too
    there is nothing to overlap, and a second thread team only costs: on the 2-core benchmark
    machine, handing each layer's host share to a worker made decode 13-30% slower than one
    pool (team wake-ups and hand-offs, 24 layers a token), inline 3-6%."""

    def __init__(self, threads: int, cpus: set[int] | None = None, name: str = "host",
                 inline: bool = False) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.threads, self.cpus, self.name, self.inline = threads, cpus, name, inline
        self._pool = None if inline else ThreadPoolExecutor(
            1, thread_name_prefix=f"kiln-experts-{name}", initializer=self._setup)

    def _setup(self) -> None:
        import os

        if self.cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self.cpus)  # this thread; its OpenMP team inherits it
        # Sets this thread's OpenMP team size (per thread: the engine thread keeps its own).
        torch.set_num_threads(self.threads)

    def submit(self, pool: Experts, x: torch.Tensor, weights: torch.Tensor,
               ids: torch.Tensor) -> Any:
        if self._pool is None:
            from concurrent.futures import Future

            done: Future = Future()
            done.set_result(pool(x, weights, ids))
            return done
        return self._pool.submit(_run_pool, pool, x, weights, ids)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _run_pool(pool: Experts, x: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():  # thread-local: the engine thread's mode does not reach here
        return pool(x, weights, ids)


class SplitExperts(nn.Module):
    """One MoE layer's experts placed in pools (ktransformers' hybrid): `device_pool` on the
    model's device (the accelerator) and one or more `host_pools` on the CPU, each run by its
    HostExecutor. A step's routed pairs go to the pool of their expert (ids mapped to the
    pool's local ids, -1 for the others); the host pools start first, the device pool runs
    on the calling thread meanwhile (on a CPU "device" they take turns: see `overlap`), and
    the outputs are added in a fixed order (device, then host pools in order), so a split
    layer computes the same sum as one pool up to float rounding. Steps of `stream_threshold`
    rows or more (long prefill chunks) run the host experts on the device instead: their
    weights are copied there for the layer (on a CPU "device" the copy is the pool itself),
    which beats the CPU once a chunk is long enough to amortise the transfer (kt-kernel's
    GPU-prefill threshold).

    Routing is counted here, in global expert ids, for /metrics and the calibration pass."""

    def __init__(self, experts: Experts, device_ids: list[int], host_groups: list[list[int]],
                 device: torch.device | str, executors: list[HostExecutor],
                 stream_threshold: int | None = None) -> None:
        super().__init__()
        e = experts.num_experts
        assert sorted([*device_ids, *(i for g in host_groups for i in g)]) == list(range(e))
        assert len(executors) >= len(host_groups)
        self.layer, self.num_experts = experts.layer, e
        self.hidden_size = experts.hidden_size
        self.intermediate_size = experts.intermediate_size
        self.device = torch.device(device)
        self.device_ids = list(device_ids)
        self.host_groups = [list(g) for g in host_groups if g]
        self.device_pool = experts.select(self.device_ids, self.device) if device_ids else None
        self.host_pools = nn.ModuleList([experts.select(g, "cpu") for g in self.host_groups])
        self.executors = executors[:len(self.host_pools)]
        for pool, executor in zip(self.host_pools, self.executors):
            pool.threads = 0 if executor.inline else executor.threads
        # Pools overlap when the device is an accelerator (its share runs asynchronously while
        # the CPU computes the host share). A CPU "device" has no cores of its own: its pool and
        # the host pools take turns, each with its full thread team (run at once they would
        # oversubscribe the cores, and OpenMP teams spinning at barriers made that 20-35%
        # slower than one pool on the 2-core benchmark machine).
        self.overlap = self.device.type != "cpu"
        # global expert id -> local id in each pool, -1 where it lives elsewhere
        table = torch.full((1 + len(self.host_groups), e), -1, dtype=torch.int64)
        for row, group in enumerate([self.device_ids, *self.host_groups]):
            table[row, group] = torch.arange(len(group))
        self.device_local = table[0].to(self.device)
        self.host_local = table[1:]
        self.stream_threshold = stream_threshold
        self.tokens_per_expert = torch.zeros(e, dtype=torch.int64, device="cpu")
        self.counts_routing = True

    def pool_bytes(self) -> tuple[int, int]:
        """(bytes on the device, bytes on the host) of this layer's experts."""
        dev = self.device_pool.storage_bytes() if self.device_pool is not None else 0
        return dev, sum(p.storage_bytes() for p in self.host_pools)

    @eager_only
    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ids_cpu = ids.cpu()  # the host pools route on the CPU (one sync per layer on a GPU)
        self.tokens_per_expert += torch.bincount(ids_cpu.reshape(-1), minlength=self.num_experts)
        stream = self.stream_threshold is not None and x.shape[0] >= self.stream_threshold
        pending: list[Any] = []

        def start_host() -> None:
            xh, wh = x.to("cpu"), weights.to("cpu")
            for pool, executor, local in zip(self.host_pools, self.executors, self.host_local):
                hid = local[ids_cpu]
                if bool((hid >= 0).any()):
                    pending.append(executor.submit(pool, xh, wh, hid))

        if self.host_pools and not stream and self.overlap:
            start_host()
        y = None
        if self.device_pool is not None:
            y = self.device_pool(x, weights, self.device_local[ids])
        if self.host_pools and not stream and not self.overlap:
            start_host()
        if stream:
            for pool, local in zip(self.host_pools, self.host_local):
                on_device = pool if self.device.type == "cpu" else \
                    pool.select(list(range(pool.num_experts)), self.device)
                out = on_device(x, weights, local.to(self.device)[ids])
                y = out if y is None else y + out
        for f in pending:
            out = f.result().to(x.device)
            y = out if y is None else y + out
        return y if y is not None else torch.zeros_like(x)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, device={self.device} x {len(self.device_ids)}, "
                f"host pools={[len(g) for g in self.host_groups]}, "
                f"stream_threshold={self.stream_threshold}")
