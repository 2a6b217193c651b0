"""Batched sampling for a whole step: penalties, temperature, top-k / top-p / min-p, seeded draws.

One pass over the [batch, vocab] logits; per-row knobs are tensors, so a batch mixing greedy and
sampled requests costs the same as a uniform one. Draws use the exponential-race form of
categorical sampling (argmax of p / E with E ~ Exp(1)), so a request with a `seed` draws its noise
from its own generator: the same seed gives the same tokens whatever else is in the batch.
Results leave the device in one transfer (a single host sync per step).
"""

from __future__ import annotations

from dataclasses import dataclass

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
        params = [r.params for r in reqs]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        penalized = self._apply_penalties(logits, reqs)
        # min_tokens: end-of-sequence tokens are not allowed yet. (Masked on a copy: the
        # caller's logits are left as they were.)
        bans: list[tuple[int, list[int]]] = []
        for i, r in enumerate(reqs):
            p = r.params
            if p.min_tokens and r.num_output_tokens < p.min_tokens:
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

        tokens = logits.argmax(dim=-1)
        if not all(p.temperature == 0.0 for p in params):
            greedy = torch.tensor([p.temperature == 0.0 for p in params], device=dev)
            temps = torch.tensor([p.temperature or 1.0 for p in params], device=dev)
            scaled = logits / temps.unsqueeze(1)
            scaled = self._apply_top_k_top_p_min_p(scaled, params)
            probs = torch.softmax(scaled, dim=-1)
            noise = torch.empty_like(probs)
            seeded = [i for i, p in enumerate(params) if p.seed is not None and p.temperature]
            noise.exponential_(generator=self.generator)
            for i in seeded:
                noise[i].exponential_(generator=self._generator_for(reqs[i]))
            sampled = (probs / noise).argmax(dim=-1)
            tokens = torch.where(greedy, tokens, sampled)

        out_tokens = tokens.tolist()
        out_logprobs: list[TokenLogprob | None] = [None] * B
        if raw_logprobs is not None:
            k = max(p.logprobs or 0 for p in params)
            chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
            # A stable sort, not topk: among equal logprobs (common with bf16 logits) the lowest
            # token id comes first, as it does for argmax, so a greedy pick is top_logprobs[0].
            top_v, top_i = (raw_logprobs.sort(dim=-1, descending=True, stable=True)
                            if k else (None, None))
            if k:
                top_v, top_i = top_v[:, :k], top_i[:, :k]
            chosen_l = chosen.tolist()
            top_vl = top_v.tolist() if top_v is not None else None
            top_il = top_i.tolist() if top_i is not None else None
            for i, p in enumerate(params):
                if p.logprobs is None:
                    continue
                n = p.logprobs
                top = (list(zip(top_il[i][:n], top_vl[i][:n]))
                       if n and top_il is not None and top_vl is not None else [])
                out_logprobs[i] = TokenLogprob(out_tokens[i], chosen_l[i], top)
        return SamplerOutput(out_tokens, out_logprobs)

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
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        need_sort = any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p)
        if need_sort:
            V = logits.shape[1]
            sorted_logits, idx = logits.sort(dim=-1, descending=True)
            ks = torch.tensor([k if k > 0 else V for k in top_k], device=dev)
            ranks = torch.arange(V, device=dev).unsqueeze(0)
            mask = ranks >= ks.unsqueeze(1)
            probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            # top_p = 1 keeps everything: the cumulative sum may round past 1.0 before the end.
            cum_before = probs.cumsum(dim=-1) - probs
            p_thresh = torch.tensor([p if p < 1.0 else float("inf") for p in top_p], device=dev)
            mask |= cum_before >= p_thresh.unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(1, idx, sorted_logits)
        if any(m > 0 for m in min_p):
            probs = torch.softmax(logits, dim=-1)
            thresh = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=dev).unsqueeze(1)
            logits = logits.masked_fill(probs < thresh, float("-inf"))
        return logits
