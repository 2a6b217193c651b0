"""ModelRunner: builds the model, owns the KV pool, and runs one step.

A step arrives as the scheduler's list of (request, tokens to compute). The runner flattens it into
input ids, positions and slots (decodes first, then prefill chunks, see layers/attention.py), runs
the model once, computes logits only for the sequences that sample, and hands them to the sampler.
Memory planning is in engine/memory.py, torch.compile in engine/compile.py, and the startup
choices (KV dtype, decode path, compiled or not, dense copies) in engine/decisions.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.engine import lora, memory
from kiln.engine.compile import CASCADE_MIN_BLOCKS, CASCADE_MIN_ROWS, DecodeGraphs
from kiln.engine.decisions import RuntimeDecisions, choose_kv_cache_dtype, decide
from kiln.engine.expert_placement import PlacementPlan, place_experts, pools_run_as_one
from kiln.engine.memory import KV_DTYPES, MemoryPlan
from kiln.engine.request import Request, TokenLogprob
from kiln.engine.sampler import Sampler, score_tokens
from kiln.engine.scheduler import ScheduledRequest
from kiln.engine.spec import sample_with_drafts
from kiln.errors import ConfigError, DeviceError
from kiln.i18n import msg
from kiln.layers import lora as lora_layer
from kiln.layers.attention import (
    INT8_SCALE_DTYPE,
    AttentionMetadata,
    KVStore,
    PrefillChunk,
    set_context,
)
from kiln.layers.moe import Experts, fuse_shared_experts
from kiln.models.llama import DECODE_KERNEL_ANY_ROWS, kernel_layer_call
from kiln.models.loader import Checkpoint, ProgressFn, build_model
from kiln.obs.trace import stage
from kiln.settings.engine_config import EngineConfig

log = logging.getLogger("kiln.runner")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Prompt logprobs are scored this many rows at a time: [rows, vocab] fp32 logits stay small.
PROMPT_LOGPROB_ROWS = 256

# request id -> (the prompt position the first entry scores, its TokenLogprobs in order)
PromptLogprobs = dict[str, tuple[int, list[TokenLogprob]]]
# request id -> its sampled token; a list (accepted drafts, then one more) for a drafted row
Sampled = dict[str, int | list[int]]
SampledLogprobs = dict[str, TokenLogprob | list[TokenLogprob]]


class ModelRunner:
    def __init__(self, config: EngineConfig, ckpt: Checkpoint,
                 progress: ProgressFn | None = None,
                 calibration_ids: list[list[int]] | None = None) -> None:
        """`calibration_ids`: token ids of the expert placement's calibration prompts (split
        MoE experts only; the front-ends tokenize them, see expert_placement)."""
        self.config = config
        self.ckpt = ckpt
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise DeviceError(msg("device.torch_sees_no_cuda"), hint=msg("device.cuda_fix"))
        if self.device.type == "cpu" and config.num_threads:
            torch.set_num_threads(config.num_threads)
        # The compute threads this runner was configured with (0 off the CPU): the engine's
        # thread governor (kiln/layers/kernels/threads.py) never goes above it.
        self.num_threads = torch.get_num_threads() if self.device.type == "cpu" else 0
        if self.device.type == "cpu" and config.quant.cpu_kernels:
            from kiln.layers import kernels

            kernels.ensure_selected(config.quant.cpu_isa)  # before any layer chooses its kernel
        self.dtype = DTYPES[config.dtype]
        mc = ckpt.config
        self.model_config = mc
        model_len = mc.context_length
        wanted = config.max_model_len or model_len
        if config.max_model_len_explicit and wanted > model_len:
            raise ConfigError(
                msg("load.context_too_long", wanted=wanted, model_len=model_len),
                hint=msg("load.context_too_long.hint", model_len=model_len))
        self.max_model_len = wanted
        t0 = time.monotonic()
        # Experts split into pools (--cpu-offload-experts), unless the pools run as one (a CPU
        # "device"), where everything below goes as without a split.
        split = config.experts.cpu_offload and not pools_run_as_one(self.device)
        # A GGUF's weights repacked at an earlier start are mapped from kiln's cache
        # (--tile-cache: a Q4_0/Q4_1 file's MoE experts, and the rest where it is large enough);
        # not where the experts get split into pools, which move them.
        self.tiles = None
        if (config.quant.tile_cache and ckpt.format == "gguf" and self.device.type == "cpu"
                and not split):
            from kiln.layers.tile_cache import TileCache

            self.tiles = TileCache.for_file(ckpt.path)
            self.tiles.prefetch()
        # With --quantization, build_model swaps in kiln.layers.quant.linear's modules
        # (quantize_model) and feeds GGUF 4-bit blocks to them directly.
        self.model = build_model(ckpt, dtype=self.dtype, device=self.device,
                                 max_positions=max(wanted, 1), progress=progress,
                                 quant=config.quant,
                                 # split experts are loaded into host memory; the device's
                                 # share moves there once placed
                                 experts_device="cpu" if split else None,
                                 tiles=self.tiles)
        self.load_seconds = time.monotonic() - t0
        if config.quant.batch_invariant:
            # One kernel per quantized layer whatever a step's row count (kiln.layers.quant.linear).
            from kiln.layers.quant.apply import fix_kernel_choice
            fix_kernel_choice(self.model)
        if not split:
            # (not where the experts get split into pools: the split takes routed experts)
            fuse_shared_experts(self.model)
        stage("weights_loaded")
        ckpt.release()
        if self.device.type == "cpu":
            # (after the checkpoint's release: each old storage is freed as it moves)
            # (the machine's THP setting decides: `never` leaves them where they are)
            # (the MoE layers' stacks stay: packed onto 2 MiB pages, or the tile cache's maps)
            apart = {t.untyped_storage().data_ptr() for m in self.model.modules()
                     if isinstance(m, Experts) and (st := m.tile_stacks()) is not None
                     for t in st}
            moved = memory.weights_on_huge_pages(self.model, cache=self.tiles, apart=apart)
            log.info("weights on huge pages: %.0f MB%s", moved / 1e6,
                     " (mapped from the tile cache)"
                     if self.tiles is not None and self.tiles.weights_hit
                     else "")
            # Loading's transients (dequantized GGUF blocks, fp32 copies while quantizing) go
            # back to the kernel before the KV pool is allocated; from here on, freed memory is
            # kept for the steps to reuse.
            memory.release_freed_memory()
            memory.keep_freed_memory()
            if self.tiles is not None:
                # (after the move to huge pages: the writer reads the stacks where they stay)
                if self.tiles.hits:
                    log.info("tile cache: %d MoE layers mapped from %s", self.tiles.hits,
                             self.tiles.folder)
                self.tiles.save_in_background(
                    (m.layer, *st) for m in self.model.modules() if isinstance(m, Experts)
                    and not m.from_tile_cache and (st := m.tile_stacks()) is not None)
        self.block_size = config.cache.block_size
        kv_dtype = choose_kv_cache_dtype(config, self.device, mla=mc.is_mla)
        self.kv_dtype_name: str = kv_dtype.value
        # MoE experts split into a device pool and CPU pools (--cpu-offload-experts): placed
        # (and calibrated) before the memory plan, which counts only what is on the device.
        self.expert_executors: list = []
        self.placement: PlacementPlan | None = None
        if config.experts.cpu_offload and mc.is_moe:
            self.placement = place_experts(self, calibration_ids)
        self.weight_bytes = sum(t.numel() * t.element_size() for t in
                                [*self.model.parameters(), *self.model.buffers()]
                                if t.device.type == self.device.type)
        act, act_source = memory.activation_peak(self._peak_key(), self.device,
                                                 self._largest_step)
        # Kernels are built and loaded (the profiling prefill, when it ran, ran every layer).
        stage("kernels_ready")
        # Logits and sampler temporaries for max_num_seqs rows come on top.
        act += config.scheduler.max_num_seqs * mc.vocab_size * 4 * 3
        self.plan: MemoryPlan = memory.plan_memory(
            config, self.device, self.kv_bytes_per_token(), self.weight_bytes, act,
            self.max_model_len, act_source)
        self.max_model_len = self.plan.max_model_len
        self._allocate_kv(self.plan.num_blocks)
        stage("kv_allocated")
        self.sampler = Sampler(mc.vocab_size, self.device, seed=config.seed)
        self._block_offsets = np.arange(self.block_size, dtype=np.int64)
        # Made once, here; the step only reads them (see engine/decisions.py).
        self.decisions: RuntimeDecisions = decide(config, self.model, self.device, kv_dtype)
        # Decode steps of up to this many rows run each layer as one call of kiln's CPU kernel
        # (LlamaDecoderLayer.forward_decode_kernel); 0: they cannot.
        self.decode_kernel_rows = self.decisions.decode_kernel_rows
        # The compiled decode graphs; None: nothing compiled (or turned off by a test).
        self.graphs: DecodeGraphs | None = None
        if self.decisions.compile_buckets:
            self.graphs = DecodeGraphs(self.model, list(self.decisions.compile_buckets),
                                       # no cascade graphs where cascade is off (windowed
                                       # or soft-capped layers: see decisions.py)
                                       cascade=(self.device.type == "cpu"
                                                and self.decisions.cascade.value),
                                       scratch_block=self._scratch_block,
                                       block_size=self.block_size, device=self.device)
        elif config.compile:  # not even torch._dynamo's import (~2 s) is needed
            log.info("%s", self.decisions.compiled.reason)
        self.compile_seconds = self.graphs.seconds if self.graphs is not None else 0.0
        # LoRA adapters (kiln/engine/lora.py), attached by the engine when it serves any.
        self.lora: lora.LoRAManager | None = None
        stage("compiled")  # reached with nothing compiled too: the stage is "past compiling"
        if self.device.type == "cpu":
            memory.release_freed_memory()  # what loading, profiling and compiling freed

    # ------------------------------------------------------------------ the KV pool

    def kv_bytes_per_token(self) -> int:
        return memory.kv_bytes_per_token(self.model_config, self.kv_dtype_name)

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

    def _peak_key(self) -> dict[str, Any]:
        """What the activation peak of `_largest_step` depends on (memory.activation_peak): the
        model's files as they are, every engine setting, the device, torch, kiln's sources."""
        files = [Path(self.config.model)]
        if files[0].is_dir():
            files = sorted(p for p in files[0].iterdir() if p.is_file())
        stats = [(str(p), st.st_size, st.st_mtime_ns)
                 for p in files if p.exists() for st in [p.stat()]]
        device = (torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                  else self.device.type)
        return {"files": stats, "config": dataclasses.asdict(self.config), "device": device,
                "max_model_len": self.max_model_len, "torch": torch.__version__,
                "threads": torch.get_num_threads(), "kiln": memory.source_digest()}

    def _largest_step(self) -> None:
        """The largest step the scheduler may produce (one prefill chunk of the token budget),
        whose memory the plan measures."""
        n = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        self._scratch_forward(torch.zeros(n, dtype=torch.long, device=self.device), None)

    def _allocate_kv_slots(self, num_slots: int, dtype: torch.dtype) -> None:
        """Each attention layer's pool, [num_slots, *row] for the rows it says it keeps
        (`Attention.kv_shapes`: K and V, or MLA's one latent row whose first columns are V)."""
        quant = dtype == torch.int8
        for layer in self.model.attention_layers():
            k_row, v_row = layer.kv_shapes()
            k = memory.kv_zeros((num_slots, *k_row), dtype, self.device)
            v = memory.kv_zeros((num_slots, *v_row), dtype, self.device) if v_row else None
            ks = vs = None
            if quant:
                ks = memory.kv_zeros((num_slots, k_row[0]), INT8_SCALE_DTYPE, self.device)
                if v_row:
                    vs = memory.kv_zeros((num_slots, v_row[0]), INT8_SCALE_DTYPE, self.device)
            layer.attach(KVStore(k, v, ks, vs, compute_dtype=self.dtype, v_dim=layer.v_head_dim),
                         use_kernels=self.config.quant.cpu_kernels,
                         invariant=self.config.quant.batch_invariant)

    def _allocate_kv(self, num_blocks: int) -> None:
        # One block more than the plan: the scratch block, never handed to the block manager,
        # that padded rows of a compiled decode bucket write to and read from.
        self._scratch_block = num_blocks
        self._allocate_kv_slots((num_blocks + 1) * self.block_size,
                                KV_DTYPES[self.kv_dtype_name])

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest],
                marks: dict[str, float] | None = None, *, logits_only: bool = False
                ) -> tuple[Sampled, SampledLogprobs, PromptLogprobs]:
        """One model step over the scheduler's batch; returns the sampled token (and logprobs)
        of every request whose chunk reached the end of its sequence (a list for a row that
        verified drafts: engine/spec.py), and the prompt logprobs
        of the prompt tokens this step's rows predict (requests with prompt_logprobs only).
        The only host sync is the sampler's single transfer of the chosen tokens (and, for
        prompt logprobs, theirs). With `marks` (a profiled step), the seconds of its prepare,
        forward and sample phases are put there. `logits_only` (a draft model's step,
        engine/draft.py): returns (logits of the sampling rows, their requests), sampling
        nothing; (None, []) when no row samples."""
        if marks is not None:
            t0 = time.perf_counter()
        # Decodes (one token) first, then prefill chunks: see the layout in layers/attention.py.
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        chunks = [s for s in scheduled if s.num_new_tokens != 1]
        nd = len(decodes)
        # Rows of LoRA adapters run the eager modules, whose target linears add their adapters,
        # or the layer kernel, which adds them with the same lora_add (the compiled graphs know
        # only the base weights). Decodes are sorted by adapter so
        # that each adapter's rows are one range (engine/lora.py).
        adapters = self.lora is not None and any(s.request.lora_id for s in scheduled)
        if adapters:
            decodes.sort(key=lambda s: s.request.lora_id)
        # Decode rows that all start with the same cached blocks attend to them once (cascade).
        shared = self._shared_prefix_blocks(decodes)
        # A decode-only step runs kiln's layer kernel up to its rows, else the compiled layers
        # padded up to its batch bucket; cascade steps only where their graphs exist.
        graphs = self.graphs
        # The layer kernel (batch-invariant) runs every step, prefill chunks and speculative
        # verify rows too (each row with its own context: `step_rows`).
        every_step = self.decode_kernel_rows >= DECODE_KERNEL_ANY_ROWS
        lora_kernel = every_step and self.lora is not None and self.lora.kernel
        kernel = (not adapters or lora_kernel) and (
            bool(scheduled) if every_step else not chunks and 0 < nd <= self.decode_kernel_rows)
        compiled = (not kernel and not adapters and graphs is not None and not chunks
                    and 0 < nd <= graphs.buckets[-1] and (not shared or graphs.cascade))
        padded = next(b for b in graphs.buckets if b >= nd) if compiled else nd
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
        chunk_slots: list[np.ndarray] = []  # each chunk's context slots (the layer kernel's)
        t = padded
        for s in chunks:
            r = s.request
            start, n = r.num_computed_tokens, s.num_new_tokens
            k = len(s.spec_token_ids)  # draft tokens after the last one (engine/spec.py)
            id_parts.append(np.asarray(r.token_ids_slice(start, start + n - k)
                                       + s.spec_token_ids, dtype=np.int64))
            table = np.asarray(r.block_ids, dtype=np.int64)
            ctx_slots = (table[:, None] * bs + self._block_offsets).reshape(-1)[: start + n]
            pos_parts.append(np.arange(start, start + n, dtype=np.int64))
            slot_parts.append(ctx_slots[start:])
            chunk_slots.append(ctx_slots)
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
            meta.decode_lens = self._to_device(dec.positions[:nd] + 1)
            if dec.shared is not None:
                meta.decode_shared = self._to_device(dec.shared)
        if kernel and every_step:
            meta.step_rows = tuple(self._to_device(a) for a in _step_rows(
                dec, nd, chunk_slots, [s.request.num_computed_tokens for s in chunks]))
        input_ids = self._to_device(_cat(id_parts))
        positions = self._to_device(_cat(pos_parts))
        # Each row's adapter id (0: base), grouped for the LoRA matmuls; rows as laid out above
        # (decodes, unpadded in an adapter step, then the prefill chunks).
        lora_step = self.lora.step_of(np.fromiter(
            itertools.chain((s.request.lora_id for s in decodes),
                            itertools.chain.from_iterable(
                                itertools.repeat(s.request.lora_id, s.num_new_tokens)
                                for s in chunks)), dtype=np.int64)) \
            if adapters and self.lora is not None else None

        # Rows of the flattened step whose token ends its sequence: those sample.
        # A row with k drafts samples at its last k + 1 rows (each draft is checked).
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        drafts: list[list[int]] = []
        for i, s in enumerate(decodes):
            if s.sample:
                sample_rows.append(i)
                sample_reqs.append(s.request)
                drafts.append(s.spec_token_ids)
        t = padded
        for s in chunks:
            t += s.num_new_tokens
            if s.sample:
                sample_rows.extend(range(t - 1 - len(s.spec_token_ids), t))
                sample_reqs.append(s.request)
                drafts.append(s.spec_token_ids)
        # A draft model's distributions of the drafts (cut as the scheduler cut the drafts).
        draft_probs = [r.spec_draft_probs[:len(d)] if d and r.spec_draft_probs is not None
                       else None for r, d in zip(sample_reqs, drafts)]

        if marks is not None:
            self._sync()
            t1 = time.perf_counter()
            marks["prepare"] = t1 - t0
        set_context(meta)
        lora_layer.set_step(lora_step)
        try:
            if kernel:
                hidden = self.model(input_ids, positions, layer_call=kernel_layer_call)
            elif compiled:
                hidden = graphs.run(self.model, input_ids, positions, meta)
            else:
                hidden = self.model(input_ids, positions)
        finally:
            set_context(None)
            lora_layer.set_step(None)
        if marks is not None:
            self._sync()
            t2 = time.perf_counter()
            marks["forward"] = t2 - t1
        prompt_lps = self._prompt_logprobs(decodes, chunks, padded, hidden)
        if logits_only and not sample_reqs:
            return None, [], {}  # type: ignore[return-value]
        if not sample_reqs:
            if marks is not None:
                marks["sample"] = 0.0
            return {}, {}, prompt_lps
        if len(sample_rows) == hidden.shape[0]:
            rows_hidden = hidden  # every row samples (plain decode): no gather
        elif sample_rows == list(range(len(sample_rows))):
            rows_hidden = hidden[: len(sample_rows)]
        else:
            rows_hidden = hidden[torch.tensor(sample_rows, device=self.device)]
        logits = self.model.compute_logits(rows_hidden)
        if logits_only:
            return logits, sample_reqs, {}  # type: ignore[return-value]
        sampled, logprobs = sample_with_drafts(self.sampler, logits, sample_reqs, drafts,
                                               draft_probs)
        if marks is not None:
            marks["sample"] = time.perf_counter() - t2  # token ids are on the host: synced
        return sampled, logprobs, prompt_lps

    def _prompt_logprobs(self, decodes: list[ScheduledRequest], chunks: list[ScheduledRequest],
                         padded: int, hidden: torch.Tensor) -> PromptLogprobs:
        """For each request that asked for prompt logprobs: the row at position q scores prompt
        token q + 1, so this step's rows up to the prompt's second-to-last position do. (Its
        last prompt row samples the first output token instead.)"""
        out: PromptLogprobs = {}
        rows = [(s, i) for i, s in enumerate(decodes)]
        t = padded
        for s in chunks:
            rows.append((s, t))
            t += s.num_new_tokens
        for s, row in rows:
            r = s.request
            if r.params.prompt_logprobs is None:
                continue
            start = r.num_computed_tokens
            end = min(start + s.num_new_tokens, r.num_prompt_tokens - 1)
            if end <= start:
                continue
            targets = r.prompt_token_ids[start + 1:end + 1]
            scored: list[TokenLogprob] = []
            for a in range(0, len(targets), PROMPT_LOGPROB_ROWS):
                n = min(PROMPT_LOGPROB_ROWS, len(targets) - a)
                logits = self.model.compute_logits(hidden[row + a:row + a + n])
                scored += score_tokens(logits[:, :self.model_config.vocab_size],
                                       targets[a:a + n], r.params.prompt_logprobs)
            out[r.request_id] = (start + 1, scored)
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def _shared_prefix_blocks(self, decodes: list[ScheduledRequest]) -> int:
        """How many leading KV blocks every decode row shares (the same physical blocks: a
        prefix-cache hit), when enough rows share enough of them for cascade attention to pay;
        else 0. Only full blocks before each row's current one count."""
        if len(decodes) < CASCADE_MIN_ROWS or not self.decisions.cascade.value:
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


