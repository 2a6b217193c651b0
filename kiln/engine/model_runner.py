"""ModelRunner: builds the model, sizes and owns the KV pool, and runs one step.

A step arrives as the scheduler's list of (request, tokens to compute). The runner flattens it into
input ids, positions and slots (decodes first, then prefill chunks, see layers/attention.py), runs
the model once, computes logits only for the sequences that sample, and hands them to the sampler.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kiln.config import GiB, EngineConfig
from kiln.engine.request import Request, TokenLogprob
from kiln.engine.sampler import Sampler
from kiln.engine.scheduler import ScheduledRequest
from kiln.errors import ConfigError, DeviceError, MemoryFitError
from kiln.layers.attention import (INT8_SCALE_BYTES, INT8_SCALE_DTYPE, AttentionMetadata, KVStore,
                                   PrefillChunk, set_context)
from kiln.models.loader import Checkpoint, ProgressFn, build_model

log = logging.getLogger("kiln.runner")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
             "int8": torch.int8}
# On CPU the KV pool is capped unless the user sizes it: a pool is touched block by block as it
# is used, and beyond this a small model's server would grow past the RAM users expect of it.
CPU_KV_AUTO_CAP = 1 * GiB


@dataclass
class MemoryPlan:
    num_blocks: int
    block_size: int
    block_bytes: int
    kv_bytes: int
    weight_bytes: int
    activation_bytes: int
    max_model_len: int
    reason: str
    warnings: list[str] = field(default_factory=list)

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.block_size


class ModelRunner:
    def __init__(self, config: EngineConfig, ckpt: Checkpoint,
                 progress: ProgressFn | None = None) -> None:
        self.config = config
        self.ckpt = ckpt
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise DeviceError("--device cuda was asked for, but PyTorch sees no CUDA GPU",
                              hint="install a CUDA build of torch, or use --device cpu")
        if self.device.type == "cpu" and config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.dtype = DTYPES[config.dtype]
        mc = ckpt.config
        self.model_config = mc
        model_len = mc.max_position_embeddings
        if mc.sliding_window and mc.sliding_window < model_len:
            # Sliding-window attention is not implemented: within the window it is exact.
            model_len = mc.sliding_window
        wanted = config.max_model_len or model_len
        if config.max_model_len_explicit and wanted > model_len:
            raise ConfigError(
                f"--max-model-len {wanted} exceeds the model's context length {model_len}",
                hint=f"use --max-model-len {model_len} or less")
        self.max_model_len = wanted
        t0 = time.monotonic()
        self.model = build_model(ckpt, dtype=self.dtype, device=self.device,
                                 max_positions=max(wanted, 1), progress=progress)
        if config.quantization != "none":
            from kiln.layers.quant import quantize_model

            quantize_model(self.model, config.quantization)
        self.load_seconds = time.monotonic() - t0
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.block_size = config.block_size
        self.kv_dtype_name = self._kv_dtype_name()
        self.plan = self._plan_memory()
        self.max_model_len = self.plan.max_model_len
        self._allocate_kv(self.plan.num_blocks)
        self.sampler = Sampler(mc.vocab_size, self.device, seed=config.seed)

    # ------------------------------------------------------------------ memory

    def _kv_dtype_name(self) -> str:
        name = self.config.kv_cache_dtype
        if name == "auto":
            return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[
                self.dtype]
        if name not in KV_DTYPES:
            raise ConfigError(f"unknown --kv-cache-dtype {name!r}",
                              hint=f"choose one of: auto, {', '.join(KV_DTYPES)}")
        if name == "fp16" and self.device.type == "cpu" and self.dtype != torch.float16:
            log.info("fp16 KV on CPU: stored in fp16, computed in %s", self.config.dtype)
        return name

    def kv_bytes_per_token(self) -> int:
        mc = self.model_config
        per_head = mc.head_dim * torch.tensor([], dtype=KV_DTYPES[self.kv_dtype_name]).element_size()
        if self.kv_dtype_name == "int8":
            per_head += INT8_SCALE_BYTES  # fp16 scale per (token, head)
        return 2 * mc.num_hidden_layers * mc.num_key_value_heads * per_head

    def _scratch_forward(self, token_ids: torch.Tensor, logits_rows: slice | None) -> torch.Tensor:
        """One prefill of `token_ids` on a scratch KV region of its own (the real pool, if any,
        is put back after). Used to profile memory and to score whole prompts."""
        n = token_ids.shape[0]
        pos = torch.arange(n, device=self.device)
        saved = [layer.kv for layer in self.model.attention_layers()]
        scratch_dtype = self.dtype if self.kv_dtype_name == "int8" else KV_DTYPES[self.kv_dtype_name]
        self._allocate_kv_slots(n, scratch_dtype)
        set_context(AttentionMetadata(slot_mapping=pos, prefills=[PrefillChunk(0, n, 0)]))
        try:
            with torch.inference_mode():
                h = self.model(token_ids, pos)
                return self.model.compute_logits(h[logits_rows if logits_rows else slice(-1, None)])
        finally:
            set_context(None)
            for layer, kv in zip(self.model.attention_layers(), saved):
                layer.kv = kv

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of one prompt, [T, vocab] fp32 (parity tests, scoring)."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return self._scratch_forward(ids, slice(None))

    def _measure_activation_peak(self) -> int:
        """Runs the largest step the scheduler may produce (one prefill chunk of the token
        budget) and measures the memory it needed."""
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            base = _rss_reset_peak()
        self._scratch_forward(ids, None)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        else:
            peak = _rss_peak() - base
        # Logits and sampler temporaries for max_num_seqs rows come on top.
        peak += self.config.max_num_seqs * self.model_config.vocab_size * 4 * 3
        return max(int(peak), 0)

    def _plan_memory(self) -> MemoryPlan:
        c = self.config
        per_token = self.kv_bytes_per_token()
        block_bytes = per_token * self.block_size
        act = self._measure_activation_peak()
        warnings: list[str] = []
        if c.kv_cache_memory:
            budget = c.kv_cache_memory
            reason = f"--kv-cache-memory {_gib(budget)}"
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_us = torch.cuda.memory_allocated(self.device)
            budget = int(total * c.gpu_memory_utilization) - used_by_us - act
            reason = (f"KV pool {_gib(budget)} = {c.gpu_memory_utilization:.0%} of GPU memory "
                      f"{_gib(total)} - weights {_gib(used_by_us)} - activations {_gib(act)}")
        else:
            avail = _ram_available()
            frac = int(avail * c.cpu_memory_utilization) - act
            need = c.max_num_seqs * self.max_model_len * per_token
            budget = min(frac, need, CPU_KV_AUTO_CAP)
            reason = (f"KV pool {_gib(budget)} = min({c.cpu_memory_utilization:.0%} of available "
                      f"RAM {_gib(avail)} - activations {_gib(act)}, {c.max_num_seqs} full "
                      f"contexts {_gib(need)}, CPU cap {_gib(CPU_KV_AUTO_CAP)})")
        num_blocks = max(budget // block_bytes, 0)
        if c.kv_max_blocks:
            if c.kv_max_blocks < num_blocks:
                reason += f"; capped at --kv-max-blocks {c.kv_max_blocks}"
            num_blocks = min(num_blocks, c.kv_max_blocks)
        fits = num_blocks * self.block_size
        max_len = self.max_model_len
        if fits < max_len:
            if c.max_model_len_explicit or fits < self.block_size:
                raise MemoryFitError(
                    f"--max-model-len {max_len} does not fit: the KV pool holds {fits} tokens "
                    f"({num_blocks} blocks; {reason})",
                    hint=f"use --max-model-len {fits} or less, or give the KV cache more memory "
                    f"(--kv-cache-memory, --gpu-memory-utilization)" if fits >= self.block_size
                    else "give the KV cache more memory (--kv-cache-memory)")
            warnings.append(f"max_model_len lowered from {max_len} to {fits}: the KV pool holds "
                            f"only {fits} tokens")
            max_len = fits
        return MemoryPlan(int(num_blocks), self.block_size, int(block_bytes),
                          int(num_blocks * block_bytes), self.weight_bytes, act, max_len, reason,
                          warnings)

    def _allocate_kv_slots(self, num_slots: int, dtype: torch.dtype) -> None:
        mc = self.model_config
        shape = (num_slots, mc.num_key_value_heads, mc.head_dim)
        quant = dtype == torch.int8
        for layer in self.model.attention_layers():
            k = torch.zeros(shape, dtype=dtype, device=self.device)
            v = torch.zeros(shape, dtype=dtype, device=self.device)
            ks = vs = None
            if quant:
                ks = torch.zeros(shape[:2], dtype=INT8_SCALE_DTYPE, device=self.device)
                vs = torch.zeros(shape[:2], dtype=INT8_SCALE_DTYPE, device=self.device)
            layer.kv = KVStore(k, v, ks, vs, compute_dtype=self.dtype)

    def _allocate_kv(self, num_blocks: int) -> None:
        self._allocate_kv_slots(num_blocks * self.block_size, KV_DTYPES[self.kv_dtype_name])

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]
                ) -> tuple[dict[str, int], dict[str, TokenLogprob]]:
        # Decodes (one token) first, then prefill chunks: see the layout in layers/attention.py.
        order = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
        bs = self.block_size
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        decode_ctx: list[np.ndarray] = []
        prefills: list[PrefillChunk] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        t = 0
        for s in order:
            r = s.request
            start, n = r.num_computed_tokens, s.num_new_tokens
            ids.extend(r.token_ids_slice(start, start + n))
            table = np.asarray(r.block_ids, dtype=np.int64)
            ctx_slots = (table[:, None] * bs + np.arange(bs)).reshape(-1)[: start + n]
            positions.append(np.arange(start, start + n))
            slots.append(ctx_slots[start:])
            if n == 1:
                decode_ctx.append(ctx_slots)
            else:
                chunk = PrefillChunk(t, t + n, start)
                if start > 0:
                    chunk.gather = torch.from_numpy(ctx_slots).to(self.device)
                    q_pos = np.arange(start, start + n)[:, None]
                    mask = np.arange(start + n)[None, :] <= q_pos
                    chunk.mask = torch.from_numpy(mask).to(self.device)[None, None]
                prefills.append(chunk)
            t += n
            if s.sample:
                sample_rows.append(t - 1)
                sample_reqs.append(r)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(self.device),
            num_decodes=len(decode_ctx), prefills=prefills)
        if decode_ctx:
            max_kv = max(len(c) for c in decode_ctx)
            gather = np.zeros((len(decode_ctx), max_kv), dtype=np.int64)
            lens = np.array([len(c) for c in decode_ctx])
            for i, c in enumerate(decode_ctx):
                gather[i, : len(c)] = c
            meta.decode_gather = torch.from_numpy(gather).to(self.device)
            mask = np.arange(max_kv)[None, :] < lens[:, None]
            meta.decode_mask = torch.from_numpy(mask).to(self.device)[:, None, None, :]
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.from_numpy(np.concatenate(positions)).to(self.device)
        set_context(meta)
        try:
            hidden = self.model(input_ids, pos)
        finally:
            set_context(None)
        if not sample_reqs:
            return {}, {}
        rows = torch.tensor(sample_rows, device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        out = self.sampler(logits, sample_reqs)
        sampled = {r.request_id: tok for r, tok in zip(sample_reqs, out.token_ids)}
        logprobs = {r.request_id: lp for r, lp in zip(sample_reqs, out.logprobs)
                    if lp is not None}
        return sampled, logprobs


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _ram_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GiB


def _status_kb(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _rss_reset_peak() -> int:
    """Resets the process's peak-RSS mark (Linux clear_refs "5") and returns the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kb("VmRSS")
    except OSError:
        return 0


def _rss_peak() -> int:
    try:
        return _status_kb("VmHWM")
    except OSError:
        return 0
