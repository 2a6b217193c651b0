"""ModelRunner: builds the model, sizes and owns the KV pool, and runs one step.

A step arrives as the scheduler's list of (request, tokens to compute). The runner flattens it into
input ids, positions and slots (decodes first, then prefill chunks, see layers/attention.py), runs
the model once, computes logits only for the sequences that sample, and hands them to the sampler.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import math
import mmap
import os
import platform
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kiln.config import EngineConfig, GiB
from kiln.engine.request import Request, TokenLogprob
from kiln.engine.sampler import Sampler
from kiln.engine.scheduler import ScheduledRequest
from kiln.errors import ConfigError, DeviceError, MemoryFitError
from kiln.layers.attention import (
    INT8_SCALE_BYTES,
    INT8_SCALE_DTYPE,
    AttentionMetadata,
    KVStore,
    PrefillChunk,
    set_context,
)
from kiln.models.loader import Checkpoint, ProgressFn, build_model

log = logging.getLogger("kiln.runner")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
             "int8": torch.int8}
# On CPU the KV pool is capped unless the user sizes it (--kv-cache-memory): at the larger of
# this and the weights' own size. A small model's KV cache need not outweigh the model many
# times (512 MiB is ~23k tokens of SmolLM2-135M in bf16, what llama-server's -c 32768 holds in
# f16), and a big model's cap grows with it, up to the RAM fraction.
CPU_KV_AUTO_CAP = 512 * 1024 * 1024
# Cascade decode attention (layers/attention.py) when at least this many decode rows share at
# least this many leading blocks.
CASCADE_MIN_ROWS = 4
CASCADE_MIN_BLOCKS = 4


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
        # With --quantization, build_model swaps in kiln.layers.quant's modules
        # (quantize_model) and feeds GGUF 4-bit blocks to them directly.
        self.model = build_model(ckpt, dtype=self.dtype, device=self.device,
                                 max_positions=max(wanted, 1), progress=progress,
                                 quantization=config.quantization,
                                 keep_dense=config.dense_weights,
                                 cpu_kernels=config.cpu_kernels)
        self.load_seconds = time.monotonic() - t0
        ckpt.release()
        if self.device.type == "cpu":
            # Loading's transients (dequantized GGUF blocks, fp32 copies while quantizing) go
            # back to the kernel before the KV pool is allocated; from here on, freed memory is
            # kept for the steps to reuse.
            _release_freed_memory()
            _keep_freed_memory()
        self.weight_bytes = sum(t.numel() * t.element_size() for t in
                                [*self.model.parameters(), *self.model.buffers()])
        self.block_size = config.block_size
        self.kv_dtype_name = self._kv_dtype_name()
        self.plan = self._plan_memory()
        self.max_model_len = self.plan.max_model_len
        self._allocate_kv(self.plan.num_blocks)
        self.sampler = Sampler(mc.vocab_size, self.device, seed=config.seed)
        self._block_offsets = np.arange(self.block_size, dtype=np.int64)
        self._compiled: Callable[..., torch.Tensor] | None = None
        # Decode steps of up to this many rows run each layer as one call of kiln's CPU kernel
        # (LlamaDecoderLayer.forward_decode_kernel); 0: they cannot.
        self.decode_kernel_rows = self._decode_kernel_rows()
        self._buckets: list[int] = []
        self._cascade_compiled = False  # cascade steps have graphs of their own (CPU)
        self.compile_seconds = 0.0
        self._warmed_up = False
        if config.compile:
            self._setup_compile()
        if self.device.type == "cpu":
            _release_freed_memory()  # what loading, profiling and compiling freed

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
            cap = max(CPU_KV_AUTO_CAP, self.weight_bytes)
            budget = min(frac, need, cap)
            reason = (f"KV pool {_gib(budget)} = min({c.cpu_memory_utilization:.0%} of available "
                      f"RAM {_gib(avail)} - activations {_gib(act)}, {c.max_num_seqs} full "
                      f"contexts {_gib(need)}, CPU cap {_gib(cap)} = max(0.50 GiB, weights))")
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
            k = self._kv_zeros(shape, dtype)
            v = self._kv_zeros(shape, dtype)
            ks = vs = None
            if quant:
                ks = self._kv_zeros(shape[:2], INT8_SCALE_DTYPE)
                vs = self._kv_zeros(shape[:2], INT8_SCALE_DTYPE)
            layer.attach(KVStore(k, v, ks, vs, compute_dtype=self.dtype),
                         use_kernels=self.config.cpu_kernels)

    def _kv_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed KV tensor. On CPU it lives in its own anonymous mmap: the kernel hands out
        zero pages as they are first written, so the pool costs RSS for the blocks in use, not
        for its whole size up front (as llama.cpp's KV buffer does; torch.zeros would touch every
        page). The tensor, and every view of it, holds a reference to its map."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        count = math.prod(shape)
        buf = mmap.mmap(-1, max(count * dtype.itemsize, 1))
        return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)

    def _allocate_kv(self, num_blocks: int) -> None:
        # One block more than the plan: the scratch block, never handed to the block manager,
        # that padded rows of a compiled decode bucket write to and read from.
        self._scratch_block = num_blocks
        self._allocate_kv_slots((num_blocks + 1) * self.block_size,
                                KV_DTYPES[self.kv_dtype_name])

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]
                ) -> tuple[dict[str, int], dict[str, TokenLogprob]]:
        """One model step over the scheduler's batch; returns the sampled token (and logprobs)
        of every request whose chunk reached the end of its sequence. The only host sync is the
        sampler's single transfer of the chosen tokens."""
        # Decodes (one token) first, then prefill chunks: see the layout in layers/attention.py.
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        chunks = [s for s in scheduled if s.num_new_tokens != 1]
        nd = len(decodes)
        # Decode rows that all start with the same cached blocks attend to them once (cascade).
        shared = self._shared_prefix_blocks(decodes)
        # A decode-only step runs the compiled layers, padded up to its batch bucket; cascade
        # steps are a second graph of the buckets that can have them (CPU only: on CUDA that
        # graph is unmeasured, so cascade steps there stay eager).
        kernel = not chunks and 0 < nd <= self.decode_kernel_rows
        compiled = (not kernel and self._compiled is not None and not chunks
                    and 0 < nd <= self._buckets[-1] and (not shared or self._cascade_compiled))
        padded = next(b for b in self._buckets if b >= nd) if compiled else nd
        dec = self._decode_inputs(decodes, padded, shared) if decodes else None
        bs = self.block_size
        id_parts: list[np.ndarray] = []
        pos_parts: list[np.ndarray] = []
        slot_parts: list[np.ndarray] = []
        if dec is not None:
            id_parts.append(dec.ids)
            pos_parts.append(dec.positions)
            slot_parts.append(dec.slots)
        prefills: list[PrefillChunk] = []
        t = padded
        for s in chunks:
            r = s.request
            start, n = r.num_computed_tokens, s.num_new_tokens
            id_parts.append(np.asarray(r.token_ids_slice(start, start + n), dtype=np.int64))
            table = np.asarray(r.block_ids, dtype=np.int64)
            ctx_slots = (table[:, None] * bs + self._block_offsets).reshape(-1)[: start + n]
            pos_parts.append(np.arange(start, start + n, dtype=np.int64))
            slot_parts.append(ctx_slots[start:])
            chunk = PrefillChunk(t, t + n, start)
            if start > 0:
                chunk.gather = self._to_device(ctx_slots)
                q_pos = np.arange(start, start + n)[:, None]
                mask = np.arange(start + n)[None, :] <= q_pos
                chunk.mask = self._to_device(mask)[None, None]
            prefills.append(chunk)
            t += n
        meta = AttentionMetadata(slot_mapping=self._to_device(_cat(slot_parts)),
                                 num_decodes=padded, prefills=prefills)
        if dec is not None:
            meta.decode_gather = self._to_device(dec.gather)
            meta.decode_mask = self._to_device(dec.mask)[:, None, None, :]
            if dec.shared is not None:
                meta.decode_shared = self._to_device(dec.shared)
        input_ids = self._to_device(_cat(id_parts))
        positions = self._to_device(_cat(pos_parts))

        # Rows of the flattened step whose token ends its sequence: those sample.
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        for i, s in enumerate(decodes):
            if s.sample:
                sample_rows.append(i)
                sample_reqs.append(s.request)
        t = padded
        for s in chunks:
            t += s.num_new_tokens
            if s.sample:
                sample_rows.append(t - 1)
                sample_reqs.append(s.request)

        set_context(meta)
        try:
            if kernel:
                hidden = self.model(input_ids, positions, layer_call=_kernel_layer_call)
            elif compiled:
                hidden = self._run_compiled(input_ids, positions, meta)
            else:
                hidden = self.model(input_ids, positions)
        finally:
            set_context(None)
        if not sample_reqs:
            return {}, {}
        if len(sample_rows) == hidden.shape[0]:
            rows_hidden = hidden  # every row samples (plain decode): no gather
        elif sample_rows == list(range(len(sample_rows))):
            rows_hidden = hidden[: len(sample_rows)]
        else:
            rows_hidden = hidden[torch.tensor(sample_rows, device=self.device)]
        logits = self.model.compute_logits(rows_hidden)
        out = self.sampler(logits, sample_reqs)
        sampled = {r.request_id: tok for r, tok in zip(sample_reqs, out.token_ids)}
        logprobs = {r.request_id: lp for r, lp in zip(sample_reqs, out.logprobs)
                    if lp is not None}
        return sampled, logprobs

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def _shared_prefix_blocks(self, decodes: list[ScheduledRequest]) -> int:
        """How many leading KV blocks every decode row shares (the same physical blocks: a
        prefix-cache hit), when enough rows share enough of them for cascade attention to pay;
        else 0. Only full blocks before each row's current one count."""
        if len(decodes) < CASCADE_MIN_ROWS:
            return 0
        reqs = [s.request for s in decodes]
        limit = min(r.num_computed_tokens for r in reqs) // self.block_size
        if limit < CASCADE_MIN_BLOCKS:
            return 0
        heads = np.array([r.block_ids[:limit] for r in reqs], dtype=np.int64)
        same = (heads == heads[0]).all(axis=0)
        n = limit if same.all() else int(same.argmin())
        return n if n >= CASCADE_MIN_BLOCKS else 0

    def _decode_inputs(self, decodes: list[ScheduledRequest], padded: int,
                       shared_blocks: int = 0) -> _DecodeInputs:
        """Token ids, positions, slots and the context gather of the one-token rows, built with
        array ops (no per-sequence numpy calls). Rows past len(decodes) are padding for a
        compiled bucket: token 0 at position 0, reading and writing only the scratch block.
        With `shared_blocks`, the gather and mask start after those blocks, whose slots come
        separately (`shared`)."""
        bs = self.block_size
        nd = len(decodes)
        reqs = [s.request for s in decodes]
        starts = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=nd)
        ids = np.fromiter((_token_at(r, int(p)) for r, p in zip(reqs, starts)),
                          dtype=np.int64, count=nd)
        ctx = starts + 1
        nblk = int((ctx.max() + bs - 1) // bs)
        lens = np.fromiter((min(len(r.block_ids), nblk) for r in reqs), dtype=np.int64, count=nd)
        table = np.full((padded, nblk), self._scratch_block, dtype=np.int64)
        filled = np.arange(nblk)[None, :] < lens[:, None]
        table[:nd][filled] = np.fromiter(
            itertools.chain.from_iterable(r.block_ids[:nblk] for r in reqs), dtype=np.int64,
            count=int(lens.sum()))
        gather = (table[:, :, None] * bs + self._block_offsets).reshape(padded, nblk * bs)
        if padded > nd:
            ids = np.concatenate([ids, np.zeros(padded - nd, dtype=np.int64)])
            starts = np.concatenate([starts, np.zeros(padded - nd, dtype=np.int64)])
            ctx = np.concatenate([ctx, np.ones(padded - nd, dtype=np.int64)])
        mask = np.arange(nblk * bs)[None, :] < ctx[:, None]
        slots = gather[np.arange(padded), ctx - 1]
        shared = None
        if shared_blocks:
            p = shared_blocks * bs
            # Contiguous copies: the compiled graphs are traced (and guarded) on dense inputs.
            shared = gather[0, :p]
            gather, mask = np.ascontiguousarray(gather[:, p:]), np.ascontiguousarray(mask[:, p:])
        return _DecodeInputs(ids, starts, slots, gather, mask, shared)

    # ------------------------------------------------------------------ torch.compile

    def _setup_compile(self) -> None:
        """Compiles the decode step for each batch bucket (padded to it) and runs each once, so
        the cost is paid here at startup. The context length stays a dynamic dimension, so one
        graph per bucket serves every length. Compiled artifacts are cached on disk (inductor's
        FX graph cache under ~/.cache/kiln/inductor): a second start skips the C++ builds."""
        limit = max(self.config.max_num_seqs, 1)
        # Batches the layer kernel runs need no graph.
        self._buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)
                         if self.decode_kernel_rows < b < limit]
        if limit > self.decode_kernel_rows:
            self._buckets.append(limit)
        else:  # not even torch._dynamo's import (~2 s) is needed
            log.info("decode steps of up to %d rows run kiln's layer kernel: nothing to compile",
                     self.decode_kernel_rows)
            return
        _use_kiln_inductor_cache()
        import torch._dynamo

        t0 = time.monotonic()
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                    2 * len(self._buckets) + 4)
        # Regional compilation: one decoder layer's forward is compiled, and the same graph
        # serves all layers (their weights are graph inputs), so compile time does not grow
        # with depth. Whole-model graphs measured no faster and took ~25x longer to build.
        self._compiled = torch.compile(_fresh_layer_call(), fullgraph=False, dynamic=None)
        self._cascade_compiled = self.device.type == "cpu"
        for b in self._buckets:
            self._warm_up_bucket(b)
            if self._cascade_compiled and b >= CASCADE_MIN_ROWS:
                self._warm_up_bucket(b, cascade=True)
        self._warmed_up = True
        self.compile_seconds = time.monotonic() - t0
        log.info("compiled the decode step for batch buckets %s in %.1f s", self._buckets,
                 self.compile_seconds)

    @torch.inference_mode()
    def _warm_up_bucket(self, b: int, cascade: bool = False) -> None:
        """One decode step of `b` padding rows (scratch block only): compiles that bucket, or
        its cascade variant (a shared prefix read once)."""
        bs = self.block_size
        scratch = self._scratch_block * bs
        nkv = 2 * bs  # any length > 1: the dimension is dynamic (0 and 1 would specialize)
        gather = scratch + np.tile(np.arange(nkv, dtype=np.int64) % bs, (b, 1))
        mask = np.zeros((b, nkv), dtype=bool)
        mask[:, 0] = True
        meta = AttentionMetadata(
            slot_mapping=self._to_device(np.full(b, scratch, dtype=np.int64)), num_decodes=b,
            decode_gather=self._to_device(gather),
            decode_mask=self._to_device(mask)[:, None, None, :])
        if cascade:
            # A length of its own: equal sizes would share one symbol in the graph (dynamo's
            # duck shaping), which then guards that the shared and own parts stay equal.
            p = 3 * bs
            meta.decode_shared = self._to_device(scratch + np.arange(p, dtype=np.int64) % bs)
        ids = torch.zeros(b, dtype=torch.long, device=self.device)
        set_context(meta)
        try:
            self._run_compiled(ids, torch.zeros_like(ids), meta)
        finally:
            set_context(None)

    def _decode_kernel_rows(self) -> int:
        """Up to how many rows every decoder layer can run a decode step as one kernel call
        (kiln's CPU kernels, int4/int8 layers, a bf16 pool; see decode_kernel_rows in
        models/llama.py); 0 if any cannot, or if --no-cpu-kernels."""
        if not self.config.cpu_kernels or self.device.type != "cpu":
            return 0
        layers = list(getattr(getattr(self.model, "model", None), "layers", []))
        rows = [layer.decode_kernel_rows() if hasattr(layer, "decode_kernel_rows") else 0
                for layer in layers]
        return min(rows) if rows else 0

    def _run_compiled(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
        assert self._compiled is not None and meta.decode_gather is not None
        import torch._dynamo

        # The batch is static (bucketed); the context length is the one dynamic dimension.
        torch._dynamo.mark_dynamic(meta.decode_gather, 1)
        assert meta.decode_mask is not None
        torch._dynamo.mark_dynamic(meta.decode_mask, 3)
        if meta.decode_shared is not None:
            torch._dynamo.mark_dynamic(meta.decode_shared, 0)
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            if not self._warmed_up:
                return self.model(input_ids, positions, layer_call=self._compiled)
            # Every bucket was compiled at startup and the context length is dynamic, so no step
            # can need a new graph: only the guards that tell the buckets apart are checked.
            # Full guard evaluation measured ~37 us per layer call, ~1.1 ms of a ~11 ms step.
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self.model(input_ids, positions, layer_call=self._compiled)


@dataclass
class _DecodeInputs:
    ids: np.ndarray  # [B] int64
    positions: np.ndarray  # [B]
    slots: np.ndarray  # [B] slot each row's new K/V goes to
    gather: np.ndarray  # [B, nblk * block_size] context slots
    mask: np.ndarray  # [B, nblk * block_size] bool: position < context length
    shared: np.ndarray | None = None  # [P] slots every row shares (cascade), cut from gather


def _use_kiln_inductor_cache() -> None:
    """Points inductor's on-disk cache at ~/.cache/kiln/inductor unless the user chose a
    directory (TORCHINDUCTOR_CACHE_DIR). Importing torch._dynamo writes inductor's /tmp default
    into the environment, so that value counts as "not chosen"."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        base = Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(base / "inductor")


def _kernel_layer_call(layer: torch.nn.Module, cos: torch.Tensor, sin: torch.Tensor,
                       x: torch.Tensor) -> torch.Tensor:
    return layer.forward_decode_kernel(cos, sin, x)  # type: ignore[operator]


def _call_layer(layer: torch.nn.Module, *args: torch.Tensor) -> torch.Tensor:
    return layer(*args)


_layer_calls = itertools.count()


def _fresh_layer_call() -> Callable[..., torch.Tensor]:
    """`_call_layer` with a code object of its own. Dynamo keeps one cache of compiled graphs
    per code object: runners sharing one (several models in a process: tests, benchmarks) would
    pile their buckets into it, hit its recompile limit and silently run eager."""
    code = _call_layer.__code__.replace(co_name=f"_call_layer_{next(_layer_calls)}")
    return types.FunctionType(code, _call_layer.__globals__, code.co_name)


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _token_at(r: Request, pos: int) -> int:
    n = len(r.prompt_token_ids)
    return r.prompt_token_ids[pos] if pos < n else r.output_token_ids[pos - n]


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (whose malloc the two functions below tune), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _keep_freed_memory() -> None:
    """Lets glibc's malloc keep freed memory for reuse instead of returning it to the kernel.

    By default an allocation above 128 KiB (a threshold that adapts, up to 32 MiB) is its own
    mmap, unmapped on free, so each step's large activations (gathered KV, MLP intermediates)
    fault in fresh zeroed pages again: a bf16 copy of 3.5 MB measured 199 us that way and 116 us
    from retained memory. This is PyTorch's CUDA caching allocator idea, done by glibc; vLLM's
    CPU backend gets the same from tcmalloc. The cost is that RSS stays at the peak the steps
    reached."""
    libc = _glibc()
    if libc is not None:
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's ceiling on 64-bit (HEAP_MAX / 2)
        libc.mallopt(m_trim_threshold, 256 << 20)


def _release_freed_memory() -> None:
    """Returns the heap's free memory to the kernel once (glibc malloc_trim): startup's
    transients (GGUF dequantization, the profiling forward, inductor's compile) would otherwise
    stay in RSS, since `_keep_freed_memory` asks malloc to keep what is freed."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


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
