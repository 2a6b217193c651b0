"""Batched sampling for a whole step: penalties, temperature, top-k / top-p / min-p, seeded draws.

One pass over the [batch, vocab] logits; per-row knobs are tensors, so a batch mixing greedy and
sampled requests costs the same as a uniform one. A draw inverts the row's cumulative
distribution at one uniform number per row (the first token whose running mass passes
u * total), so a request with a `seed` takes its number from its own generator: the same seed
gives the same tokens whatever else is in the batch. (One random number per row, not one per
vocabulary entry as in the exponential race argmax(p / E): on CPU, filling [16, 49152] with
Exp(1) noise took ~20 ms, a third of a decode step.) Results leave the device in one transfer
(a single host sync per step).

Temperature-0 rows are picked by an argmax of their logits where the logits are (one transfer of
ids, no softmax): the distribution is built only for the rows that sample, and log-softmax only
for the rows that ask for logprobs (ferrum's --greedy-argmax, kiln's only greedy path).

Rows whose request has a grammar (structured output, engine/structured.py) are masked before
anything else; the grammar's mask is filled on the host and added as a 0 / -inf bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kiln.engine.request import Request, TokenLogprob


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def _generator_for(self, req: Request) -> torch.Generator:
        g = self._request_generators.get(req.request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(int(req.params.seed) & 0xFFFF_FFFF_FFFF_FFFF)
            self._request_generators[req.request_id] = g
        return g

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        """logits: [B, V] fp32, row i for reqs[i]."""
        B = logits.shape[0]
        dev = logits.device
        logits = logits[:, : self.vocab_size]
        # Structured output: the rows with a grammar lose the tokens it forbids, first, so that
        # everything after (logprobs included, as in vLLM) sees the masked distribution. Other
        # rows are not touched, and cost one None test each.
        grammar_rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if grammar_rows:
            matchers = [reqs[i].grammar for i in grammar_rows]
            # A new tensor: the caller's logits are left as they were.
            logits = matchers[0].owner.mask_logits(logits, grammar_rows, matchers)  # type: ignore
        params = [r.params for r in reqs]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = (torch.log_softmax(_rows(logits, lp_rows), dim=-1) if lp_rows else None)

        penalized = self._apply_penalties(logits, reqs)
        # min_tokens: end-of-sequence tokens are not allowed yet. (Masked on a copy: the
        # caller's logits are left as they were.)
        bans: list[tuple[int, list[int]]] = []
        for i, r in enumerate(reqs):
            p = r.params
            if (p.min_tokens and r.num_output_tokens < p.min_tokens
                    and (r.grammar is None or not r.grammar.done)):  # done: only EOS is left
                banned = [t for t in (list(p.stop_token_ids)
                                      + ([] if p.ignore_eos else list(r.eos_token_ids)))
                          if 0 <= t < logits.shape[1]]
                if banned:
                    bans.append((i, banned))
        if bans and penalized is logits:
            penalized = logits.clone()
        logits = penalized
        for i, banned in bans:
            logits[i, torch.tensor(banned, device=dev)] = float("-inf")

        tokens = greedy_tokens(logits)
        sampled_rows = [i for i, p in enumerate(params) if p.temperature != 0.0]
        if sampled_rows:
            rows = [params[i] for i in sampled_rows]
            cdf = self.probs(_rows(logits, sampled_rows), rows).cumsum_(dim=-1)  # [S, V], fp32
            # One number per row of the batch, drawn as before whichever rows sample, so an
            # unseeded row's draw does not depend on how many greedy rows share its step.
            u = torch.rand(B, device=dev, generator=self.generator)
            for i in sampled_rows:
                if params[i].seed is not None:
                    u[i] = torch.rand(1, device=dev, generator=self._generator_for(reqs[i]))[0]
            u = _rows(u, sampled_rows)
            # Strictly past u * total: a zero-probability (masked) token adds no mass, so it is
            # never the first to pass; scaling by the row's total absorbs cumsum rounding.
            target = (u * cdf[:, -1]).unsqueeze(1)
            sampled = torch.searchsorted(cdf, target, right=True).squeeze(1)
            sampled = sampled.clamp_(max=cdf.shape[1] - 1)
            if len(sampled_rows) == B:
                tokens = sampled
            else:
                tokens[torch.tensor(sampled_rows, device=dev)] = sampled

        out_tokens = tokens.tolist()
        out_logprobs: list[TokenLogprob | None] = [None] * B
        if raw_logprobs is not None:
            k = max(params[i].logprobs or 0 for i in lp_rows)
            picked = _rows(tokens, lp_rows).unsqueeze(1)
            chosen_l = raw_logprobs.gather(1, picked).squeeze(1).tolist()
            tops = _top_logprobs(raw_logprobs, k) if k else None
            for j, i in enumerate(lp_rows):
                n = params[i].logprobs
                top = tops[j][:n] if tops is not None and n else []
                out_logprobs[i] = TokenLogprob(out_tokens[i], chosen_l[j], top)
        return SamplerOutput(out_tokens, out_logprobs)

    @staticmethod
    def probs(logits: torch.Tensor, params: list) -> torch.Tensor:
        """The distribution each row samples from, [B, V]: its temperature (1 for greedy rows),
        then top-k / top-p / min-p, then softmax. The sampler, speculative verification and a
        draft model's proposals all draw from this one definition."""
        temps = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)
        return torch.softmax(Sampler._apply_top_k_top_p_min_p(logits / temps.unsqueeze(1),
                                                              params), dim=-1)

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(reqs)
                if r.params.repetition_penalty != 1.0 or r.params.presence_penalty
                or r.params.frequency_penalty]
        if not rows:
            return logits
        logits = logits.clone()
        dev = logits.device
        V = logits.shape[1]
        for i in rows:
            p = reqs[i].params
            if p.repetition_penalty != 1.0:
                # HF/vLLM semantics: every token seen in prompt or output is penalized.
                seen = torch.tensor(sorted(set(reqs[i].all_token_ids)), device=dev,
                                    dtype=torch.long)
                seen = seen[seen < V]
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                              vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and reqs[i].output_token_ids:
                # OpenAI semantics: only generated tokens count.
                out = torch.tensor(reqs[i].output_token_ids, device=dev, dtype=torch.long)
                counts = torch.bincount(out, minlength=V)[:V].to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        return logits

    @staticmethod
    def _apply_top_k_top_p_min_p(logits: torch.Tensor, params: list) -> torch.Tensor:
        dev = logits.device
        V = logits.shape[1]
        top_k = [p.top_k if 0 < p.top_k < V else 0 for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        if any(top_k) or any(p < 1.0 for p in top_p):
            # The cut is found among each row's best `window` logits (topk, not a full sort: on
            # CPU sorting [16, 49152] took ~30 ms, topk(256) ~1.5 ms). Rows whose nucleus might
            # reach past the window are redone, alone, with a wider one: the result is exact.
            thresh = torch.full((logits.shape[0], 1), float("-inf"), device=dev)
            rows = [i for i, (k, p) in enumerate(zip(top_k, top_p)) if k or p < 1.0]
            for window in (*(w for w in _TOP_WINDOWS if w < V), V):
                if not rows:
                    break
                if max(top_k[i] for i in rows) > window:
                    continue
                idx = torch.tensor(rows, device=dev)
                cut, wider = _cut_threshold(logits[idx], [top_k[i] for i in rows],
                                            [top_p[i] for i in rows], window)
                thresh[idx] = cut
                rows = [i for i, w in zip(rows, wider.tolist()) if w]
            logits = logits.masked_fill(logits < thresh, float("-inf"))
        if any(m > 0 for m in min_p):
            probs = torch.softmax(logits, dim=-1)
            thresh = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=dev).unsqueeze(1)
            logits = logits.masked_fill(probs < thresh, float("-inf"))
        return logits


