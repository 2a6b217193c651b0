"""LoRA adapters in kiln's engine: PEFT folders and the registry; the grouped LoRA matmuls they feed
(the target linears' hooks, the step's row groups) are kiln/layers/lora.py.

Each row of a step carries an adapter id (0: the base model). For every target linear

    y = base(x)                                       every row, whatever its adapter
    y[rows of i] += (x[rows of i] @ A_i^T) @ B_i^T    once per adapter i in the step

so rows of different adapters (and of none) share one batch step, and the base weights are
never touched: the base linear is whatever module kiln loaded (dense, packed, int4 / int8), and
the low-rank product is added to its output by a forward hook. The scaling (alpha / r, or alpha /
sqrt(r) with rsLoRA) is folded into B when an adapter is loaded.

Packed linears (qkv_proj, gate_up_proj) take the adapters of their checkpoint shards as one
pair: A is the shards' A stacked, [r_q + r_k + r_v, in], and B is block-diagonal, [out, r_q +
r_k + r_v], zero outside each shard's rows ("pieces" say where it is not), so one packed linear
costs one shrink and one expand per group of rows, as one unpacked linear does.

    runner: decodes sorted by adapter -> ids per row -> LoRAManager.step_of: groups (slot,
            first row, end row), once per step -> set_step -> forward
    hook on each target linear: out[first:end] += (x[first:end] @ A^T) @ B^T per group

On a CPU with fp32 activations a linear's groups are one call of kiln's kernel (lora_add in
kiln/layers/kernels/lora.cpp: each 4-row block's shrink then its expand, B's zero blocks skipped,
added into the base linear's output): a decode step's adapter products are tiny (16 rows x
rank 16), so PyTorch's ops cost their dispatch and parallel regions more than their arithmetic,
and a masked or padded batched form would multiply zeros. Elsewhere (GPU, bf16) each group is
two matmuls, the second added in place (addmm_).

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
from kiln.layers.kernels.choose import choose_lora_kernel
from kiln.layers.lora import LoRAStep, TargetHook

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
    "path" (its files) or its "name" (the API's lora_path / lora_name). `code`: which of
    these, for a program or a test (lora.file_missing, lora.rank_too_large, ...)."""

    def __init__(self, message: str, *, hint: str | None = None, field: str = "path",
                 code: str | None = None) -> None:
        super().__init__(message, hint=hint, code=code)
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
            raise LoRAError(f"{where}: {f} not found", hint=_FOLDER_HINT,
                            code="lora.file_missing")
    try:
        cfg = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAError(f"{where}: {CONFIG_FILE} is not readable JSON: {e}",
                        hint=_FOLDER_HINT, code="lora.bad_config") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA",
                        hint="kiln serves LoRA adapters only", code="lora.not_lora")
    for key, off in (("use_dora", False), ("modules_to_save", None), ("bias", "none")):
        if cfg.get(key, off) not in (off, [], False, None):
            raise LoRAError(f"{where}: {key}={cfg[key]!r} is not supported",
                            hint="kiln serves plain LoRA (no DoRA, no trained biases or "
                            "saved modules)", code="lora.unsupported_option")
    wanted = cfg.get("target_modules")
    if isinstance(wanted, list):
        unknown = sorted(set(wanted) - set(TARGETS))
        if unknown:
            raise LoRAError(f"{where}: unknown target module(s) {', '.join(unknown)}",
                            hint=f"kiln adapts {', '.join(TARGETS)}", code="lora.unknown_target")
    from safetensors import safe_open

    pairs: dict[str, dict[str, str]] = {}
    rank = 0
    with safe_open(str(folder / WEIGHTS_FILE), "pt") as f:
        for key in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
            m = _KEY.match(key)
            if m is None:
                raise LoRAError(f"{where}: tensor {key!r} is not a LoRA A/B weight",
                                hint=f"kiln adapts {', '.join(TARGETS)} with plain LoRA",
                                code="lora.unknown_target")
            module = m["module"]
            target = module.rsplit(".", 1)[-1]
            if target not in TARGETS:
                raise LoRAError(f"{where}: unknown target module {target!r} ({key})",
                                hint=f"kiln adapts {', '.join(TARGETS)}",
                                code="lora.unknown_target")
            pairs.setdefault(module, {})[m["ab"]] = key
            if m["ab"] == "A":
                rank = max(rank, int(f.get_slice(key).get_shape()[0]))
    if not pairs:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights", hint=_FOLDER_HINT,
                        code="lora.no_weights")
    half = sorted(m for m, ab in pairs.items() if len(ab) != 2)
    if half:
        raise LoRAError(f"{where}: {half[0]} has lora_A or lora_B but not both",
                        hint=_FOLDER_HINT, code="lora.no_weights")
    if rank > max_rank:
        raise LoRAError(f"{where}: rank {rank} is over --max-lora-rank {max_rank}",
                        hint=f"serve it with --max-lora-rank {rank} or more",
                        code="lora.rank_too_large")
    return AdapterSpec(
        name=name, path=folder, rank=rank, lora_alpha=float(cfg.get("lora_alpha", 8)),
        use_rslora=bool(cfg.get("use_rslora", False)),
        alpha_pattern=dict(cfg.get("alpha_pattern") or {}),
        targets=tuple(sorted({m.rsplit(".", 1)[-1] for m in pairs})),
        keys={m: (ab["A"], ab["B"]) for m, ab in pairs.items()})


# --------------------------------------------------------------------------- the registry


@dataclass
class LoadedAdapter:
    spec: AdapterSpec
    id: int
    slot: int  # its index in the target linears' stacks (reused after an unload; ids are not)


