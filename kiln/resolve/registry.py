"""kiln's model registry: short names (aliases) -> what to download and how to run it.

The data lives in `models.toml` next to this file, so adding a model is a data change.
"""

from __future__ import annotations

import functools
import importlib.resources
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

# Approximate bytes per weight for common GGUF quants (block scales included), used to size
# GPU experts when the experts come from a GGUF file instead of the bf16/fp8 checkpoint.
QUANT_BYTES_PER_PARAM: dict[str, float] = {
    "F32": 4.0,
    "F16": 2.0,
    "BF16": 2.0,
    "FP8": 1.0,
    "Q8_0": 1.0625,
    "Q6_K": 0.8203,
    "Q5_K_M": 0.71,
    "Q5_K_S": 0.6875,
    "Q5_0": 0.6875,
    "Q4_K_M": 0.65,  # expert ffn_down tensors are Q6_K in *_K_M files
    "Q4_K_S": 0.5625,
    "Q4_1": 0.625,
    "Q4_0": 0.5625,
    "Q3_K_M": 0.49,
    "Q2_K": 0.3281,
    "INT8": 1.0,
    "INT4": 0.5,
}


@dataclass
class GpuExpertsRule:
    """How many experts of each MoE layer fit on GPU (see models.toml for the formula)."""

    experts_per_layer: int
    experts_per_token: int
    moe_layers: int
    params_per_expert: int
    dense_params: int
    bytes_per_param: float = 2.0
    reserve_bytes: int = 4 * 1024**3
    vram_fraction: float = 0.9
    shared_experts: int = 0  # run for every token; their weights are in dense_params
    # Where the checkpoint stores the dense weights wider than the experts (gpt-oss: bf16
    # attention, MXFP4 experts); None: bytes_per_param for both.
    dense_bytes_per_param: float | None = None


