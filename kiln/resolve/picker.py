"""Which files of a model folder or repo listing make one model: a GGUF (all parts of a split
file) picked by quant, or the safetensors weights. Works on names only, so the same rules serve a
local folder, an HF cache snapshot and a repo's file list before download."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from kiln.errors import ModelNotFoundError
from kiln.i18n import msg

# GGUF quant tags preferred when a repo holds several and the user named none.
_PREFERRED_QUANTS: tuple[str, ...] = ("Q4_K_M", "Q4_0", "Q8_0")
_GGUF_QUANT_RE = re.compile(
    r"(?:^|[.\-_])((?:I?Q\d(?:_[A-Z0-9]+)*)|BF16|F16|F32|FP16|FP32)(?=$|[.\-_])", re.IGNORECASE
)
SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


def gguf_quant_from_name(name: str) -> str | None:
    """ "SmolLM2-135M-Instruct.Q4_1.gguf" -> "Q4_1"; None if the name carries no quant tag."""
    stem = SPLIT_RE.sub("", Path(name).name)
    if stem.lower().endswith(".gguf"):
        stem = stem[:-5]
    matches = _GGUF_QUANT_RE.findall(stem)
    return matches[-1].upper() if matches else None


def group_gguf(names: Sequence[str]) -> dict[str, list[str]]:
    """Group GGUF names so each split model ("-00001-of-00003") is one entry, parts in order.
    Projector files (mmproj-*) are not language models and are left out."""
    groups: dict[str, list[str]] = {}
    for n in sorted(names):
        base = n.rsplit("/", 1)[-1]
        if not base.lower().endswith(".gguf") or base.lower().startswith("mmproj"):
            continue
        groups.setdefault(SPLIT_RE.sub(".gguf", n), []).append(n)
    return groups


def pick_gguf_group(
    groups: dict[str, list[str]], quant: str | None, default_quant: str | None, where: str
) -> tuple[list[str], str | None]:
    """Choose one GGUF (all its parts). `quant` must match; without it prefer the registry's
    default quant, then common ones, then the only file. Raises with the quants on offer."""
    if not groups:
        raise ModelNotFoundError(msg("quant.no_gguf", where=where),
                                 hint=msg("quant.no_gguf.hint"))
    quants = {k: gguf_quant_from_name(k) for k in groups}
    available = sorted({q for q in quants.values() if q}) or sorted(groups)

    def by_quant(q: str) -> list[str]:
        exact = [k for k, v in quants.items() if v == q.upper()]
        return exact or [k for k in groups if q.lower() in k.rsplit("/", 1)[-1].lower()]

    if quant:
        hits = by_quant(quant)
        if not hits:
            raise ModelNotFoundError(
                msg("quant.missing", where=where, quant=repr(quant)),
                hint=msg("quant.available", quants=", ".join(available)),
            )
        if len(hits) > 1:
            raise ModelNotFoundError(
                msg("quant.ambiguous", where=where, quant=repr(quant),
                    files=", ".join(h.rsplit("/", 1)[-1] for h in hits)),
                hint=msg("quant.ambiguous.hint"),
            )
        return groups[hits[0]], quants[hits[0]]
    if len(groups) == 1:
        key = next(iter(groups))
        return groups[key], quants[key]
    for q in ([default_quant] if default_quant else []) + list(_PREFERRED_QUANTS):
        hits = by_quant(q)
        if len(hits) == 1:
            return groups[hits[0]], quants[hits[0]]
    raise ModelNotFoundError(msg("quant.unspecified", where=where),
                             hint=msg("quant.unspecified.hint", quants=", ".join(available)))


def safetensors_names(names: Sequence[str]) -> list[str]:
    """Top-level weight files of a safetensors checkpoint, from a file listing.

    Mistral-style repos ship both `consolidated.safetensors` and `model-*.safetensors`: the same
    weights twice under different names, so the consolidated copy is dropped.
    """
    top = [n for n in names if "/" not in n and n.endswith(".safetensors")]
    rest = [n for n in top if not n.startswith("consolidated")]
    return sorted(rest or top)


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)
