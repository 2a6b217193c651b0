"""LoRA adapters in kiln's engine: PEFT folders, the registry, and the grouped LoRA matmuls.

Each row of a step carries an adapter id (0: the base model). For every target linear

    y = base(x)                                       every row, whatever its adapter
    y[rows of i] += (x[rows of i] @ A_i^T) @ B_i^T    once per adapter i in the step

so rows of different adapters (and of none) share one batch step, and the base weights are
never touched: the base linear is whatever module kiln loaded (dense, packed, int4 / int8), and
the low-rank product is added to its output by a forward hook. The scaling (alpha / r, or alpha /
sqrt(r) with rsLoRA) is folded into B when an adapter is loaded.

Packed linears (qkv_proj, gate_up_proj) take the adapters of their checkpoint shards as one
pair: A is the shards' A stacked, [r_q + r_k + r_v, in], and B is block-diagonal, [out, r_q +
r_k + r_v], zero outside each shard's rows, so one packed linear costs two small matmuls a group.

    runner: ids per row -> LoRAStep (groups: adapter id -> rows) -> set_step -> forward
    hook on each target linear: out[rows] += (x[rows] @ A^T) @ B^T for each group it has

Small steps (decode batches, up to MASKED_MAX_ROWS rows) take all of a linear's adapters at
once instead: out += ((x @ [A_1; A_2; ...]^T) * mask) @ [B_1 B_2 ...]^T, the mask keeping each
row's own adapter's columns (same sums: the other columns add exact zeros), two matmuls a
linear instead of four ops per adapter.

Ids are never reused: an adapter loaded after another was unloaded gets a new id, so the prefix
cache (whose block hashes include the id) can never hand one adapter's KV to another.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from kiln.errors import KilnError

# Checkpoint module names an adapter may target (the Llama family's linears, which every dense
# decoder kiln runs shares). Others (embeddings, lm_head, MoE experts) are refused by name.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
_FOLDER_HINT = ("a LoRA adapter is a PEFT folder with adapter_config.json and "
                "adapter_model.safetensors (what PeftModel.save_pretrained writes)")


class LoRAError(KilnError):
    """An adapter that cannot be served: missing files, a rank over --max-lora-rank, a target
    kiln does not adapt, a duplicate name, one in use. `field`: what is wrong, the adapter's
    "path" (its files) or its "name" (the API's lora_path / lora_name)."""

    def __init__(self, message: str, *, hint: str | None = None, field: str = "path") -> None:
        super().__init__(message, hint=hint)
        self.field = field


class LoRANotFoundError(LoRAError):
    """No adapter of that name is loaded."""


@dataclass
class AdapterSpec:
    """What a PEFT folder holds, read without loading its tensors (startup checks it)."""

    name: str
    path: Path
    rank: int  # the largest of its modules' ranks
    lora_alpha: float
    use_rslora: bool
    alpha_pattern: dict[str, float]
    targets: tuple[str, ...]  # checkpoint module names, e.g. ("q_proj", "v_proj")
    # checkpoint module path (model.layers.0.self_attn.q_proj) -> (A key, B key)
    keys: dict[str, tuple[str, str]] = field(default_factory=dict)

    def scaling(self, module: str, rank: int) -> float:
        alpha = self.lora_alpha
        for pattern, value in self.alpha_pattern.items():  # PEFT's match: a suffix of the name
            if re.fullmatch(rf"(.*\.)?{pattern}", module):
                alpha = float(value)
                break
        return alpha / (math.sqrt(rank) if self.use_rslora else rank)


def model_id(template: str, base: str, name: str) -> str:
    """The model id clients ask for an adapter by (--lora-model-id-template)."""
    return template.replace("<base>", base).replace("<name>", name)


def inspect_adapter(name: str, path: str | Path, max_rank: int) -> AdapterSpec:
    """Reads and checks a PEFT folder (`~` expanded) without loading its tensors: both files
    there, a LoRA config kiln can serve, every key a LoRA A/B of a known target, the rank within
    `max_rank`. Raises one LoRAError that names the adapter, the problem and the fix."""
    folder = Path(path).expanduser()
    where = f"LoRA adapter {name!r} ({folder})"
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / f).is_file():
            raise LoRAError(f"{where}: {f} not found", hint=_FOLDER_HINT)
    try:
        cfg = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAError(f"{where}: {CONFIG_FILE} is not readable JSON: {e}",
                        hint=_FOLDER_HINT) from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA",
                        hint="kiln serves LoRA adapters only")
    for key, off in (("use_dora", False), ("modules_to_save", None), ("bias", "none")):
        if cfg.get(key, off) not in (off, [], False, None):
            raise LoRAError(f"{where}: {key}={cfg[key]!r} is not supported",
                            hint="kiln serves plain LoRA (no DoRA, no trained biases or "
                            "saved modules)")
    wanted = cfg.get("target_modules")
    if isinstance(wanted, list):
        unknown = sorted(set(wanted) - set(TARGETS))
        if unknown:
            raise LoRAError(f"{where}: unknown target module(s) {', '.join(unknown)}",
                            hint=f"kiln adapts {', '.join(TARGETS)}")
    from safetensors import safe_open

    pairs: dict[str, dict[str, str]] = {}
    rank = 0
    with safe_open(str(folder / WEIGHTS_FILE), "pt") as f:
        for key in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
            m = _KEY.match(key)
            if m is None:
                raise LoRAError(f"{where}: tensor {key!r} is not a LoRA A/B weight",
                                hint=f"kiln adapts {', '.join(TARGETS)} with plain LoRA")
            module = m["module"]
            target = module.rsplit(".", 1)[-1]
            if target not in TARGETS:
                raise LoRAError(f"{where}: unknown target module {target!r} ({key})",
                                hint=f"kiln adapts {', '.join(TARGETS)}")
            pairs.setdefault(module, {})[m["ab"]] = key
            if m["ab"] == "A":
                rank = max(rank, int(f.get_slice(key).get_shape()[0]))
    if not pairs:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights", hint=_FOLDER_HINT)
    half = sorted(m for m, ab in pairs.items() if len(ab) != 2)
    if half:
        raise LoRAError(f"{where}: {half[0]} has lora_A or lora_B but not both",
                        hint=_FOLDER_HINT)
    if rank > max_rank:
        raise LoRAError(f"{where}: rank {rank} is over --max-lora-rank {max_rank}",
                        hint=f"serve it with --max-lora-rank {rank} or more")
    return AdapterSpec(
        name=name, path=folder, rank=rank, lora_alpha=float(cfg.get("lora_alpha", 8)),
        use_rslora=bool(cfg.get("use_rslora", False)),
        alpha_pattern=dict(cfg.get("alpha_pattern") or {}),
        targets=tuple(sorted({m.rsplit(".", 1)[-1] for m in pairs})),
        keys={m: (ab["A"], ab["B"]) for m, ab in pairs.items()})