@dataclass
class RegistryEntry:
    name: str
    hf_repo: str
    family: str
    kind: str  # "dense" | "moe"
    params: str
    description: str
    aliases: list[str] = field(default_factory=list)
    architecture: str | None = None
    active_params: str | None = None
    context_length: int | None = None
    max_tensor_parallel: int = 1
    gated: bool = False
    embedded: bool = False
    gguf_repo: str | None = None
    gguf_quant: str | None = None
    recommended: dict[str, Any] = field(default_factory=dict)
    gpu_experts_rule: GpuExpertsRule | None = None
    # What the model is for (kiln/kinds/): "generate" | "embed" | "transcribe" | "speech".
    serves: str = "generate"
    # Shipped in a PyPI package: "<module>/<folder>" where its files are once installed, and
    # the pip requirement that installs it (no download from the hub).
    package: str | None = None
    package_install: str | None = None

    @property
    def names(self) -> list[str]:
        return [self.name, *self.aliases]

    @property
    def param_counts(self) -> tuple[float | None, float | None]:
        """(total, active per token) parameters as numbers ("30.5B" -> 30.5e9); active is None
        for a dense entry (all of them run), either is None where the text is not a count."""
        return parse_param_count(self.params), parse_param_count(self.active_params)

    @property
    def experts(self) -> str | None:
        """"128 experts, 8 per token" (", + 1 shared") for an MoE entry; None for a dense one."""
        rule = self.gpu_experts_rule
        if rule is None:
            return None
        shared = f" + {rule.shared_experts} shared" if rule.shared_experts else ""
        return f"{rule.experts_per_layer} experts, {rule.experts_per_token} per token{shared}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_param_count(text: str | None) -> float | None:
    """"135M" -> 1.35e8, "30.5B" -> 3.05e10; None for anything else."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMBT])\s*", text or "", re.IGNORECASE)
    if m is None:
        return None
    return float(m.group(1)) * {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}[m.group(2).upper()]


_REQUIRED = ("name", "hf_repo", "family", "kind", "params", "description")


def _entry_from_toml(raw: dict[str, Any], source: str) -> RegistryEntry:
    missing = [k for k in _REQUIRED if k not in raw]
    label = raw.get("name", "?")
    if missing:
        raise ConfigError(
            f"model registry {source}: entry {label!r} lacks {', '.join(missing)}",
            hint="fix the entry in models.toml", code="registry.entry_incomplete",
        )
    if raw["kind"] not in ("dense", "moe"):
        raise ConfigError(
            f"model registry {source}: entry {label!r} has kind {raw['kind']!r}",
            hint='kind must be "dense" or "moe"',
        )
    if raw.get("serves", "generate") not in ("generate", "embed", "transcribe", "speech"):
        raise ConfigError(
            f"model registry {source}: entry {label!r} serves {raw['serves']!r}",
            hint='serves must be "generate", "embed", "transcribe" or "speech"',
        )
    data = dict(raw)
    rule = data.pop("gpu_experts_rule", None)
    known = set(RegistryEntry.__dataclass_fields__)
    unknown = set(data) - known
    if unknown:
        raise ConfigError(
            f"model registry {source}: entry {label!r} has unknown keys {sorted(unknown)}",
            hint=f"known keys: {', '.join(sorted(known))}",
        )
    entry = RegistryEntry(**data)
    if rule is not None:
        entry.gpu_experts_rule = GpuExpertsRule(**rule)
    return entry


def load_registry(path: Path | None = None) -> list[RegistryEntry]:
    """All registry entries, in file order. `path` overrides the shipped models.toml."""
    if path is not None:
        return _parse_registry(Path(path).read_text(encoding="utf-8"), str(path))
    return list(_shipped_registry())


@functools.lru_cache(maxsize=1)
def _shipped_registry() -> tuple[RegistryEntry, ...]:
    res = importlib.resources.files("kiln.resolve").joinpath("models.toml")
    return tuple(_parse_registry(res.read_text(encoding="utf-8"), "models.toml"))


def _parse_registry(text: str, source: str) -> list[RegistryEntry]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"model registry {source} is not valid TOML: {e}") from e
    entries = [_entry_from_toml(raw, source) for raw in data.get("models", [])]
    seen: dict[str, str] = {}
    for e in entries:
        for n in e.names:
            key = n.lower()
            if key in seen:
                raise ConfigError(
                    f"model registry {source}: name {n!r} is used by {seen[key]!r} and {e.name!r}",
                    hint="make names and aliases unique", code="registry.name_taken",
                )
            seen[key] = e.name
    return entries


def lookup(name: str) -> RegistryEntry | None:
    """Registry entry whose name or alias equals `name` (case-insensitive)."""
    key = name.strip().lower()
    for e in _shipped_registry():
        if key in (n.lower() for n in e.names):
            return e
    return None


def search(query: str) -> list[RegistryEntry]:
    """Registry models a short name points at, as kt-cli matches them: the best tier only, each
    entry once, in file order. Tiers: a name or alias starting with the query, then one
    containing it (or the HF repo containing it). Empty when nothing contains it. An exact name
    is `lookup`'s, not this."""
    q = query.strip().lower()
    if not q:
        return []
    tiers: dict[int, list[RegistryEntry]] = {}
    for e in _shipped_registry():
        names = [n.lower() for n in e.names]
        if any(n.startswith(q) for n in names):
            tiers.setdefault(0, []).append(e)
        elif any(q in n for n in names) or q in e.hf_repo.lower():
            tiers.setdefault(1, []).append(e)
    return tiers[min(tiers)] if tiers else []


def embedded_entry() -> RegistryEntry:
    for e in _shipped_registry():
        if e.embedded:
            return e
    raise ConfigError("the model registry has no embedded default", hint="reinstall kiln")


_QUANT_TAIL = re.compile(
    r"[.\-_]((?:i?q\d[a-z0-9_]*)|bf16|fp16|f16|f32|fp32|fp8|awq|gptq|int[48])$", re.IGNORECASE
)
_SPLIT_TAIL = re.compile(r"-\d{5}-of-\d{5}$")


def normalize_model_name(text: str) -> str:
    """Reduce a repo, folder or GGUF file name to a comparable stem.

    "SmolLM2-135M-Instruct.Q4_1.gguf" and "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF" both
    become "smollm2-135m-instruct".
    """
    s = text.strip().rstrip("/").split("/")[-1]
    if s.lower().endswith(".gguf"):
        s = s[:-5]
    s = _SPLIT_TAIL.sub("", s)
    if s.lower().endswith("-gguf"):
        s = s[:-5]
    # Repeat: "model-Q4_K_M.f16" style double tails exist.
    for _ in range(2):
        s = _QUANT_TAIL.sub("", s)
    return s.lower()