_TOP_WINDOWS = (256, 4096)


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x's rows `rows` (ascending): x itself when they are all of them (no copy)."""
    if len(rows) == x.shape[0]:
        return x
    return x[torch.tensor(rows, device=x.device)]


def score_tokens(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """The logprob and rank of targets[i] under row i of `logits` ([N, V], unpenalized), with
    the row's k best: prompt logprobs."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.tensor(targets, device=lp.device).unsqueeze(1)
    chosen = lp.gather(1, idx)
    ranks = (lp > chosen).sum(dim=1).add_(1).tolist()
    tops = _top_logprobs(lp, k) if k else [[] for _ in targets]
    return [TokenLogprob(t, v, top, rank=r)
            for t, v, top, r in zip(targets, chosen.squeeze(1).tolist(), tops, ranks)]


def _top_logprobs(logprobs: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """Each row's k best (token, logprob), ties broken by the lowest token id as argmax breaks
    them (common with bf16 logits), so a greedy pick is first. topk finds the k-th value; only
    the tokens at or above it (k, or a few more when tied) are ordered, with a stable sort over
    ascending ids, instead of a stable sort of the whole vocabulary. Impossible tokens (-inf: a
    grammar forbids them) are no alternative and are left out, so a row may list fewer."""
    kth = logprobs.topk(min(k, logprobs.shape[1]), dim=-1).values[:, -1:]
    out = []
    for row, t in zip(logprobs, kth):
        keep = row >= t if t.item() > float("-inf") else row > t
        ids = torch.nonzero(keep).flatten()  # ascending ids
        vals, order = row[ids].sort(descending=True, stable=True)
        out.append(list(zip(ids[order[:k]].tolist(), vals[:k].tolist())))
    return out


def _cut_threshold(logits: torch.Tensor, top_k: list[int], top_p: list[float],
                   window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows that cut (top-k and/or top-p; top-p's mass is taken over the top-k set, as
    vLLM does): [B, 1] the smallest logit each row keeps, searched among its best `window`
    logits, and [B] bool: the row's nucleus may extend past the window (its cut is not final)."""
    dev = logits.device
    vals = logits.topk(window, dim=-1).values  # [B, W], descending
    ranks = torch.arange(window, device=dev).unsqueeze(0)
    ks = torch.tensor([k or window for k in top_k], device=dev)
    keep = ranks < ks.unsqueeze(1)
    wider = torch.zeros(len(top_k), dtype=torch.bool, device=dev)
    if any(p < 1.0 for p in top_p):
        kept = vals.masked_fill(~keep, float("-inf"))
        # Probabilities over the row's whole candidate set: its top-k, else all V logits.
        lse = torch.where(torch.tensor([k > 0 for k in top_k], device=dev),
                          torch.logsumexp(kept, dim=-1), torch.logsumexp(logits, dim=-1))
        probs = torch.exp(kept - lse.unsqueeze(1))
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        cum_before = probs.cumsum(dim=-1) - probs
        p_thresh = torch.tensor([p if p < 1.0 else float("inf") for p in top_p], device=dev)
        keep &= cum_before < p_thresh.unsqueeze(1)
        if window < logits.shape[1]:
            # The whole window inside the nucleus of a row that top-k does not bound.
            wider = keep[:, -1] & torch.tensor([k == 0 for k in top_k], device=dev)
    n_keep = keep.sum(dim=-1, keepdim=True)
    return vals.gather(1, n_keep - 1), wider


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [B] int64 (the lowest token id among equal maxima, NaN first, as
    torch's argmax). On CPU through NumPy: its SIMD argmax reads a row of 49k-152k logits 5-10x
    faster than PyTorch's (10 vs 68 us, 20 vs 199 us a row on the 2-core EPYC), a cost every
    decode step pays once per row."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return torch.from_numpy(np.argmax(logits.detach().numpy(), axis=-1))
    return logits.argmax(dim=-1)