@dataclass
class _DecodeInputs:
    ids: np.ndarray  # [B] int64
    positions: np.ndarray  # [B]
    slots: np.ndarray  # [B] slot each row's new K/V goes to
    gather: np.ndarray  # [B, nblk * block_size] context slots
    mask: np.ndarray  # [B, nblk * block_size] bool: position < context length
    shared: np.ndarray | None = None  # [P] slots every row shares (cascade), cut from gather


def _step_rows(dec: _DecodeInputs | None, nd: int, chunk_slots: list[np.ndarray],
               chunk_starts: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(table, row_of, lens) of every row of a step, as attend_rows reads them: a decode row
    its gathered context, each prefill chunk one table row of its context slots whose tokens
    read up to their own positions (AttentionMetadata.step_rows)."""
    assert dec is None or dec.shared is None, "cascade is off where the layer kernel runs"
    widths = [len(c) for c in chunk_slots] + ([dec.gather.shape[1]] if dec is not None else [])
    table = np.zeros((nd + len(chunk_slots), max(widths)), dtype=np.int64)
    row_of = [np.arange(nd, dtype=np.int64)]
    lens = [dec.positions[:nd] + 1] if dec is not None else []
    if dec is not None:
        table[:nd, :dec.gather.shape[1]] = dec.gather[:nd]
    for j, (slots, start) in enumerate(zip(chunk_slots, chunk_starts)):
        n = len(slots) - start
        table[nd + j, :len(slots)] = slots
        row_of.append(np.full(n, nd + j, dtype=np.int64))
        lens.append(np.arange(start + 1, start + n + 1, dtype=np.int64))
    return table, _cat(row_of), _cat(lens)


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _token_at(r: Request, pos: int) -> int:
    n = len(r.prompt_token_ids)
    return r.prompt_token_ids[pos] if pos < n else r.output_token_ids[pos - n]