class LoRAManager:
    """The adapters loaded into one model (lives on the engine thread, with the model)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device, *,
                 max_loras: int, max_rank: int) -> None:
        self.model = model
        self.dtype, self.device = dtype, device
        self.max_loras, self.max_rank = max_loras, max_rank
        self.adapters: dict[str, LoadedAdapter] = {}
        self._hooks: dict[str, TargetHook] = {}  # our module path -> its hook
        self._next_id = 1
        self._slot_of: dict[int, int] = {}  # adapter id -> slot
        # whether the adapters are added by lora_add (so the layer kernel can add them)
        self.kernel = choose_lora_kernel(device, dtype).kiln

    def id_of(self, name: str) -> int:
        a = self.adapters.get(name)
        if a is None:
            loaded = ", ".join(self.adapters) or "none"
            raise LoRANotFoundError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})",
                                    hint="load it with --lora NAME=PATH or POST "
                                    "/v1/load_lora_adapter", field="name",
                                    code="lora.not_loaded")
        return a.id

    def load(self, name: str, path: str | Path) -> LoadedAdapter:
        if name in self.adapters:
            raise LoRAError(f"LoRA adapter {name!r} is already loaded",
                            hint="unload it first, or load it under another name", field="name",
                            code="lora.already_loaded")
        if len(self.adapters) >= self.max_loras:
            raise LoRAError(f"LoRA adapter {name!r}: {len(self.adapters)} adapters are loaded, "
                            f"--max-loras is {self.max_loras}",
                            hint="unload one, or raise --max-loras", field="name",
                            code="lora.slots_full")
        spec = inspect_adapter(name, path, self.max_rank)
        per_module = self._place(spec)
        aid = self._next_id
        self._next_id += 1
        slot = min(set(range(self.max_loras)) - set(self._slot_of.values()))
        for our_path, item in per_module.items():
            hook = self._hooks.get(our_path)
            if hook is None:
                hook = self._hooks[our_path] = TargetHook(self.model.get_submodule(our_path),
                                                           self.max_loras, self.kernel)
            hook.set(slot, item)
        self._slot_of[aid] = slot
        loaded = self.adapters[name] = LoadedAdapter(spec, aid, slot)
        return loaded

    def unload(self, name: str) -> None:
        aid = self.id_of(name)
        slot = self._slot_of.pop(aid)
        for hook in self._hooks.values():
            hook.set(slot, None)
        del self.adapters[name]

    def step_of(self, ids: np.ndarray) -> LoRAStep | None:
        """The groups of a step whose row i has adapter id ids[i] (0: base): each run of equal
        ids is one group (the runner keeps an adapter's rows together). None when every row
        is base. Once per step, so no target linear looks at rows."""
        if not ids.any():
            return None
        cut = np.flatnonzero(ids[1:] != ids[:-1]) + 1
        firsts = np.concatenate(([0], cut))
        ends = np.concatenate((cut, [len(ids)]))
        groups = [(self._slot_of[int(ids[f])], int(f), int(e))
                  for f, e in zip(firsts, ends) if ids[f] != 0]
        return LoRAStep(groups, torch.tensor(groups, dtype=torch.int64).reshape(-1, 3))

    def _place(self, spec: AdapterSpec
               ) -> dict[str, tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int, int]]]]:
        """The adapter's tensors in this model's modules: our module path -> (A, B, pieces),
        packed shards stacked (see the module notes), the scaling folded into B; pieces: (first
        rank, end rank, first output, end output) of each shard, where B is not zero."""
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
                                hint="the adapter was trained for another model",
                                code="lora.wrong_model") from None
            shards: dict[str, tuple[int, int]] = getattr(lin, "shards", None) or {}
            start, rows = shards[shard] if shard is not None else (0, lin.out_features)
            a, b = tensors[ka], tensors[kb]
            r = a.shape[0]
            if a.shape != (r, lin.in_features) or b.shape != (rows, r):
                raise LoRAError(
                    f"LoRA adapter {spec.name!r}: {module} has A {tuple(a.shape)}, B "
                    f"{tuple(b.shape)}; this model's layer takes A ({r}, {lin.in_features}), "
                    f"B ({rows}, {r})", hint="the adapter was trained for another model",
                    code="lora.wrong_model")
            scaled = b.float() * spec.scaling(module, r)
            parts.setdefault(our_path, []).append((start, rows, a.float(), scaled))
        out: dict[str, tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int, int]]]] = {}
        for our_path, items in parts.items():
            lin = self.model.get_submodule(our_path)
            total = sum(a.shape[0] for _, _, a, _ in items)
            big_b = torch.zeros(lin.out_features, total)
            pieces = []
            col = 0
            for start, rows, a, b in items:
                big_b[start:start + rows, col:col + a.shape[0]] = b
                pieces.append((col, col + a.shape[0], start, start + rows))
                col += a.shape[0]
            big_a = torch.cat([a for _, _, a, _ in items])
            out[our_path] = (big_a.to(self.device, self.dtype).contiguous(),
                             big_b.to(self.device, self.dtype).contiguous(), pieces)
        return out

    def detach(self) -> None:
        """Removes every adapter and hook: the model is the base model again."""
        for hook in self._hooks.values():
            hook.handle.remove()
        self._hooks.clear()
        self.adapters.clear()
        self._slot_of.clear()

    def describe(self) -> list[dict[str, Any]]:
        return [{"name": n, "id": a.id, "path": str(a.spec.path), "rank": a.spec.rank,
                 "targets": list(a.spec.targets)} for n, a in self.adapters.items()]
