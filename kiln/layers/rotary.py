"""Rotary position embeddings with the scaling types Llama-family configs use.

Inverse frequencies follow the published formulas (default, linear, llama3, yarn) as Hugging Face
transformers computes them, so logits match its reference implementation. cos/sin are tabulated
once up to `max_positions` and indexed by each token's position: any batch layout works.
The rotation is the "rotate half" form (GGUF's interleaved Q/K rows are un-permuted at load), in
the activation dtype with cos/sin cast to it, as transformers does.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None,
                  max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Returns (inverse frequencies [head_dim/2], attention factor applied to cos/sin)."""
    dim = head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv_freq, 1.0
    assert scaling is not None
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "dynamic":
        # Dynamic NTK only changes the base past the original context; inside it, default.
        return inv_freq, 1.0
    if kind == "llama3":
        low_ff = float(scaling.get("low_freq_factor", 1.0))
        high_ff = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low_ff, old_len / high_ff
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        orig = float(scaling.get("original_max_position_embeddings") or max_position_embeddings)
        if not scaling.get("factor"):
            factor = max_position_embeddings / orig
        beta_fast = float(scaling.get("beta_fast") or 32)
        beta_slow = float(scaling.get("beta_slow") or 1)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn = scaling.get("attention_factor")
        if attn is None:
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

        def corr_dim(rot: float) -> float:
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low, high = corr_dim(beta_fast), corr_dim(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
        extrap_factor = 1 - ramp
        pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrap_factor) + (1.0 / pos_freqs) * extrap_factor
        return inv, float(attn)
    if kind == "longrope":
        return _longrope(dim, base, scaling, max_position_embeddings, long=False)
    raise NotImplementedError(f"RoPE scaling type {kind!r} is not supported by kiln yet")


def _longrope(dim: int, base: float, scaling: dict[str, Any], max_position_embeddings: int,
              long: bool) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: the inverse frequencies divided per dim by its short (or long)
    factors, cos/sin scaled by sqrt(1 + ln(factor) / ln(original length)), as transformers
    computes them."""
    orig = int(scaling.get("original_max_position_embeddings") or max_position_embeddings)
    factor = float(scaling.get("factor") or max_position_embeddings / orig)
    attn = scaling.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32,
                       device="cpu")
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (ext * base ** shape), float(attn)


def longrope_switch(scaling: dict[str, Any] | None) -> int | None:
    """The first position LongRoPE tables take from the long factors (None: not LongRoPE)."""
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind != "longrope":
        return None
    assert scaling is not None
    return int(scaling.get("original_max_position_embeddings") or 0) or None


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: float, max_positions: int,
                 scaling: dict[str, Any] | None = None,
                 max_position_embeddings: int | None = None) -> None:
        super().__init__()
        self.args = (head_dim, base, scaling, max_position_embeddings or max_positions)
        self.max_positions = max_positions
        self.build()

    def build(self, freq_factors: torch.Tensor | None = None,
              device: torch.device | str | None = None) -> None:
        """(Re)computes the tables (on `device`, else where they are now, else the CPU);
        `freq_factors` divide the inverse frequencies (GGUF's `rope_freqs` tensor, which is how
        llama.cpp stores Llama 3's scaling)."""
        inv_freq, attn_factor = rope_inv_freq(*self.args)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.float().cpu()
        # Tables are computed on the CPU (explicitly: the model is first built under
        # torch.device("meta"), where these factories would go through slow reference code).
        t = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)
        switch = longrope_switch(self.args[2])
        if switch is not None and switch < self.max_positions:
            # LongRoPE: positions past the original context rotate by the long factors. (HF
            # switches a whole forward to them once its length passes that point; a paged cache
            # cannot re-rotate keys already stored, so the choice is made per position: exact
            # below the switch, where almost every request lives.)
            dim, base, scaling, max_pos = self.args
            assert scaling is not None
            long_inv, _ = _longrope(dim, base, scaling, max_pos, long=True)
            freqs[switch:] = torch.outer(t[switch:], long_inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        # Not parameters: rebuilt at init, so the meta-device build materializes them itself.
        if device is None and hasattr(self, "cos") and self.cos.device.type != "meta":
            device = self.cos.device
        cos, sin = emb.cos() * attn_factor, emb.sin() * attn_factor
        half = cos.shape[-1] // 2
        # sin with the rotate-half sign folded in: x*cos + cat(x2, x1)*sin_signed equals HF's
        # x*cos + cat(-x2, x1)*sin bit for bit, one op fewer.
        sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)
        self.register_buffer("sin_signed", sin_signed.to(device), persistent=False)
        self._cache: dict[torch.dtype, torch.Tensor] = {}

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) rows for `positions`, [T, 1, D] in `dtype` (HF computes them in
        fp32 and casts to the activation dtype before rotating: so do we)."""
        table = self._cache.get(dtype)
        if table is None or table.device != self.cos.device:
            table = torch.stack([self.cos, self.sin_signed], dim=0).to(dtype)
            self._cache[dtype] = table
        cs = table[:, positions].unsqueeze(2)  # [2, T, 1, D]
        return cs[0], cs[1]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D], positions: [T]."""
        cos, sin = self.lookup(positions, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin_signed: [T, 1, D] in x's dtype (from `RotaryEmbedding.lookup`)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin_signed