def _cache_folder_repo(part: str) -> str | None:
    # HF cache folders are named models--owner--repo.
    if part.startswith("models--"):
        bits = part[len("models--") :].split("--")
        if len(bits) >= 2:
            return "/".join(bits[:1] + ["--".join(bits[1:])])
    return None


def infer_entry(name_or_path: str | Path) -> RegistryEntry | None:
    """Find the registry entry a repo id, folder or GGUF file most likely is.

    Tries, from the last path component back: exact alias, HF-cache folder name, and the
    normalized repo names of `hf_repo` / `gguf_repo`.
    """
    text = str(name_or_path)
    entry = lookup(text)
    if entry is not None:
        return entry
    by_stem: dict[str, RegistryEntry] = {}
    for e in _shipped_registry():
        for repo in (e.hf_repo, e.gguf_repo):
            if repo:
                by_stem.setdefault(normalize_model_name(repo), e)
    by_repo = {e.hf_repo.lower(): e for e in _shipped_registry()}
    by_repo.update({e.gguf_repo.lower(): e for e in _shipped_registry() if e.gguf_repo})
    if text.lower() in by_repo:
        return by_repo[text.lower()]
    # Only repo-shaped names count for path components: bare aliases such as "qwen3" are too
    # generic to trust as a folder name. Look at the last few components (a snapshot hash or a
    # "model.gguf" sits below the telling one) and stop at an HF cache folder.
    parts = [p for p in re.split(r"[\\/]", text) if p]
    for part in list(reversed(parts))[:4]:
        repo = _cache_folder_repo(part)
        if repo is not None:
            return by_repo.get(repo.lower()) or by_stem.get(normalize_model_name(repo))
        if "--" in part:  # kt-cli stores a repo as owner--repo (Qwen--Qwen3-30B-A3B)
            repo = part.replace("--", "/", 1)
            hit = by_repo.get(repo.lower()) or by_stem.get(normalize_model_name(repo))
            if hit is not None:
                return hit
        hit = by_stem.get(normalize_model_name(part))
        if hit is not None:
            return hit
    # kt-cli's folders may also carry the registry name itself (deepseek-v3, kimi-k2): the last
    # component only, and a name, not a bare alias such as "qwen3".
    if parts:
        last = parts[-1].lower()
        for e in _shipped_registry():
            if e.name.lower() == last:
                return e
    return None


def gpu_experts_per_layer(
    entry: RegistryEntry,
    vram_bytes_per_gpu: int,
    tp: int,
    *,
    bytes_per_param: float | None = None,
    quant: str | None = None,
) -> int:
    """Experts per MoE layer that fit on the GPUs; the rest stay on CPU.

    Experts kept on GPU are sharded over the `tp` ranks, as are the dense weights, so each GPU
    holds 1/tp of both. `quant` (e.g. "Q4_K_M") or `bytes_per_param` overrides the checkpoint's
    weight size. Result is clamped to [0, experts_per_layer].
    """
    rule = entry.gpu_experts_rule
    if rule is None:
        raise ConfigError(
            f"{entry.name} is a {entry.kind} model with no gpu_experts_rule",
            hint="num_gpu_experts only applies to MoE models; leave it unset",
            code="registry.not_moe",
        )
    if tp < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {tp}")
    if quant is not None and bytes_per_param is None:
        bpp = QUANT_BYTES_PER_PARAM.get(quant.upper())
        if bpp is None:
            raise ConfigError(
                f"unknown quant {quant!r} for sizing experts",
                hint=f"known: {', '.join(QUANT_BYTES_PER_PARAM)}",
            )
        bytes_per_param = bpp
    bpp = bytes_per_param if bytes_per_param is not None else rule.bytes_per_param
    # A quant given here re-encodes everything alike; the checkpoint's own may not.
    dense_bpp = (rule.dense_bytes_per_param if bytes_per_param is None
                 and rule.dense_bytes_per_param else bpp)
    budget = vram_bytes_per_gpu * rule.vram_fraction
    budget -= rule.dense_params * dense_bpp / tp + rule.reserve_bytes
    if budget <= 0:
        return 0
    per_expert_all_layers = rule.moe_layers * rule.params_per_expert * bpp
    n = math.floor(budget * tp / per_expert_all_layers)
    return max(0, min(rule.experts_per_layer, n))