# --------------------------------------------------------------------------- one step's groups


# Steps of up to this many rows (decode batches) take every loaded adapter of a linear in one
# pair of matmuls, each row's columns of other adapters masked to zero, instead of two matmuls
# and a gather / scatter per adapter: on a CPU such a step is bound by the number of small ops
# (30 layers x 4 linears x 4 adapters), not by their arithmetic. Larger steps (prefill chunks)
# are bound by arithmetic, where the groups compute only their own rows.
MASKED_MAX_ROWS = 64


@dataclass
class LoRAStep:
    """Which rows of the step's flattened batch use which adapter (base rows are in none)."""

    groups: list[tuple[int, slice | torch.Tensor]]
    # Small steps: each row's adapter id ([rows], 0: base), for the masked form; None: grouped
    row_ids: torch.Tensor | None = None
    # (a linear's adapter layout, dtype) -> [rows, columns] 0/1: the row's own adapter's columns
    masks: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def mask(self, layout: tuple, owner: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Made once per step for each layout (linears of one shape share theirs)."""
        m = self.masks.get((layout, dtype))
        if m is None:
            assert self.row_ids is not None
            m = self.masks[(layout, dtype)] = (self.row_ids[:, None] == owner[None, :]).to(dtype)
        return m


_STEP: LoRAStep | None = None


def set_step(step: LoRAStep | None) -> None:
    """The groups the target linears read during this forward (None: no adapter rows)."""
    global _STEP
    _STEP = step


def step_of(ids: np.ndarray, device: torch.device) -> LoRAStep | None:
    """Groups of rows by adapter id (0: base, skipped); contiguous rows as a slice, else as an
    index tensor. None when every row is base."""
    if not ids.any():
        return None
    groups: list[tuple[int, slice | torch.Tensor]] = []
    for a in np.unique(ids):
        if a == 0:
            continue
        rows = np.flatnonzero(ids == a)
        first, last = int(rows[0]), int(rows[-1])
        if last - first + 1 == len(rows):
            groups.append((int(a), slice(first, last + 1)))
        else:
            groups.append((int(a), torch.from_numpy(rows).to(device)))
    small = len(ids) <= MASKED_MAX_ROWS
    return LoRAStep(groups, torch.from_numpy(ids).to(device) if small else None)


class _TargetHook:
    """A target linear's adapters (id -> A [R, in], B [out, R] with the scaling in it) and the
    forward hook that adds them to its output."""

    def __init__(self, module: nn.Module) -> None:
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.handle = module.register_forward_hook(self)
        # Every adapter's A stacked [sum R, in], B side by side [out, sum R], and which adapter
        # owns each of those columns: the masked form (see MASKED_MAX_ROWS).
        self.a_all: torch.Tensor | None = None
        self.b_all: torch.Tensor | None = None
        self.owner: torch.Tensor | None = None
        self.layout: tuple = ()

    def set(self, aid: int, pair: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Adds (or, with None, drops) adapter `aid`'s A, B; restacks the masked form."""
        if pair is None:
            self.weights.pop(aid, None)
        else:
            self.weights[aid] = pair
        ids = sorted(self.weights)
        if not ids:
            self.a_all = self.b_all = self.owner = None
            self.layout = ()
            return
        a0 = self.weights[ids[0]][0]
        self.a_all = torch.cat([self.weights[i][0] for i in ids])
        self.b_all = torch.cat([self.weights[i][1] for i in ids], dim=1).contiguous()
        self.owner = torch.cat([torch.full((self.weights[i][0].shape[0],), i, dtype=torch.long)
                                for i in ids]).to(a0.device)
        self.layout = tuple((i, self.weights[i][0].shape[0]) for i in ids)

    def __call__(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        # Compiled decode graphs only run steps without adapter rows: trace the base alone.
        if torch.compiler.is_compiling():
            return None
        step = _STEP
        if step is None:
            return None
        x = args[0]
        if step.row_ids is not None:
            if self.a_all is None:
                return None
            assert self.b_all is not None and self.owner is not None
            mask = step.mask(self.layout, self.owner, self.a_all.dtype)
            delta = ((x.to(self.a_all.dtype) @ self.a_all.t()) * mask) @ self.b_all.t()
            out += delta.to(out.dtype)
            return out
        for aid, rows in step.groups:
            w = self.weights.get(aid)
            if w is None:
                continue
            a, b = w
            delta = ((x[rows].to(a.dtype) @ a.t()) @ b.t()).to(out.dtype)
            if isinstance(rows, slice):
                out[rows] += delta
            else:
                out.index_add_(0, rows, delta)
        return out


# --------------------------------------------------------------------------- the registry


@dataclass
class LoadedAdapter:
    spec: AdapterSpec
    id: int


class LoRAManager:
    """The adapters loaded into one model (lives on the engine thread, with the model)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device, *,
                 max_loras: int, max_rank: int) -> None:
        self.model = model
        self.dtype, self.device = dtype, device
        self.max_loras, self.max_rank = max_loras, max_rank
        self.adapters: dict[str, LoadedAdapter] = {}
        self._hooks: dict[str, _TargetHook] = {}  # our module path -> its hook
        self._next_id = 1

    def id_of(self, name: str) -> int:
        a = self.adapters.get(name)
        if a is None:
            loaded = ", ".join(self.adapters) or "none"
            raise LoRANotFoundError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})",
                                    hint="load it with --lora NAME=PATH or POST "
                                    "/v1/load_lora_adapter", field="name")
        return a.id

    def load(self, name: str, path: str | Path) -> LoadedAdapter:
        if name in self.adapters:
            raise LoRAError(f"LoRA adapter {name!r} is already loaded",
                            hint="unload it first, or load it under another name", field="name")
        if len(self.adapters) >= self.max_loras:
            raise LoRAError(f"LoRA adapter {name!r}: {len(self.adapters)} adapters are loaded, "
                            f"--max-loras is {self.max_loras}",
                            hint="unload one, or raise --max-loras", field="name")
        spec = inspect_adapter(name, path, self.max_rank)
        per_module = self._place(spec)
        aid = self._next_id
        self._next_id += 1
        for our_path, (a, b) in per_module.items():
            hook = self._hooks.get(our_path)
            if hook is None:
                hook = self._hooks[our_path] = _TargetHook(self.model.get_submodule(our_path))
            hook.set(aid, (a, b))
        loaded = self.adapters[name] = LoadedAdapter(spec, aid)
        return loaded

    def unload(self, name: str) -> None:
        aid = self.id_of(name)
        for hook in self._hooks.values():
            hook.set(aid, None)
        del self.adapters[name]

    def _place(self, spec: AdapterSpec) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The adapter's tensors in this model's modules: our module path -> (A, B), packed
        shards stacked (see the module notes), the scaling folded into B."""
        from safetensors.torch import load_file

        tensors = load_file(str(spec.path / WEIGHTS_FILE))
        packed: dict[str, tuple[str, str]] = getattr(self.model, "packed_modules", {})
        # our module path -> [(rows start, rows, A, B scaled)]
        parts: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
        for module, (ka, kb) in spec.keys.items():
            parent, _, target = module.rpartition(".")
            ours, shard = packed.get(target, (target, None))
            our_path = f"{parent}.{ours}" if parent else ours
            try:
                lin = self.model.get_submodule(our_path)
            except AttributeError:
                raise LoRAError(f"LoRA adapter {spec.name!r}: this model has no {module}",
                                hint="the adapter was trained for another model") from None
            shards: dict[str, tuple[int, int]] = getattr(lin, "shards", None) or {}
            start, rows = shards[shard] if shard is not None else (0, lin.out_features)
            a, b = tensors[ka], tensors[kb]
            r = a.shape[0]
            if a.shape != (r, lin.in_features) or b.shape != (rows, r):
                raise LoRAError(
                    f"LoRA adapter {spec.name!r}: {module} has A {tuple(a.shape)}, B "
                    f"{tuple(b.shape)}; this model's layer takes A ({r}, {lin.in_features}), "
                    f"B ({rows}, {r})", hint="the adapter was trained for another model")
            scaled = b.float() * spec.scaling(module, r)
            parts.setdefault(our_path, []).append((start, rows, a.float(), scaled))
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for our_path, items in parts.items():
            lin = self.model.get_submodule(our_path)
            total = sum(a.shape[0] for _, _, a, _ in items)
            big_b = torch.zeros(lin.out_features, total)
            col = 0
            for start, rows, a, b in items:
                big_b[start:start + rows, col:col + a.shape[0]] = b
                col += a.shape[0]
            big_a = torch.cat([a for _, _, a, _ in items])
            out[our_path] = (big_a.to(self.device, self.dtype).contiguous(),
                             big_b.to(self.device, self.dtype).contiguous())
        return out

    def detach(self) -> None:
        """Removes every adapter and hook: the model is the base model again."""
        for hook in self._hooks.values():
            hook.handle.remove()
        self._hooks.clear()
        self.adapters.clear()

    def describe(self) -> list[dict[str, Any]]:
        return [{"name": n, "id": a.id, "path": str(a.spec.path), "rank": a.spec.rank,
                 "targets": list(a.spec.targets)} for n, a in self.adapters.items()]
