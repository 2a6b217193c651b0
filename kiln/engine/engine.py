"""Engine: `step()` = schedule -> run the model -> update requests -> outputs. Synchronous.

The async server wraps it in `AsyncEngine` (engine/async_engine.py); the offline `kiln.LLM` and
`kiln run` drive it directly. All of them see the same `RequestOutput`s, made by the one output
processor (engine/output.py): text, stop strings, EOS and logprobs are decided there, once, and
a request's `n` choices run as sequences it fans out and gathers back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.engine.draft import DraftModel, check_same_vocab
from kiln.engine.kv_cache import HashFn, KVCacheManager, default_block_hash
from kiln.engine.lora import LoRAError, LoRAManager, LoRANotFoundError
from kiln.engine.model_runner import ModelRunner, PromptLogprobs, Sampled, SampledLogprobs
from kiln.engine.output import OutputProcessor, ParentRequest, RequestOutput
from kiln.engine.request import Request, RequestStatus
from kiln.engine.scheduler import Scheduler, SchedulerOutput
from kiln.engine.spec import Speculator, spec_config
from kiln.engine.structured import StructuredOutputs
from kiln.errors import KilnError
from kiln.layers.kernels.threads import ThreadGovernor
from kiln.layers.moe import experts_of, reset_routing_counts, routing_counts
from kiln.models.loader import Checkpoint, ProgressFn, open_checkpoint
from kiln.obs.faults import Faults
from kiln.obs.trace import JsonlWriter, SchedulerTracer, StepProfiler
from kiln.sampling_params import SamplingParams
from kiln.settings.engine_config import EngineConfig
from kiln.tokenizer import Tokenizer

__all__ = ["Engine", "EngineStats", "PromptTooLongError", "RequestOutput", "StepFailedError"]

log = logging.getLogger("kiln.engine")


class PromptTooLongError(KilnError):
    def __init__(self, prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
        asked = prompt_len + (max_tokens or 0)
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {asked} tokens ({prompt_len} in the messages, {max_tokens or 0} in the "
            f"completion). Please reduce the length of the messages or completion.",
            code="context_length_exceeded")
        self.prompt_len, self.max_model_len = prompt_len, max_model_len


class StepFailedError(KilnError):
    """The model step raised; `request_ids` had sequences in it and are aborted, every choice
    (their blocks freed). Other requests and the engine go on."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"the model step failed: {type(cause).__name__}: {cause}")
        self.request_ids = request_ids
        self.cause = cause


