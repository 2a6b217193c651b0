"""Embeddings in kiln's engine: pooling, the embedder (encoder or decoder), and its batching loop.

    /v1/embeddings --token ids--> EmbeddingEngine.embed (event loop)
        --queue--> engine thread: pending inputs in arrival order; each batch cut from the
                   oldest of them, longest first, within the token budget
                   (--max-num-batched-tokens) and --max-num-seqs
        --> Embedder.run(batch): one forward, pool, normalize --> float32 vectors
        --loop.call_soon_threadsafe--> the request's future, once all its inputs are done

Why not the generation scheduler: its unit of work is a request's `num_computed_tokens` against
KV blocks, step after step. An embedding has neither: one forward over the whole input, no KV
kept, no decode. What it needs from a scheduler is only batching within a token budget, which
the loop here does in ~30 lines on the same kind of thread (the one OpenMP master; see
kiln/engine/async_engine.py), so requests arriving together share a forward.

Two embedders:
  * encoders (BertModel): the batch padded to its longest input, padding masked; pooled as the
    model's sentence-transformers `1_Pooling/config.json` says (mean / cls / last / max),
    normalized when modules.json has a Normalize module.
  * decoders used as embedders (Qwen3-Embedding, llama-server --embedding): kiln's causal model
    over the batch flattened (no padding), each input a prefill from position 0; the final
    norm's hidden states pooled (last token by default, or mean).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.errors import KilnError, ModelLoadError
from kiln.kinds import read_json, st_modules

log = logging.getLogger("kiln.embedding")

POOLING_MODES = ("mean", "cls", "last", "max")
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_DENSE = "sentence_transformers.models.Dense"


@dataclass(frozen=True)
class PoolingConfig:
    mode: str  # one of POOLING_MODES
    normalize: bool
    reason: str  # where it came from (the effective config shows it)
    # Matryoshka: dimensions the model was trained to be truncated to (None: not supported).
    matryoshka: tuple[int, ...] | None = None
    any_dimensions: bool = False  # config.json `is_matryoshka`: any prefix is fine


def pooling_from_folder(folder: Path | None, *, encoder: bool) -> PoolingConfig:
    """The model's own pooling: sentence-transformers' Pooling module config and whether a
    Normalize module follows; without one, CLS for an encoder and last token for a decoder
    (vLLM's defaults), normalized (as OpenAI's embeddings are)."""
    mods = st_modules(folder) if folder is not None and folder.is_dir() else []
    cfg = (read_json(folder / "config.json") if folder is not None and folder.is_dir()
           else None) or {}
    mat = cfg.get("matryoshka_dimensions")
    matryoshka = tuple(int(d) for d in mat) if isinstance(mat, list) and mat else None
    any_dims = bool(cfg.get("is_matryoshka"))
    if any(m.get("type") == _ST_DENSE for m in mods):
        raise ModelLoadError("this sentence-transformers model has a Dense module after "
                             "pooling, which kiln does not run",
                             hint="serve it with --engine vllm, or pick a model without one")
    pool = next((m for m in mods if m.get("type") == _ST_POOLING), None)
    normalize = any(m.get("type") == _ST_NORMALIZE for m in mods) if mods else True
    if pool is not None and folder is not None:
        pcfg = read_json(folder / str(pool.get("path") or "1_Pooling") / "config.json") or {}
        flags = {"mean": pcfg.get("pooling_mode_mean_tokens"),
                 "cls": pcfg.get("pooling_mode_cls_token"),
                 "last": pcfg.get("pooling_mode_lasttoken"),
                 "max": pcfg.get("pooling_mode_max_tokens")}
        on = [k for k, v in flags.items() if v]
        if pcfg.get("pooling_mode_mean_sqrt_len_tokens") or len(on) != 1:
            raise ModelLoadError(f"pooling {pcfg} is not one of kiln's modes",
                                 hint=f"kiln pools by one of {', '.join(POOLING_MODES)}")
        where = f"{pool.get('path') or '1_Pooling'}/config.json"
        norm = "modules.json has Normalize" if normalize else "modules.json has no Normalize"
        return PoolingConfig(on[0], normalize, f"{where}: {on[0]}; {norm}", matryoshka, any_dims)
    mode = "cls" if encoder else "last"
    why = ("no sentence-transformers pooling config: "
           + ("CLS for an encoder" if encoder else "the last token for a decoder")
           + " (vLLM's default), normalized")
    return PoolingConfig(mode, True, why, matryoshka, any_dims)


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """hidden [B, L, H], mask [B, L] (1: a real token; padding on the right) -> [B, H] fp32,
    as sentence-transformers pools."""
    h = hidden.float()
    m = mask.to(h.dtype).unsqueeze(-1)
    if mode == "mean":
        return (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
    if mode == "cls":
        return h[:, 0]
    if mode == "last":
        last = mask.long().sum(1) - 1
        return h[torch.arange(h.shape[0], device=h.device), last]
    if mode == "max":
        return h.masked_fill(m == 0, -1e9).amax(1)
    raise ValueError(f"unknown pooling mode {mode!r}")


# --------------------------------------------------------------------------- embedders


class Embedder:
    """A model that turns token ids into one vector each (run on the engine thread)."""

    dim: int
    max_len: int
    pooling: PoolingConfig
    description: str

    def run(self, batch: list[list[int]]) -> torch.Tensor:  # [len(batch), dim] float32
        raise NotImplementedError

    def finish(self, pooled: torch.Tensor) -> torch.Tensor:
        if self.pooling.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled.float().cpu()


class EncoderEmbedder(Embedder):
    """BertModel: a batch padded to its longest input, padding masked out of attention."""

    def __init__(self, model: Any, pooling: PoolingConfig, max_len: int, pad_id: int,
                 device: torch.device) -> None:
        self.model, self.pooling, self.max_len = model, pooling, max_len
        self.pad_id, self.device = pad_id, device
        self.dim = model.config.hidden_size
        self.description = f"{model.config.architecture} encoder, {pooling.mode} pooling"

    @torch.inference_mode()
    def run(self, batch: list[list[int]]) -> torch.Tensor:
        n = max(len(ids) for ids in batch)
        ids = torch.full((len(batch), n), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), n), dtype=torch.bool)
        for i, row in enumerate(batch):
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row)] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.model(ids, mask)
        return self.finish(pool(hidden, mask, self.pooling.mode))


class DecoderEmbedder(Embedder):
    """kiln's causal model as an embedder: the batch flattened (no padding), each input one
    prefill chunk from position 0, the final norm's hidden states pooled."""

    def __init__(self, model: Any, pooling: PoolingConfig, max_len: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        from kiln.layers.attention import KVStore

        self.model, self.pooling, self.max_len, self.device = model, pooling, max_len, device
        self.dim = model.config.hidden_size
        self.description = f"{model.config.architecture} as an embedder, {pooling.mode} pooling"
        # Attention writes a step's K/V to its pool before attending, but a prefill chunk that
        # starts at position 0 attends over the step's own k and v, never reading the pool.
        # Nothing is kept between batches, so each layer gets a one-slot sink, not a KV pool.
        for attn in model.attention_layers():
            k_shape, v_shape = attn.kv_shapes()
            k = torch.empty((1, *k_shape), dtype=dtype, device=device)
            v = torch.empty((1, *v_shape), dtype=dtype, device=device) if v_shape else None
            attn.attach(KVStore(k, v, compute_dtype=dtype, v_dim=attn.v_head_dim),
                        use_kernels=False, invariant=False)

    @torch.inference_mode()
    def run(self, batch: list[list[int]]) -> torch.Tensor:
        from kiln.layers.attention import AttentionMetadata, PrefillChunk, set_context

        flat = [t for ids in batch for t in ids]
        positions = [p for ids in batch for p in range(len(ids))]
        chunks, start = [], 0
        for ids in batch:
            chunks.append(PrefillChunk(start, start + len(ids), 0))
            start += len(ids)
        dev = self.device
        set_context(AttentionMetadata(
            slot_mapping=torch.zeros(len(flat), dtype=torch.long, device=dev), prefills=chunks))
        try:
            hidden = self.model.model(torch.tensor(flat, device=dev),
                                      torch.tensor(positions, device=dev))
        finally:
            set_context(None)
        if self.pooling.mode == "last":
            pooled = hidden[torch.tensor([c.end - 1 for c in chunks], device=dev)].float()
        elif self.pooling.mode == "mean":
            pooled = torch.stack([hidden[c.start:c.end].float().mean(0) for c in chunks])
        elif self.pooling.mode == "cls":
            pooled = hidden[torch.tensor([c.start for c in chunks], device=dev)].float()
        else:
            pooled = torch.stack([hidden[c.start:c.end].float().amax(0) for c in chunks])
        return self.finish(pooled)


def sentence_max_len(folder: Path | None) -> int | None:
    """sentence-transformers' max_seq_length (sentence_bert_config.json): the length the model
    was trained to embed, which vLLM also takes as the model's limit."""
    if folder is None or not folder.is_dir():
        return None
    cfg = read_json(folder / "sentence_bert_config.json") or {}
    n = cfg.get("max_seq_length")
    return int(n) if isinstance(n, int) and n > 0 else None


def build_embedder(ckpt: Any, *, pooling_mode: str | None, dtype: str, device: str,
                   num_threads: int | None, max_model_len: int | None) -> Embedder:
    """The embedder for a checkpoint (kiln.models.loader.Checkpoint): an encoder runs as
    itself; a causal LM runs as a decoder embedder. `pooling_mode` overrides the model's."""
    from kiln.models.loader import build_model, iter_tensors
    from kiln.settings.engine_config import QuantConfig

    if num_threads:
        torch.set_num_threads(num_threads)
    cfg = ckpt.config
    folder = ckpt.path if ckpt.path.is_dir() else None
    pooling = pooling_from_folder(folder, encoder=cfg.is_encoder)
    if pooling_mode and pooling_mode != pooling.mode:
        pooling = PoolingConfig(pooling_mode, pooling.normalize, f"--pooling {pooling_mode} "
                                f"(the model's: {pooling.reason})", pooling.matryoshka,
                                pooling.any_dimensions)
    positions = cfg.max_position_embeddings
    if cfg.architecture in ("RobertaModel", "XLMRobertaModel"):  # they start after the padding
        positions -= (cfg.pad_token_id if cfg.pad_token_id is not None else 1) + 1
    limit = min(n for n in (positions, sentence_max_len(folder), max_model_len) if n)
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
              "float16": torch.float16}[dtype]
    dev = torch.device(device)
    if cfg.is_encoder:
        from kiln.models.architectures import model_class

        model = model_class(cfg.architecture)(cfg)
        model.load_checkpoint_tensors(iter_tensors(ckpt))
        model = model.to(device=dev, dtype=tdtype).eval()
        return EncoderEmbedder(model, pooling, limit, cfg.pad_token_id or 0, dev)
    model = build_model(ckpt, dtype=tdtype, device=dev, max_positions=limit,
                        quant=QuantConfig(cpu_kernels=False))
    return DecoderEmbedder(model, pooling, limit, dev, tdtype)


