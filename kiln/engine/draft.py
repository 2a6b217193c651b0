"""Speculative decoding with a draft model (--speculative-model): a smaller model with the same
tokenizer proposes K tokens per running row; the target verifies them in one forward
(engine/spec.py's verify, the same path as n-gram drafts).

    the draft model    its own ModelRunner (weights, KV pool, kernels) in the same process,
                       and its own KVCacheManager over that pool (no prefix cache)
    shadow requests    one `Request` per drafting row, holding the draft's block table and how
                       far its KV reaches; its tokens are the target's, then the drafts
    prefix cache       the draft's own (a new row takes the blocks of a prompt it has seen);
                       blocks are published right after catch-up, when they hold target tokens
                       only
    head               with --speculative-draft-vocab N, the first N token ids only (BPE ids
                       follow merge order, roughly frequency: Qwen2.5's first 64k cover ~98% of
                       code and English tokens); a token past N is never drafted, and the
                       target, which scores every id, rejects the draft there
    propose            1) catch up: the shadow's KV is kept for the longest prefix it shares
                       with the target's tokens (accepted drafts stay, rejected ones are trimmed
                       away, KVCacheManager.trim); the tokens after it (usually 1-2: the last
                       accepted draft and the token the target added; the whole prompt for a
                       new row) are computed as a chunk, whose last row samples draft 1;
                       2) K - 1 batched one-token decode steps over every drafting row,
                       except a greedy row whose prompt-lookup run (--speculative-prompt-lookup,
                       spec.py's ngram_propose) starts with draft 1: that run is its drafts
    draft sampling     greedy rows: the draft's argmax. Sampled rows: a draw from q, the draft's
                       distribution under the row's own temperature / top-k / top-p / min-p;
                       q is kept (Request.spec_draft_probs) for the target's rejection sampling
                       (accept min(1, p/q), else draw from norm(max(p - q, 0))), which makes the
                       output distributed as the target's whatever q is

The draft pool holds at most as many tokens as the target's plus K per row: every draft token
is a target token or a draft about to be verified. A row whose draft blocks run out drafts
nothing that step (and gives its shadow's blocks back): speculation is an optimisation, never
a reason to stall the target.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kiln.engine.kv_cache import KVCacheManager
from kiln.engine.model_runner import ModelRunner
from kiln.engine.request import Request
from kiln.engine.sampler import Sampler, greedy_tokens
from kiln.engine.scheduler import ScheduledRequest
from kiln.errors import ConfigError, ModelLoadError
from kiln.models.loader import open_checkpoint
from kiln.sampling_params import SamplingParams
from kiln.settings.engine_config import EngineConfig

log = logging.getLogger("kiln.draft")

# Shadow requests never sample through a Sampler nor score prompts: plain params.
_SHADOW_PARAMS = SamplingParams(max_tokens=1)


def check_same_vocab(target: str, target_gguf: str | None, draft: str,
                     target_tokenizer=None) -> None:
    """The draft's tokenizer must have the target's vocabulary (token -> id), or its token ids
    mean other text. Raises a one-line ConfigError naming the first difference."""
    from kiln.tokenizer import load_tokenizer

    def vocab_of(path: str, gguf: str | None, tok=None) -> dict[str, int] | None:
        try:
            tok = tok or load_tokenizer(Path(path), Path(gguf) if gguf else None)
        except ModelLoadError:
            return None
        return tok.hf.get_vocab()

    a = vocab_of(target, target_gguf, target_tokenizer)
    b = vocab_of(draft, None)
    if a is None or b is None:
        # No tokenizer to compare (a bare test model): the model configs' vocabularies must
        # at least have the same size.
        va = open_checkpoint(target, target_gguf).config.vocab_size
        vb = open_checkpoint(draft).config.vocab_size
        if va == vb:
            log.warning("no tokenizer to compare the draft model's vocabulary with; both have "
                        "%d tokens", va)
            return
        a, b = {str(i): i for i in range(va)}, {str(i): i for i in range(vb)}
    if a == b:
        return
    by_id_a = {i: t for t, i in a.items()}
    by_id_b = {i: t for t, i in b.items()}
    first = next((i for i in sorted(set(by_id_a) | set(by_id_b))
                  if by_id_a.get(i) != by_id_b.get(i)), None)
    raise ConfigError(
        f"the draft model {draft} does not share the vocabulary of {target} ({len(b)} vs "
        f"{len(a)} tokens; first difference at id {first}: {by_id_b.get(first)!r} vs "
        f"{by_id_a.get(first)!r})",
        hint="a draft model must use the served model's tokenizer (a smaller model of the "
        "same family)", code="spec.draft_vocab_mismatch")


class DraftModel:
    def __init__(self, config: EngineConfig, target_blocks: int, max_model_len: int,
                 sampler: Sampler, runner: ModelRunner | None = None) -> None:
        """`target_blocks` / `max_model_len`: the target's pool and context, which size the
        draft's. `sampler`: the target's (its generators draw the drafts of sampled rows, so
        a seeded request stays reproducible). `runner`: an already loaded draft runner (tests
        reuse one)."""
        from kiln.engine.spec import AUTO_MAX_K

        path = config.speculative.model
        assert path is not None
        if runner is None:
            ckpt = open_checkpoint(path)
            bs = config.cache.block_size
            k = config.speculative.num_tokens
            slack = config.scheduler.max_num_seqs * (
                -(-max(AUTO_MAX_K, k if isinstance(k, int) else 0) // bs) + 1)
            # the target's settings but for what only the target does: its adapters, its
            # drafting, its traces and faults, its expert split
            dcfg = config.replace(
                model=path, gguf_file=None,
                max_model_len=min(max_model_len, ckpt.config.context_length),
                max_model_len_explicit=False, kv_max_blocks=target_blocks + slack,
                lora_modules=(), speculative_model=None, speculative_method=None,
                num_speculative_tokens=None, cpu_offload_experts=False, profile_jsonl=None,
                scheduler_trace_jsonl=None, diagnostic_faults=())
            runner = ModelRunner(dcfg, ckpt)
        self.runner = runner
        self.vocab = self._cut_head(config.speculative.draft_vocab)
        self.sampler = sampler
        self.max_model_len = runner.max_model_len
        # A prefix cache of its own, as the target has: a prompt the target finds cached (a
        # chat's earlier turns, a shared system prompt) is not prefilled again by the draft
        # either. Only blocks of target tokens are published (after catch-up), never drafts.
        self.kv = KVCacheManager(runner.plan.num_blocks, runner.block_size,
                                 enable_prefix_caching=True)
        self.max_batched_tokens = runner.config.scheduler.max_num_batched_tokens
        self.shadows: dict[str, Request] = {}
        # How many of a shadow's tokens were the target's at the last propose (the rest were
        # drafts): only those after it can differ from the target's now.
        self._synced: dict[str, int] = {}
        self.steps = 0  # draft forwards, for the benchmark
        self.last_tokens = 0  # tokens computed by the last propose call (spec.py's auto K)
        self.last_hinted: set[str] = set()  # rows whose drafts were their lookup run

    def _cut_head(self, n: int) -> int | None:
        """--speculative-draft-vocab: the draft's head scores token ids 0..n-1 only (its
        logits are padded with -inf to the target's width in `_run`, so a draft is always one
        of them). Returns n, or None where the head stays whole (n = 0, n at least the
        vocabulary, or a head layout that cannot be cut there)."""
        from kiln.layers.quant.apply import head_rows

        model = self.runner.model
        head = getattr(model, "lm_head", None)
        vocab = model.config.vocab_size
        if not n or head is None or n >= vocab:
            return None
        cut = head_rows(head, n)
        if cut is None:
            log.info("draft model: head kept whole (%s cannot be cut at %d rows)",
                     type(head).__name__, n)
            return None
        model.lm_head = cut
        log.info("draft model: head scores the first %d of %d token ids", n, vocab)
        return n

    def forget(self, request_id: str) -> None:
        sh = self.shadows.pop(request_id, None)
        self._synced.pop(request_id, None)
        if sh is not None:
            self.kv.free(sh)

    @torch.inference_mode()
    def propose(self, rows: list[tuple[Request, int, list[int]]], live: set[str]) -> None:
        """Drafts for `rows` (target request, at most k drafts, its prompt-lookup run or [])
        into their spec_token_ids and spec_draft_probs. Shadows of requests not in `live`
        (finished, preempted) go."""
        for rid in [r for r in self.shadows if r not in live]:
            self.forget(rid)
        self.last_tokens = 0
        self.last_hinted = set()
        todo: list[tuple[Request, Request, int]] = []
        hints: dict[str, list[int]] = {}
        for req, k, hint in rows:
            k = min(k, self.max_model_len - req.num_tokens)
            if k <= 0:
                continue
            todo.append((req, self._sync(req), k))
            if hint:
                hints[req.request_id] = hint[:self.max_model_len - req.num_tokens]
        if not todo:
            return
        sampler = self.sampler
        drafts: dict[str, list[int]] = {req.request_id: [] for req, _, _ in todo}
        probs: dict[str, list[torch.Tensor]] = {req.request_id: [] for req, _, _ in todo}
        by_shadow = {id(sh): (req, k) for req, sh, k in todo}

        # 1) catch up (chunks within the token budget), sampling draft 1 at each row's end
        pending = [sh for _, sh, _ in todo]
        while pending:
            batch: list[ScheduledRequest] = []
            rest: list[Request] = []
            left = self.max_batched_tokens
            for sh in pending:
                need = sh.num_tokens - sh.num_computed_tokens
                n = min(need, left)
                if n <= 0:
                    rest.append(sh)
                    continue
                if not self.kv.allocate(sh, n):
                    self._drop(sh, by_shadow, drafts)
                    continue
                batch.append(ScheduledRequest(sh, n, n == need))
                left -= n
                if n < need:
                    rest.append(sh)
            if batch:
                self._run(batch, sampler, by_shadow, drafts, probs)
                for s in batch:  # computed so far: target tokens only
                    self.kv.cache_full_blocks(s.request)
            pending = [sh for sh in rest if sh.request_id in self.shadows]
            if not batch and pending:
                break  # nothing fits at all this step (cannot happen with a budget > 0)

        # A lookup run whose first token is the draft's own is taken whole (greedy rows only:
        # a sampled draft's q would not describe the run): no more draft steps for that row.
        # The shadow computed only its first token; the next catch-up computes the accepted
        # rest as one chunk.
        for rid, hint in hints.items():
            got = drafts.get(rid)
            if got and got[0] == hint[0]:
                drafts[rid] = list(hint)
                self.last_hinted.add(rid)

        # 2) one-token steps until every row has its k drafts
        while True:
            batch = []
            for req, sh, k in todo:
                got = drafts.get(req.request_id)
                if (got is None or not got or len(got) >= k or req.request_id not in self.shadows
                        or req.request_id in self.last_hinted):
                    continue
                if not self.kv.allocate(sh, 1):
                    continue  # out of draft blocks: this row keeps the drafts it has
                batch.append(ScheduledRequest(sh, 1, True))
            if not batch:
                break
            self._run(batch, sampler, by_shadow, drafts, probs)

        for req, _, _ in todo:
            d = drafts.get(req.request_id) or []
            req.spec_token_ids = d
            q = probs.get(req.request_id)
            req.spec_draft_probs = torch.stack(q) if q and len(q) == len(d) else None

    def _sync(self, req: Request) -> Request:
        """The row's shadow, its KV cut back to the longest prefix it shares with the target's
        tokens (never the last one: its logits are what draft 1 is sampled from)."""
        rid = req.request_id
        tokens = req.all_token_ids
        sh = self.shadows.get(rid)
        if sh is None:
            sh = Request(rid, list(tokens), _SHADOW_PARAMS)
            self.shadows[rid] = sh
            hits = self.kv.find_cached_prefix(sh)
            if hits and self.kv.allocate(sh, 0, cached_prefix=hits):
                sh.num_computed_tokens = len(hits) * self.kv.block_size
        else:
            old = sh.all_token_ids
            valid = self._synced.get(rid, 0)
            limit = min(sh.num_computed_tokens, len(tokens) - 1)
            valid = min(valid, limit)
            while valid < limit and old[valid] == tokens[valid]:
                valid += 1
            sh.num_computed_tokens = valid
            self.kv.trim(sh, valid)
            sh.prompt_token_ids = list(tokens)
            sh.output_token_ids = []
            # hashes of blocks past the kept prefix were of tokens that may have changed
            del sh.block_hashes[valid // self.kv.block_size:]
        self._synced[rid] = len(tokens)
        return sh

    def _drop(self, sh: Request, by_shadow: dict, drafts: dict) -> None:
        """Out of draft blocks: the row drafts nothing this step and its shadow goes."""
        req, _ = by_shadow[id(sh)]
        drafts.pop(req.request_id, None)
        self.forget(sh.request_id)

    def _run(self, batch: list[ScheduledRequest], sampler: Sampler, by_shadow: dict,
             drafts: dict[str, list[int]], probs: dict[str, list[torch.Tensor]]) -> None:
        """One draft forward; each sampling row draws its next draft (and keeps q when its
        target request samples)."""
        logits, reqs, _ = self.runner.execute(batch, logits_only=True)  # type: ignore[misc]
        self.steps += 1
        self.last_tokens += sum(s.num_new_tokens for s in batch)
        for s in batch:
            s.request.num_computed_tokens += s.num_new_tokens
        if logits is None:
            return
        V = sampler.vocab_size
        logits = logits[:, :V].float()
        if logits.shape[1] < V:  # a draft vocabulary smaller than the target's padding
            logits = torch.nn.functional.pad(logits, (0, V - logits.shape[1]),
                                             value=float("-inf"))
        targets = [by_shadow[id(sh)][0] for sh in reqs]
        params = [t.params for t in targets]
        tokens = greedy_tokens(logits)
        sampled_rows = [i for i, p in enumerate(params) if p.temperature != 0.0]
        q = None
        if sampled_rows:
            idx = torch.tensor(sampled_rows, device=logits.device)
            q = Sampler.probs(logits[idx], [params[i] for i in sampled_rows])
            drawn = [torch.multinomial(q[j], 1, generator=sampler._generator_for(targets[i])
                                       if params[i].seed is not None else sampler.generator)
                     for j, i in enumerate(sampled_rows)]
            tokens[idx] = torch.cat(drawn)
        got = tokens.tolist()
        row_of = {i: j for j, i in enumerate(sampled_rows)}
        for i, (sh, t) in enumerate(zip(reqs, got)):
            rid = targets[i].request_id
            if rid not in drafts:
                continue
            drafts[rid].append(t)
            sh.output_token_ids.append(t)
            if q is not None and i in row_of:
                probs[rid].append(q[row_of[i]])