@dataclass
class EngineStats:
    """The engine's running totals since start (the /metrics counters read them)."""
    steps: int = 0
    step_seconds: float = 0.0
    tokens_computed: int = 0
    requests_finished: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class Engine:
    def __init__(self, config: EngineConfig, ckpt: Checkpoint | None = None,
                 progress: ProgressFn | None = None, runner: ModelRunner | None = None, *,
                 tokenizer: Tokenizer | None = None, kv_hash_fn: HashFn | None = None,
                 trace_meta: dict[str, Any] | None = None,
                 draft_runner: ModelRunner | None = None) -> None:
        """`tokenizer` turns tokens into text and enables stop strings (the front-ends pass it;
        tests that drive token ids need none). `runner` reuses an already loaded model and KV
        pool (tests build several engines with different scheduler limits over one model);
        `config.cache.kv_max_blocks` may then use fewer blocks of that pool. `kv_hash_fn` replaces the prefix-cache block hash (tests force
        collisions with it). `draft_runner`: an already loaded draft model for
        --speculative-model (tests reuse one, as they reuse `runner`)."""
        self.config = config
        # Speculative decoding (engine/spec.py): refused settings and a draft model whose
        # vocabulary is not the target's fail here, before any weights load.
        spec = spec_config(config)
        if spec is not None and spec.method == "draft" and draft_runner is None:
            assert spec.model is not None
            check_same_vocab(config.model, config.gguf_file, spec.model, tokenizer)
        self.ckpt = runner.ckpt if runner else (ckpt or open_checkpoint(config.model,
                                                                        config.gguf_file))
        calibration = None
        if runner is None and config.experts.cpu_offload and tokenizer is not None:
            from kiln.engine.expert_placement import calibration_token_ids

            calibration = calibration_token_ids(tokenizer)
        self.runner = runner or ModelRunner(config, self.ckpt, progress=progress,
                                            calibration_ids=calibration)
        num_blocks = min(self.runner.plan.num_blocks, config.cache.kv_max_blocks or 1 << 62)
        # A sequence must fit the pool on its own, or preemption could never make room for it
        # (the runner's plan caps its own pool; a smaller kv_max_blocks over it caps it here).
        self.max_model_len = min(self.runner.max_model_len,
                                 config.max_model_len or self.runner.max_model_len,
                                 num_blocks * self.runner.block_size)
        sessions = config.cache.session_cache != "off"
        if sessions and not config.cache.enable_prefix_caching:
            log.warning("--session-cache needs prefix caching, which is off: sessions are not "
                        "kept")
        self.kv = KVCacheManager(num_blocks, self.runner.block_size,
                                 enable_prefix_caching=config.cache.enable_prefix_caching,
                                 hash_fn=kv_hash_fn or default_block_hash,
                                 session_max_entries=(config.cache.session_cache_max_entries
                                                      if sessions else 0),
                                 session_max_tokens=config.cache.session_cache_max_tokens)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        # Every id that ends generation: the model's (config / generation_config / GGUF) and
        # the tokenizer's (e.g. ChatML's <|im_end|>), merged here once for every front-end.
        self.eos_token_ids = frozenset(self.ckpt.config.eos_token_ids) | frozenset(
            tokenizer.eos_token_ids if tokenizer is not None else ())
        self.output = OutputProcessor(tokenizer)
        # Structured output's grammars (compiled on demand; the server shares this object to
        # validate a request's constraint before admitting it). None without a tokenizer.
        self.structured: StructuredOutputs | None = (
            StructuredOutputs(tokenizer, self.ckpt.config.vocab_size)
            if tokenizer is not None else None)
        self.stats = EngineStats()
        # LoRA adapters (kiln/engine/lora.py), kept with the runner's model: engines that share
        # a runner (tests) share its adapters. None: no adapter loaded yet.
        self.lora: LoRAManager | None = None
        for item in config.lora.modules:
            name, path = item.split("=", 1)
            if self.runner.lora is not None and name in self.runner.lora.adapters:
                self.lora = self.runner.lora
            else:
                self.load_lora(name, path)
        # Speculative decoding (engine/spec.py): None when off. A draft model (engine/draft.py)
        # gets its own runner and KV pool, sized from the target's.
        self.drafter: DraftModel | None = None
        if spec is not None and spec.method == "draft":
            self.drafter = DraftModel(config, num_blocks, self.max_model_len,
                                      self.runner.sampler, runner=draft_runner)
        self.spec: Speculator | None = (Speculator(spec, self.max_model_len, self.drafter)
                                        if spec is not None else None)
        # MoE routing counters ([] for a dense model), zeroed here: the runner's memory profile
        # ran a dummy prefill through the router, and a reused runner counted earlier engines.
        self._experts = experts_of(self.runner.model)
        reset_routing_counts(self._experts)
        self.moe_layers: list[int] = [m.layer for m in self._experts]
        # Fewer compute threads while other processes hold some of our CPUs (kiln/layers/
        # kernels/threads.py); consulted at the start of each step, on the thread that steps
        # (OpenMP's count is that thread's own). None: off, or not on the CPU.
        self.threads: ThreadGovernor | None = None
        self._cpu_threads = self.runner.num_threads
        if config.adaptive_threads and self._cpu_threads:
            self.threads = ThreadGovernor(self._cpu_threads)
        # Traces and faults (kiln/obs/): None when off, and the step only tests for None.
        self.profiler: StepProfiler | None = None
        self.sched_trace: SchedulerTracer | None = None
        diag = config.diagnostics
        self.faults = Faults.of(diag.faults)
        if diag.profile_jsonl:
            sync = torch.cuda.synchronize if self.runner.device.type == "cuda" else None
            self.profiler = StepProfiler(
                JsonlWriter(diag.profile_jsonl), sample_rate=diag.profile_sample_rate,
                detail=diag.profile_detail, sync=sync,
                meta={"detail": diag.profile_detail, "sample_rate": diag.profile_sample_rate,
                      "device": str(self.runner.device), **(trace_meta or {})})
            if diag.profile_detail == "layers":
                self.profiler.attach_layer_hooks(self.runner.model.model.layers)
        if diag.scheduler_trace_jsonl:
            self.sched_trace = SchedulerTracer(JsonlWriter(diag.scheduler_trace_jsonl))
        if self.faults is not None and self.faults.kv_alloc is not None:
            self.kv.allocate = self.faults.wrap_allocate(self.kv.allocate)  # type: ignore

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, *, cache_salt: str | None = None,
                    session_id: str | None = None, group: str | None = None) -> None:
        """Admits a request: one sequence per choice (`params.n`; see engine/output.py), all or
        none. `session_id` names the conversation (the OpenAI `user` field or X-Session-Id):
        with the session cache on, this turn's prefix stays pinned for the next one. `group`:
        the API request it is part of (see Scheduler's fairness; default: its own choices)."""
        if not prompt_token_ids:
            raise KilnError("the prompt is empty: send at least one token")
        n = len(prompt_token_ids)
        if n >= self.max_model_len or (params.max_tokens is not None
                                       and n + params.max_tokens > self.max_model_len):
            raise PromptTooLongError(n, params.max_tokens, self.max_model_len)
        vocab = self.ckpt.config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise KilnError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        parent = ParentRequest(request_id, list(prompt_token_ids), params, group)
        children = parent.children()
        if self.output.has(request_id) or any(c in self.scheduler.requests for c, _ in children):
            raise KilnError(f"request id {request_id!r} is already in use")
        lora_id = 0
        if params.lora is not None:
            if self.lora is None:
                raise LoRANotFoundError(f"LoRA adapter {params.lora!r} is not loaded (loaded: none)",
                                hint="load it with --lora NAME=PATH")
            lora_id = self.lora.id_of(params.lora)
        if params.structured_outputs is not None and self.structured is None:
            raise KilnError("structured output needs a tokenizer, and this engine was built "
                            "without one", hint="build the engine with its tokenizer")
        limit = self.max_model_len - n
        reqs = []
        for cid, cparams in children:
            # An invalid constraint raises StructuredOutputError (a 400 naming the field); each
            # choice walks its own matcher.
            grammar = (self.structured.matcher(cparams.structured_outputs)
                       if self.structured is not None and cparams.structured_outputs is not None
                       else None)
            req = Request(cid, list(prompt_token_ids), cparams, eos_token_ids=self.eos_token_ids,
                          cache_salt=cache_salt, session_id=session_id or None,
                          group=parent.group, grammar=grammar, lora_id=lora_id)
            req.max_tokens = min(params.max_tokens or limit, limit)
            reqs.append(req)
        self.output.add(parent, reqs)
        for req in reqs:
            self.scheduler.add_request(req)

    def load_lora(self, name: str, path: str) -> None:
        """Loads a PEFT adapter under `name` (/v1/load_lora_adapter); new requests may ask for
        it at once."""
        if self.lora is None:  # the first adapter: the runner's model gets the manager
            self.lora = self.runner.lora or LoRAManager(
                self.runner.model, self.runner.dtype, self.runner.device,
                max_loras=self.config.lora.max_loras, max_rank=self.config.lora.max_rank)
            self.runner.lora = self.lora
        self.lora.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Drops adapter `name`; refused while requests of it are unfinished (their next steps
        need its weights)."""
        if self.lora is None:
            raise LoRANotFoundError(f"LoRA adapter {name!r} is not loaded (loaded: none)")
        aid = self.lora.id_of(name)
        busy = sum(1 for r in self.scheduler.requests.values() if r.lora_id == aid)
        if busy:
            raise LoRAError(f"LoRA adapter {name!r} is in use by {busy} unfinished request(s)",
                            hint="unload it when they finish")
        self.lora.unload(name)

    def abort(self, request_id: str) -> bool:
        """Ends every running choice of the request; their outputs (finish_reason "abort")
        come with the next step."""
        aborted = False
        for sid in self.output.sequences(request_id):
            req = self.scheduler.abort(sid)
            if req is None:
                continue
            aborted = True
            self.runner.sampler.forget(sid)
            if self.drafter is not None:
                self.drafter.forget(sid)  # its draft KV goes back now, not at the next step
            self.output.process(req)
        return aborted

    @property
    def outputs_pending(self) -> bool:
        """An abort's outputs wait for the next `step` to hand them out."""
        return self.output.has_pending

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        if self.threads is not None:
            self.threads.poll()  # between steps only: no region changes size mid-step
        prof = self.profiler
        if prof is not None and prof.want():
            return self._profiled_step(prof)
        sched = self.scheduler.schedule()
        if sched.empty:
            return self.output.take()
        if self.sched_trace is not None:
            self._trace_schedule(sched)
        t0 = time.perf_counter()
        sampled, logprobs, prompt_lps = self._execute(sched)
        t_exec = time.perf_counter() - t0
        touched = self.scheduler.update(sched, sampled, logprobs, prompt_lps)
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - t0
        if self.spec is not None and len(sched.scheduled) == 1:  # the auto K's cost line
            self.spec.observe_step(len(sched.scheduled[0].spec_token_ids), t_exec)
        self.stats.tokens_computed += sched.num_tokens
        return self._process(touched)

    def _execute(self, sched: SchedulerOutput, marks: dict[str, float] | None = None
                 ) -> tuple[Sampled, SampledLogprobs, PromptLogprobs]:
        """The model step. If it raises, the step's requests cannot go on (their KV is not
        what their counters say): they are aborted, their blocks freed, and `StepFailedError`
        names them, so the front-end fails just those and keeps serving."""
        try:
            if self.faults is not None:
                self.faults.before_step(self.stats.steps)
            result = self.runner.execute(sched.scheduled, marks)
        except Exception as e:
            # A request fails whole: its choices outside this step stop too.
            ids = list(dict.fromkeys(self.output.parent_of(s.request.request_id) or
                                     s.request.request_id for s in sched.scheduled))
            for rid in ids:
                for sid in self.output.sequences(rid):
                    if self.scheduler.abort(sid) is not None:
                        self.runner.sampler.forget(sid)
                self.output.drop(rid)
            log.error("model step failed; failing its %d request(s): %s: %s", len(ids),
                      type(e).__name__, e)
            raise StepFailedError(ids, e) from e
        if self.spec is not None:
            for s in sched.scheduled:
                if s.spec_token_ids and s.request.request_id in result[0]:
                    got = result[0][s.request.request_id]
                    self.spec.record(len(s.spec_token_ids),
                                     len(got) - 1 if isinstance(got, list) else 0,
                                     s.request.request_id in self.spec.hinted)
        return result

    def _process(self, touched: list[Request]) -> list[RequestOutput]:
        for req in touched:
            stop_string = self.output.process(req)
            if stop_string and not req.is_finished:
                # Finished in this step, so its blocks go back before the next one is planned.
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            if req.is_finished:
                self.runner.sampler.forget(req.request_id)
                self.stats.requests_finished += 1
        if self.spec is not None:  # drafts for the next step, after this one's stops
            self.spec.propose(self.scheduler.running)
        return self.output.take()

    def _profiled_step(self, prof: StepProfiler) -> list[RequestOutput]:
        """`step` with the clock read between phases (a sampled step of --profile-jsonl)."""
        clock = time.perf_counter
        t0 = clock()
        sched = self.scheduler.schedule()
        if sched.empty:
            return self.output.take()
        kinds = self._trace_schedule(sched)
        marks: dict[str, float] = {"schedule": clock() - t0}
        t1 = clock()
        sampled, logprobs, prompt_lps = self._execute(sched, marks)
        t2 = clock()
        touched = self.scheduler.update(sched, sampled, logprobs, prompt_lps)
        self.stats.steps += 1
        self.stats.step_seconds += clock() - t1
        self.stats.tokens_computed += sched.num_tokens
        outputs = self._process(touched)
        marks["detokenize"] = clock() - t2  # the tokens appended, stops checked, text made
        prof.record(self.stats.steps, marks, len(sched.scheduled), sched.num_tokens, *kinds)
        return outputs

    def _trace_schedule(self, sched: SchedulerOutput) -> tuple[int, int]:
        """Tokens scheduled as prefill and as decode (a decode computes a token after the
        prompt); writes the scheduler trace's line when it is on."""
        decode = sum(s.num_new_tokens for s in sched.scheduled
                     if s.request.num_computed_tokens >= s.request.num_prompt_tokens)
        prefill = sched.num_tokens - decode
        if self.sched_trace is not None:
            self.sched_trace.record(
                self.stats.steps + 1, running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting), prefill_tokens=prefill,
                decode_tokens=decode, preempted=len(sched.preempted),
                prefix_hit_tokens_total=self.kv.stats.hits,
                kv_blocks_free=self.kv.num_free_blocks, kv_blocks_total=self.kv.num_blocks)
        return prefill, decode

    def close_traces(self) -> None:
        """Flushes and closes the traces (shutdown)."""
        for t in (self.profiler, self.sched_trace):
            if t is not None:
                t.close()
        self.profiler = self.sched_trace = None

    def check_idle_integrity(self) -> None:
        """With no request left: every KV block is free or cached (none leaked), and the KV
        manager's own invariants hold. Raises AssertionError otherwise."""
        assert not self.scheduler.has_work, "requests are still running"
        self.kv.check_integrity([])
        pinned = self.kv.sessions.num_pinned_blocks if self.kv.sessions is not None else 0
        assert self.kv.num_free_blocks + pinned == self.kv.num_blocks, (
            f"{self.kv.num_blocks - self.kv.num_free_blocks - pinned} KV block(s) leaked")
        if self.drafter is not None:
            d = self.drafter.kv
            d.check_integrity(list(self.drafter.shadows.values()))
            assert not self.drafter.shadows and d.num_free_blocks == d.num_blocks, (
                f"{d.num_blocks - d.num_free_blocks} draft KV block(s) leaked")

    def kv_report(self) -> dict[str, Any]:
        """The KV cache's blocks and its integrity check (GET /debug/kv), between steps: the
        manager's invariants with every request's holdings; idle, `leaked_blocks` counts the
        blocks neither free (or cached) nor pinned by a session, which must be 0."""
        kv = self.kv
        pinned = kv.sessions.num_pinned_blocks if kv.sessions is not None else 0
        try:
            kv.check_integrity(self.scheduler.all_requests())
            integrity = "ok"
        except AssertionError as e:
            integrity = f"broken: {e}"
        idle = not self.scheduler.has_work
        used = kv.num_blocks - kv.num_free_blocks
        return {"idle": idle, "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting), "blocks_total": kv.num_blocks,
                "blocks_free": kv.num_free_blocks, "blocks_used": used,
                "blocks_pinned": pinned, "blocks_cached": len(kv.cached),
                "integrity": integrity, "leaked_blocks": used - pinned if idle else None}

    # ------------------------------------------------------------------ observability

    def metrics(self) -> dict[str, float]:
        kv = self.kv
        sessions = kv.sessions
        sched = self.scheduler.stats
        structured = (self.structured.stats() if self.structured is not None else
                      {"structured_rows": 0, "structured_seconds": 0.0,
                       "structured_compiles": 0})
        return {
            **structured,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": kv.num_blocks,
            "kv_blocks_free": kv.num_free_blocks,
            "kv_usage": kv.usage,
            "prefix_cache_queries_tokens": kv.stats.queries,
            "prefix_cache_hits_tokens": kv.stats.hits,
            "num_preemptions": self.scheduler.stats.num_preemptions,
            "prefill_tokens": self.scheduler.stats.num_prefill_tokens,
            "generated_tokens": self.scheduler.stats.num_generated_tokens,
            "steps": self.stats.steps,
            "step_seconds": self.stats.step_seconds,
            "prefix_rendezvous_waits": sched.num_rendezvous_waits,
            "prefix_rendezvous_timeouts": sched.num_rendezvous_timeouts,
            "session_cache_entries": len(sessions) if sessions else 0,
            "session_cache_pinned_blocks": sessions.num_pinned_blocks if sessions else 0,
            "session_cache_released": sessions.stats.released if sessions is not None else 0,
            **self._threads_metrics(),
            **self.spec_metrics(),
        }

    def _threads_metrics(self) -> dict[str, float]:
        """The compute threads in use now (CPU engines only): the governor's count, else the
        one the runner set."""
        if self.threads is not None:
            return {"cpu_threads_active": self.threads.active}
        return {"cpu_threads_active": self._cpu_threads} if self._cpu_threads else {}

    def spec_metrics(self) -> dict[str, float]:
        """Speculative decoding's counters ({} when it is off) and the K in use."""
        if self.spec is None:
            return {}
        st = self.spec.stats
        return {"spec_num_drafts": st.num_drafts, "spec_num_draft_tokens": st.num_draft_tokens,
                "spec_num_accepted_tokens": st.num_accepted_tokens,
                "spec_num_speculative_tokens": self.spec.k}

    def routing_counts(self) -> torch.Tensor | None:
        """Tokens routed to each expert since this engine started, [len(moe_layers), E] int64
        (a copy); None for a dense model."""
        return routing_counts(self._experts) if self._experts else None

    def routing_stats(self) -> dict[int, list[int]]:
        """{MoE layer index: tokens routed to each expert} ({} for a dense model): what
        /metrics and `kiln bench --offline` report."""
        counts = self.routing_counts()
        return {} if counts is None else dict(zip(self.moe_layers, counts.tolist()))
