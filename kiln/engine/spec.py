"""Speculative decoding: drafting and verification, inside the scheduler's one rule.

    after a step     Speculator.propose: each running request that is decoding gets up to K
                     draft tokens in `Request.spec_token_ids` (n-gram lookup in its own tokens)
    next schedule    the drafts are just more tokens the request lacks: 1 + k tokens, computed
                     in one forward pass as a short chunk over the request's KV
    the runner       logits for the k + 1 rows: row j predicts the token after draft j - 1
    verify           accept the drafts the target agrees with (greedy: the argmax; sampled:
                     rejection sampling), then one token from the first row not accepted (or
                     the bonus row after all k) -> 1 .. k + 1 new tokens for that request
    Scheduler.update rejected drafts roll back `num_computed_tokens`, and the KV blocks only
                     they reached go back to the pool (KVCacheManager.trim)

Exactness. Greedy: every emitted token is the target's argmax given the tokens before it, so
the output is the same as without speculation (up to the float differences of a batched step).
Sampled: the draft distribution of an n-gram proposer is a point mass on the draft token d, so
standard rejection sampling (Leviathan et al. 2023) reduces to: accept d with probability p(d);
otherwise draw from p with d removed, renormalised. The emitted token is then distributed as p
exactly; after all k drafts are accepted, the bonus token is drawn from p of the last row.
p is the distribution the sampler would draw from (temperature, top-k, top-p, min-p applied).

Which rows draft: those whose next-token distribution does not depend on the tokens sampled in
the same step, so one step can score all k + 1 positions: no structured-output grammar (its
mask follows every token; a constrained row gets no drafts), no repetition / presence /
frequency penalty, and min_tokens already reached. Other rows decode one token as before.

K: fixed (--num-speculative-tokens K), or `auto`: K follows the acceptance and the cost measured
so far. Drafts of one step are accepted in a run that ends at the first rejection, so the
per-token acceptance rate a is estimated as accepted / (accepted + rejections) (the geometric
model's estimate, which does not count the drafts after a rejection), from decayed counts
(half-life ~AUTO_HALF_LIFE drafts). A step with K drafts then yields (1 - a^(K+1)) / (1 - a)
tokens on average. What it costs is measured: the seconds of each single-stream drafted step
(the target's verify of K + 1 rows plus the drafting that preceded it) are fit as c0 + c1 K by
decayed least squares, and K is the one of 1..AUTO_MAX_K with the most tokens per second. On a
CPU a verify row costs compute (it is not free as on a GPU), so the best K is small where a long
run of accepted drafts alone would ask for a large one: measured on 2 cores, Qwen2.5-Coder 0.5B
drafting for 1.5B, K = 2 1.15x, 3 1.13x, 4 1.08x, the run-length rule's ~6 0.96x. To keep the fit
informed K is dithered: one step in AUTO_DITHER tries K + 1, another K - 1. Until the fit has
two distinct K, K is the expected run of accepted drafts, a / (1 - a), rounded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kiln.engine.request import Request, TokenLogprob
from kiln.engine.sampler import Sampler, _top_logprobs, greedy_tokens
from kiln.errors import ConfigError
from kiln.settings.engine_config import EngineConfig

AUTO_START_K = 4
AUTO_MAX_K = 8
AUTO_HALF_LIFE = 64  # drafts
AUTO_COST_HALF_LIFE = 32  # measured steps
AUTO_DITHER = 8  # steps per dither cycle (one at K + 1, one at K - 1)


class CostFit:
    """Seconds of a drafted step as c0 + c1 * K: least squares over decayed sums."""

    def __init__(self, half_life: float = AUTO_COST_HALF_LIFE) -> None:
        self.decay = 0.5 ** (1.0 / half_life)
        self.w = self.x = self.xx = self.y = self.xy = 0.0

    def add(self, k: int, seconds: float) -> None:
        d = self.decay
        self.w = self.w * d + 1.0
        self.x = self.x * d + k
        self.xx = self.xx * d + k * k
        self.y = self.y * d + seconds
        self.xy = self.xy * d + k * seconds

    def line(self) -> tuple[float, float] | None:
        """(c0, c1), or None until two distinct K have been seen."""
        var = self.w * self.xx - self.x * self.x
        if self.w < 4 or var <= 1e-6 * self.w * self.w:
            return None
        c1 = max(0.0, (self.w * self.xy - self.x * self.y) / var)
        c0 = (self.y - c1 * self.x) / self.w
        return (c0, c1) if c0 > 0 else None


def best_k(a: float, cost: tuple[float, float] | None, k_max: int = AUTO_MAX_K) -> int:
    """The K of the most tokens per second: (1 - a^(K+1)) / (1 - a) tokens for c0 + c1 K
    seconds; without a cost line, the expected run of accepted drafts a / (1 - a)."""
    if cost is None:
        run = a / (1.0 - a) if a < 1.0 else float(k_max)
        return max(1, min(k_max, round(run)))

    def rate(k: int) -> float:
        tokens = float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
        return tokens / (cost[0] + cost[1] * k)

    return max(range(1, k_max + 1), key=rate)


@dataclass
class SpecConfig:
    method: str  # "ngram" | "draft" (a draft model: engine/draft.py)
    num_tokens: int | None  # K; None: auto
    ngram_min: int = 2
    ngram_max: int = 5
    model: str | None = None  # the draft model's path (method "draft")
    # no drafts while more requests than this are decoding (None: no limit)
    disable_by_batch_size: int | None = None
    # method "draft": a greedy row's prompt-lookup run of up to this many tokens replaces the
    # draft model's steps when the draft's first token agrees with it (0: never)
    lookup_k: int = 0


@dataclass
class SpecStats:
    """Counters for /metrics (vLLM's spec_decode names) and kiln bench."""

    num_drafts: int = 0  # verification rows that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted at draft position i

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_tokens_per_draft(self) -> float:
        """Tokens a drafted row emits per step (accepted + the one sampled after)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def spec_config(cfg: EngineConfig) -> SpecConfig | None:
    """The engine's speculative decoding from its settings; None when off. What kiln's engine
    cannot do is an error naming the flag, not a silent no-op. A draft model without a method
    is the draft-model method (vLLM's default when --speculative-model is given)."""
    sc = cfg.speculative
    method, k, model = sc.method, sc.num_tokens, sc.model
    if method is None and model is not None:
        method = "draft"
    if sc.draft_vocab and method != "draft":
        raise ConfigError("--speculative-draft-vocab cuts a draft model's head, and no draft "
                          "model is set",
                          hint="add --speculative-model DRAFT, or drop --speculative-draft-vocab",
                          code="spec.draft_vocab_without_draft")
    if method is None:
        if k not in (None, "auto"):
            raise ConfigError("--num-speculative-tokens needs a speculative method",
                              hint="add --speculative-method ngram, or --speculative-model DRAFT",
                              code="spec.tokens_without_method")
        return None
    if method not in ("ngram", "draft"):
        raise ConfigError(f"kiln's engine has no speculative method {method!r}",
                          hint="use --speculative-method ngram or --speculative-model DRAFT, "
                          "or --engine vllm / sglang", code="spec.unknown_method")
    if method == "draft" and model is None:
        raise ConfigError("--speculative-method draft needs a draft model",
                          hint="add --speculative-model DRAFT (a smaller model with the same "
                          "tokenizer)", code="spec.draft_needs_model")
    if method == "ngram" and model is not None:
        raise ConfigError("--speculative-method ngram uses no draft model, and "
                          f"--speculative-model {model} was given",
                          hint="drop one of them", code="spec.ngram_with_model")
    lo, hi = sc.ngram_min, sc.ngram_max
    if lo > hi:
        raise ConfigError(f"--ngram-prompt-lookup-min {lo} is above --ngram-prompt-lookup-max "
                          f"{hi}", hint="give a min no larger than the max",
                          code="spec.ngram_range")
    return SpecConfig(method, None if k in (None, "auto") else int(k), lo, hi, model,
                      sc.disable_by_batch_size,
                      sc.prompt_lookup if method == "draft" else 0)


def ngram_propose(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: the longest suffix of `tokens` (n_max down to n_min tokens) that occurred
    before; the k tokens that followed its latest earlier occurrence. [] when none did."""
    total = len(tokens)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = tokens[total - n:]
        # windows starting at 0 .. total - n - 1: every occurrence but the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


def can_draft(req: Request) -> bool:
    p = req.params
    return (req.grammar is None and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and req.num_output_tokens >= p.min_tokens)


class Speculator:
    def __init__(self, config: SpecConfig, max_model_len: int, drafter: Any = None) -> None:
        """`drafter`: the draft model (engine/draft.py's DraftModel) for method "draft"."""
        self.config = config
        self.max_model_len = max_model_len
        self.drafter = drafter
        self.stats = SpecStats()
        # decayed counts and the cost line for the auto K (see the module docstring)
        self._acc = 0.0
        self._rej = 0.0
        self.cost = CostFit()
        self._proposals = 0
        self.propose_seconds = 0.0  # the last propose call's drafting (a draft model's forwards)
        self.propose_tokens = 0  # tokens the draft model computed in it
        # request ids whose drafts this step are a prompt-lookup run the draft model confirmed
        # (engine/draft.py): their acceptance and cost are not the draft model's
        self.hinted: set[str] = set()

    @property
    def k(self) -> int:
        if self.config.num_tokens is not None:
            return self.config.num_tokens
        if self._acc + self._rej < 4:
            return AUTO_START_K
        return best_k(self._acc / (self._acc + self._rej), self.cost.line())

    def observe_step(self, k: int, seconds: float) -> None:
        """A single-stream step that verified `k` drafts took `seconds` (its verify, plus the
        drafting before it): one point of the auto K's cost line."""
        # a draft model that prefilled a prompt in that call is not a steady step's cost (its
        # steady drafting computes at most k + 1 tokens: the catch-up's 2, then k - 1 steps)
        if (self.config.num_tokens is None and k > 0 and self.propose_tokens <= k + 1
                and not self.hinted):
            self.cost.add(k, seconds + self.propose_seconds)

    def propose(self, running: list[Request]) -> None:
        """Drafts for every running request that is decoding (its KV reaches all but its last
        token); `spec_token_ids` of the others is left empty."""
        k_max = self.k
        if self.config.num_tokens is None and k_max > 0:  # dither, so the cost fit sees 2+ K
            self._proposals += 1
            phase = self._proposals % AUTO_DITHER
            if phase == 1:
                k_max = min(AUTO_MAX_K, k_max + 1)
            elif phase == AUTO_DITHER // 2 + 1:
                k_max = max(1, k_max - 1)
        limit = self.config.disable_by_batch_size
        if limit is not None:
            decoding = sum(r.num_computed_tokens == r.num_tokens - 1 for r in running)
            if decoding > limit:
                k_max = 0  # a full batch: drafts would cost more compute than they save
        rows: list[tuple[Request, int, list[int]]] = []
        self.hinted = set()
        for req in running:
            req.spec_token_ids = []
            req.spec_draft_probs = None
            if (k_max <= 0 or req.num_computed_tokens != req.num_tokens - 1
                    or not can_draft(req)):
                continue
            # no drafts past max_tokens or the context: the step after them could not use them
            room = min(req.max_tokens - req.num_output_tokens - 1,
                       self.max_model_len - req.num_tokens - 1)
            k = min(k_max, room)
            if k <= 0:
                continue
            if self.drafter is not None:
                hint: list[int] = []
                if self.config.lookup_k and req.params.temperature == 0.0:
                    hint = ngram_propose(np.asarray(req.all_token_ids, dtype=np.int64),
                                         min(self.config.lookup_k, room),
                                         self.config.ngram_min, self.config.ngram_max)
                rows.append((req, k, hint))
                continue
            tokens = np.asarray(req.all_token_ids, dtype=np.int64)
            req.spec_token_ids = ngram_propose(tokens, k, self.config.ngram_min,
                                               self.config.ngram_max)
        if self.drafter is not None:
            # every row that is not drafting now gives up its draft KV
            t0 = time.perf_counter()
            self.drafter.propose(rows, {r.request_id for r in running})
            self.propose_seconds = time.perf_counter() - t0
            self.propose_tokens = self.drafter.last_tokens
            self.hinted = self.drafter.last_hinted

    def record(self, num_drafted: int, num_accepted: int, hinted: bool = False) -> None:
        """One verified row: `num_drafted` drafts, of which the first `num_accepted` held
        (`hinted`: a prompt-lookup run, counted in the stats, not in the auto K's acceptance)."""
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += num_drafted
        st.num_accepted_tokens += num_accepted
        if len(st.accepted_per_pos) < num_drafted:
            st.accepted_per_pos += [0] * (num_drafted - len(st.accepted_per_pos))
        for i in range(num_accepted):
            st.accepted_per_pos[i] += 1
        if hinted:
            return
        decay = 0.5 ** (1.0 / AUTO_HALF_LIFE)
        self._acc = self._acc * decay + num_accepted
        self._rej = self._rej * decay + (1 if num_accepted < num_drafted else 0)


# --------------------------------------------------------------------------- verification


def sample_with_drafts(sampler: Sampler, logits: torch.Tensor, reqs: list[Request],
                       drafts: list[list[int]],
                       draft_probs: list[torch.Tensor | None] | None = None
                       ) -> tuple[dict[str, int | list[int]],
                                  dict[str, TokenLogprob | list[TokenLogprob]]]:
    """The step's sampling. `logits` has len(drafts[i]) + 1 rows for reqs[i], in order. Rows
    without drafts go through the sampler as they always did (one token each); the others are
    verified (`verify`) and get a list: accepted drafts, then the token sampled after them.
    `draft_probs[i]`: the draft model's distributions the drafts of reqs[i] were drawn from
    ([len(drafts[i]), vocab]); None (or no list): the drafts are deterministic (n-gram, or a
    greedy draft)."""
    if not any(drafts):
        out = sampler(logits, reqs)
        return ({r.request_id: t for r, t in zip(reqs, out.token_ids)},
                {r.request_id: lp for r, lp in zip(reqs, out.logprobs) if lp is not None})
    plain_rows: list[int] = []
    spec_rows: list[int] = []
    plain_reqs: list[Request] = []
    spec_reqs: list[Request] = []
    spec_drafts: list[list[int]] = []
    spec_probs: list[torch.Tensor | None] = []
    row = 0
    for i, (r, d) in enumerate(zip(reqs, drafts)):
        if d:
            spec_rows.extend(range(row, row + len(d) + 1))
            spec_reqs.append(r)
            spec_drafts.append(d)
            spec_probs.append(draft_probs[i] if draft_probs is not None else None)
        else:
            plain_rows.append(row)
            plain_reqs.append(r)
        row += len(d) + 1
    sampled: dict[str, int | list[int]] = {}
    logprobs: dict[str, TokenLogprob | list[TokenLogprob]] = {}
    if plain_reqs:
        out = sampler(logits[torch.tensor(plain_rows, device=logits.device)], plain_reqs)
        for r, t, lp in zip(plain_reqs, out.token_ids, out.logprobs):
            sampled[r.request_id] = t
            if lp is not None:
                logprobs[r.request_id] = lp
    idx = torch.tensor(spec_rows, device=logits.device)
    for r, toks, lps in zip(spec_reqs, *verify(sampler, logits[idx], spec_reqs, spec_drafts,
                                               spec_probs)):
        sampled[r.request_id] = toks
        if lps is not None:
            logprobs[r.request_id] = lps
    return sampled, logprobs


@torch.no_grad()
def verify(sampler: Sampler, logits: torch.Tensor, reqs: list[Request], drafts: list[list[int]],
           draft_probs: list[torch.Tensor | None] | None = None
           ) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
    """Rows: len(drafts[i]) + 1 per request (see `sample_with_drafts`); the requests pass
    `can_draft`. Returns per request the tokens to append (1 .. k + 1) and their logprobs
    (None unless asked for).

    Sampled rows: standard rejection sampling with the draft's distribution q (a point mass on
    the draft for n-gram drafts): accept draft d with probability min(1, p(d) / q(d)), else
    draw from norm(max(p - q, 0)); a bonus row draws from p."""
    dev = logits.device
    V = sampler.vocab_size
    logits = logits[:, :V]
    R = logits.shape[0]
    row_req = [i for i, d in enumerate(drafts) for _ in range(len(d) + 1)]
    # the draft each row is checked against; -1 on each request's last (bonus) row
    draft_of = torch.tensor([t for d in drafts for t in (*d, -1)], device=dev)
    has_draft = draft_of >= 0
    safe_draft = draft_of.clamp(min=0).unsqueeze(1)
    target = greedy_tokens(logits)
    accept = has_draft & (target == draft_of)  # greedy: the draft is the argmax
    params = [reqs[i].params for i in row_req]
    if not all(p.temperature == 0.0 for p in params):
        probs = Sampler.probs(logits, params)
        u = torch.rand(R, 2, device=dev, generator=sampler.generator)
        for row in [i for i, p in enumerate(params) if p.seed is not None and p.temperature]:
            # a seeded request draws from its own generator (the same seed, the same tokens)
            u[row] = torch.rand(2, device=dev, generator=sampler._generator_for(
                reqs[row_req[row]]))
        p_draft = probs.gather(1, safe_draft).squeeze(1)
        q = _draft_distribution(draft_probs, drafts, R, V, dev) if draft_probs else None
        if q is None:
            # point-mass drafts: accept d with probability p(d), else draw from p without d
            sampled_accept = has_draft & (u[:, 0] < p_draft)
            residual = probs.scatter(1, safe_draft, 0.0) if bool(has_draft.any()) else probs
        else:
            # q(d) > 0 for a drawn draft; a point-mass row has q(d) = 1 (the rule above)
            q_draft = q.gather(1, safe_draft).squeeze(1)
            sampled_accept = has_draft & (u[:, 0] * q_draft < p_draft)
            residual = (probs - q).clamp_(min=0.0)
        residual = torch.where(has_draft.unsqueeze(1), residual, probs)
        cdf = residual.cumsum(dim=-1)
        empty = cdf[:, -1] <= 0  # p <= q everywhere: p == q, always accepted, never drawn
        cdf = torch.where(empty.unsqueeze(1), probs.cumsum(dim=-1), cdf)
        drawn = torch.searchsorted(cdf, (u[:, 1] * cdf[:, -1]).unsqueeze(1), right=True)
        drawn = drawn.squeeze(1).clamp_(max=cdf.shape[1] - 1)
        greedy = torch.tensor([p.temperature == 0.0 for p in params], device=dev)
        target = torch.where(greedy, target, torch.where(sampled_accept, draft_of, drawn))
        accept = torch.where(greedy, accept, sampled_accept)
    want_lp = [p.logprobs is not None for p in params]
    raw = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
    # the one host sync: the tokens and whether each row's draft held
    targets, accepted = torch.stack([target, accept.long()]).tolist()

    tokens: list[list[int]] = []
    row = 0
    for d in drafts:
        emitted: list[int] = []
        for j in range(len(d) + 1):
            emitted.append(targets[row + j])
            # a rejected draft ends the run, even when the residual drew the same token: the
            # rows after it were scored on the draft, but the draw came from the residual
            if j == len(d) or not accepted[row + j]:
                break
        tokens.append(emitted)
        row += len(d) + 1
    logprobs: list[list[TokenLogprob] | None] = [None] * len(reqs)
    if raw is not None:
        row = 0
        for i, (r, d) in enumerate(zip(reqs, drafts)):
            k = r.params.logprobs
            if k is not None:
                n = len(tokens[i])
                sub = raw[row:row + n]
                chosen = sub.gather(1, torch.tensor(tokens[i], device=dev).unsqueeze(1))
                tops = _top_logprobs(sub, k) if k else [[] for _ in range(n)]
                logprobs[i] = [TokenLogprob(t, v, top) for t, v, top
                               in zip(tokens[i], chosen.squeeze(1).tolist(), tops)]
            row += len(d) + 1
    return tokens, logprobs


def _draft_distribution(draft_probs: list[torch.Tensor | None], drafts: list[list[int]],
                        R: int, V: int, dev: torch.device) -> torch.Tensor | None:
    """q for every verification row, [R, V]: the draft model's distribution on the rows it
    drew, a point mass on the draft for deterministic drafts, 0 on bonus rows. None when no
    request has a draft distribution."""
    if not any(p is not None for p in draft_probs):
        return None
    q = torch.zeros(R, V, device=dev)
    row = 0
    for d, p in zip(drafts, draft_probs):
        k = len(d)
        if p is not None:
            q[row:row + k] = p[:k, :V].to(device=dev, dtype=q.dtype)
        else:
            q[torch.arange(row, row + k, device=dev), torch.tensor(d, device=dev)] = 1.0
        row += k + 1
    return q