# --------------------------------------------------------------------------- batching loop


class EmbeddingOverloadedError(KilnError):
    """Too many inputs are waiting: the server answers 503."""


@dataclass
class _Job:
    inputs: list[list[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[torch.Tensor]
    out: list[torch.Tensor | None] = field(default_factory=list)
    left: int = 0


class EmbeddingEngine:
    """The embedder built and run on its own thread (the one OpenMP master, as AsyncEngine's);
    `embed` is awaited on the event loop. Quacks like AsyncEngine where the app reads it
    (stats, routing_stats, finished_listeners, num_inflight, shutdown)."""

    def __init__(self, factory: Callable[[], Embedder], *, max_batch_tokens: int,
                 max_batch_seqs: int, max_queue: int = 1024) -> None:
        self._factory = factory
        self.embedder: Embedder | None = None
        self.max_batch_tokens, self.max_batch_seqs = max_batch_tokens, max_batch_seqs
        self.max_queue = max_queue
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._pending: list[tuple[_Job, int]] = []  # (job, input index), engine thread only
        self._queued_inputs = 0  # inputs accepted and not yet embedded (both threads)
        self._lock = threading.Lock()
        self._built = threading.Event()
        self._dead: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="kiln-embed", daemon=True)
        self._stats: dict[str, float] = {"steps": 0, "step_seconds": 0.0, "prefill_tokens": 0,
                                         "num_running": 0, "num_waiting": 0}
        self.finished_listeners: list[Callable[[Any], None]] = []
        self.num_inflight = 0

    # ---------------------------------------------------------------- lifecycle

    def start(self, wait: bool = True) -> EmbeddingEngine:
        from kiln.engine.async_engine import GIL_SWITCH_INTERVAL_S

        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self._thread.start()
        if wait:
            self.wait_built()
        return self

    def wait_built(self) -> Embedder:
        self._built.wait()
        if self.embedder is None:
            assert self._dead is not None
            raise self._dead
        return self.embedder

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._jobs.put(None)
        self._thread.join(timeout)

    def stats(self) -> dict[str, float]:
        if self._dead is not None:
            raise RuntimeError(f"embedding engine stopped: {self._dead}")
        s = dict(self._stats)
        s["num_inflight"] = self.num_inflight
        s["num_waiting"] = self._queued_inputs
        return s

    def routing_stats(self) -> dict[int, list[int]]:
        return {}

    # ---------------------------------------------------------------- request side

    async def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """[len(inputs), dim] float32, one row per input, in order."""
        if self._dead is not None:
            from kiln.engine.async_engine import EngineDeadError

            raise EngineDeadError(f"the embedding engine stopped: {self._dead}")
        with self._lock:
            if self._queued_inputs + len(inputs) > self.max_queue:
                raise EmbeddingOverloadedError(
                    f"{self._queued_inputs} inputs are waiting (--max-queue {self.max_queue})")
            self._queued_inputs += len(inputs)
        loop = asyncio.get_running_loop()
        job = _Job(inputs, loop, loop.create_future(), [None] * len(inputs), len(inputs))
        self.num_inflight += 1
        try:
            self._jobs.put(job)
            return await job.future
        finally:
            self.num_inflight -= 1

    # ---------------------------------------------------------------- engine thread

    def _main(self) -> None:
        try:
            self.embedder = self._factory()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            self._dead = e
        finally:
            self._built.set()
        if self.embedder is None:
            return
        while not self._stop.is_set():
            try:
                self._take(block=not self._pending)
                if self._pending:
                    self._step()
            except Exception as e:
                log.exception("embedding batch failed")
                self._fail_pending(e)

    def _take(self, block: bool) -> None:
        """Moves newly submitted jobs' inputs into the pending list (waits for one if idle)."""
        try:
            job = self._jobs.get(block=block)
        except queue.Empty:
            return
        while job is not None:
            self._pending.extend((job, i) for i in range(len(job.inputs)))
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                job = None

    def _step(self) -> None:
        """One forward over a batch that fits the budget. Inputs wait in arrival order; the
        batch is cut from the oldest `4 x max_batch_seqs` of them, longest first (less padding
        for an encoder; sentence-transformers sorts by length too), so reordering is bounded
        and no input waits behind an endless stream of longer ones. A lone input longer than
        the budget still runs."""
        assert self.embedder is not None
        window = self._pending[:4 * self.max_batch_seqs]
        order = sorted(range(len(window)), key=lambda k: -len(window[k][0].inputs[window[k][1]]))
        longest = len(window[order[0]][0].inputs[window[order[0]][1]])
        take = 1
        while take < min(len(order), self.max_batch_seqs) and \
                longest * (take + 1) <= self.max_batch_tokens:
            take += 1
        chosen = set(order[:take])
        batch = [window[k] for k in order[:take]]
        self._pending = [p for k, p in enumerate(window) if k not in chosen] + \
            self._pending[len(window):]
        ids = [job.inputs[i] for job, i in batch]
        self._stats["num_running"] = len(batch)
        t0 = time.perf_counter()
        try:
            vectors = self.embedder.run(ids)
        except Exception as e:
            log.exception("embedding batch failed")
            for job in {id(j): j for j, _ in batch}.values():
                self._fail(job, e)
            return
        finally:
            self._stats["num_running"] = 0
        self._stats["steps"] += 1
        self._stats["step_seconds"] += time.perf_counter() - t0
        self._stats["prefill_tokens"] += sum(map(len, ids))
        with self._lock:
            self._queued_inputs -= len(batch)
        for row, (job, i) in enumerate(batch):
            job.out[i] = vectors[row]
            job.left -= 1
            if job.left == 0:
                self._resolve(job)

    def _resolve(self, job: _Job, error: BaseException | None = None) -> None:
        def done() -> None:
            if job.future.done():  # the client went away
                return
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(torch.stack([t for t in job.out if t is not None]))

        job.loop.call_soon_threadsafe(done)

    def _fail(self, job: _Job, error: BaseException) -> None:
        """The job's inputs still to run are dropped (they are counted in `job.left`)."""
        with self._lock:
            self._queued_inputs -= job.left
        job.left = 0
        self._pending = [(j, i) for j, i in self._pending if j is not job]
        self._resolve(job, error)

    def _fail_pending(self, error: BaseException) -> None:
        for job in list({id(j): j for j, _ in self._pending}.values()):
            self._fail(job, error)
