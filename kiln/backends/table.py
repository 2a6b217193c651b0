"""The mapping-table machinery: what a backend module (vllm.py, sglang.py) declares, and what
its rows may read while a plan is built.

A `Backend` holds one table of `Map` rows. A row says how one kiln setting becomes engine flags
or env vars, or that the engine cannot honour it (`unsupported="warn"` or `"error"`; error when
ignoring it would change what the model computes). plan.py walks the table; discovery.py finds
and probes the engine; launch.py runs it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kiln.errors import ConfigError
from kiln.settings.resolve import ResolvedSettings
from kiln.settings.table import BY_NAME
from kiln.settings.values import lora_module

ENGINES = ("vllm", "sglang")

# Sources that mean "someone chose this value" (the user, a preset, or the model's registry
# entry). Values from kiln's own auto rules or defaults are kiln's guesses for kiln's engine:
# the external engine makes its own, so they are passed on only where they differ from the
# engine's default in a way that matters (tensor parallel size, say).
EXPLICIT_SOURCES = frozenset({"cli", "env", "file", "preset", "registry"})

# Hybrid CPU/GPU MoE (kt-kernel) settings: SGLang translates them, vLLM warns they are ignored.
KT_SETTINGS = ("kt_method", "kt_weight_path", "kt_cpuinfer", "kt_threadpool_count",
               "num_gpu_experts", "kt_gpu_prefill_token_threshold")


class _EngineDecides:
    def __repr__(self) -> str:
        return "ENGINE_DECIDES"


ENGINE_DECIDES: Any = _EngineDecides()


# --------------------------------------------------------------------------- data


@dataclass
class BackendModel:
    """What to serve, as the lead's model resolution found it.

    `path` is what the engine is given: a local folder, a .gguf file, or a Hugging Face repo id.
    """

    path: str
    served_names: list[str] = field(default_factory=list)
    tokenizer: str | None = None  # only passed when it differs from `path` (GGUF needs it)
    is_moe: bool = False
    max_tp: int | None = None  # from the registry: the most GPUs one replica may split over


@dataclass(frozen=True)
class EngineCommand:
    """How to start one engine: `prefix` + model + flags.

    `model_flag` None means the model is positional (`vllm serve MODEL`).
    """

    engine: str
    prefix: tuple[str, ...]
    model_flag: str | None
    source: str  # "kiln's venv" | "PATH" | "--engine-command" | "engines.<name>.command" | ...

    @property
    def executable(self) -> str:
        return self.prefix[0]


@dataclass
class EngineHelp:
    """The flags one installed engine accepts, parsed from its --help."""

    flags: frozenset[str]
    choices: dict[str, tuple[str, ...]] = field(default_factory=dict)
    from_cache: bool = False


@dataclass
class LaunchPlan:
    engine: str
    argv: list[str]
    env: dict[str, str]  # additions to the inherited environment
    warnings: list[str]
    translated: list[tuple[str, str, Any]]  # (kiln setting, engine flag or env var, value)
    model_name: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    command: EngineCommand | None = None


@dataclass(frozen=True)
class Arg:
    """One engine flag. value True: a bare flag; a list: one flag followed by several values."""

    flag: str
    value: Any = True
    setting: str | None = None  # which kiln setting it came from, when not the row's own


@dataclass(frozen=True)
class Env:
    name: str
    value: str
    setting: str | None = None


Out = Arg | Env


class Untranslatable(Exception):
    """Raised by a row's convert/emit: this value cannot be handed to the engine. An "error"
    names its branch with a code (`handoff.<what>`), which the plan's ConfigError lists in its
    causes; a "warn" only says what is ignored."""

    def __init__(self, severity: Literal["warn", "error"], message: str,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.severity = severity
        self.message = message
        self.code = code


@dataclass(frozen=True)
class Map:
    """One row of a backend's table: how one kiln setting reaches the engine.

    Emission rule: a row fires when its setting (or one in `also`) has a value and that value
    was chosen (EXPLICIT_SOURCES), or differs from `engine_default`, or `always` is set.
    Then either `emit` gives the outputs, or `flag` is emitted with `convert(value)` (None from
    convert emits nothing). `unsupported` rows only report: "warn" notes the setting is ignored,
    "error" refuses the plan.
    """

    setting: str
    flag: str | None = None
    convert: Callable[[Any, PlanContext], Any] | None = None
    emit: Callable[[Any, PlanContext], list[Out]] | None = None
    engine_default: Any = ENGINE_DECIDES
    always: bool = False
    also: tuple[str, ...] = ()  # further settings this row reads; any of them can fire it
    unsupported: Literal["warn", "error"] | None = None
    note: str = ""


@dataclass(frozen=True)
class Backend:
    name: str
    label: str  # "vLLM"
    table: tuple[Map, ...]
    default_command: Callable[[], EngineCommand]
    discover: Callable[[], EngineCommand | None]  # kiln's venv, then PATH
    from_user_command: Callable[[list[str], str], EngineCommand]
    help_args: tuple[tuple[str, ...], ...]  # tried in order until one lists flags
    install_hint: str
    upgrade_hint: str
    flag_hints: Mapping[str, str] = field(default_factory=dict)  # flag prefix -> install hint
    tokenizer_flag: str = "--tokenizer"


# --------------------------------------------------------------------------- settings view


class PlanContext:
    """What a row's convert/emit may read while one plan is built."""

    def __init__(self, backend: Backend, settings: ResolvedSettings | Mapping[str, Any],
                 model: BackendModel, help: EngineHelp | None) -> None:
        self.backend = backend
        self.model = model
        self.help = help
        self.warnings: list[str] = []
        self._resolved = settings if isinstance(settings, ResolvedSettings) else None
        self._plain: Mapping[str, Any] = {} if self._resolved is not None else settings

    def value(self, name: str) -> Any:
        if self._resolved is not None:
            return self._resolved.get(name)
        if name in self._plain:
            return self._plain[name]
        s = BY_NAME.get(name)
        return s.default if s is not None and s.default != "auto" else None

    def explicit(self, name: str) -> bool:
        """True when a person, preset or registry entry chose the value. A plain mapping
        counts as all-chosen: its keys are what the caller set."""
        if self._resolved is not None:
            r = self._resolved.values.get(name)
            return r is not None and r.value is not None and r.source in EXPLICIT_SOURCES
        return self._plain.get(name) is not None

    def outranks(self, a: str, b: str) -> bool:
        """True when setting `a`'s value comes from a higher source than `b`'s (cli > env >
        file > preset > registry > ...): which of two settings that spell one engine flag
        wins. A plain mapping has no sources: `a` wins when it is set."""
        from kiln.settings.resolve import SOURCES

        if self._resolved is None:
            return self._plain.get(a) is not None
        ra, rb = self._resolved.values.get(a), self._resolved.values.get(b)
        if ra is None or ra.value is None:
            return False
        if rb is None or rb.value is None:
            return True
        return SOURCES.index(ra.source) < SOURCES.index(rb.source)

    def names(self) -> list[str]:
        if self._resolved is not None:
            return list(self._resolved.values)
        return list(self._plain)

    def choices(self, flag: str, known: Iterable[str]) -> tuple[str, ...]:
        """The values this engine accepts for `flag`: from its --help when probed, else what
        the backend knows of current releases."""
        if self.help is not None and flag in self.help.choices:
            return self.help.choices[flag]
        return tuple(known)

    def warn(self, message: str) -> None:
        self.warnings.append(message)


def get_backend(engine: str) -> Backend:
    if engine not in ENGINES:
        raise ConfigError(f"unknown external engine {engine!r}",
                          hint=f"choose one of: {', '.join(ENGINES)}")
    # Imported lazily: the backend modules import this one.
    return importlib.import_module(f"kiln.backends.{engine}").BACKEND


# --------------------------------------------------------------------------- shared converters


def kv_cache_dtype(value: str, ctx: PlanContext, *, flag: str, literals: Mapping[str, str],
                   known: Iterable[str]) -> str | None:
    """Maps kiln's kv_cache_dtype (auto|fp16|bf16|fp32|int8) to an engine literal.

    Under "auto" both engines store KV in the model dtype, so fp16/bf16/fp32 are honoured
    without a literal when --dtype was set to the same type. int8 has no such escape: a
    different KV type changes the numbers, so it is refused rather than silently dropped.
    """
    if value == "auto":
        return None
    accepted = ctx.choices(flag, known)
    literal = literals.get(value)
    if literal is not None and literal in accepted:
        return literal
    same = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}.get(value)
    label = ctx.backend.label
    if same is not None:
        if ctx.explicit("dtype") and ctx.value("dtype") == same:
            return None
        raise Untranslatable("error", f"{label} has no {value} KV cache type (it accepts "
                             f"{', '.join(accepted)}); its KV cache follows the model dtype, "
                             f"so set --dtype {same} with --kv-cache-dtype auto",
                             "handoff.kv_cache_follows_dtype")
    raise Untranslatable("error", f"{label} has no {value} KV cache (it accepts "
                         f"{', '.join(accepted)}); use --kv-cache-dtype auto, or pass an "
                         f"fp8 type after `--`", "handoff.kv_cache_dtype_missing")


def lora_pairs(value: Any, ctx: PlanContext) -> list[str]:
    """The adapters (--lora-modules / --lora, parsed by the settings table) as the engine's
    'name=path' items, each named by --lora-model-id-template: the engine serves an adapter
    under its name, so the name is the model id clients ask for, as with kiln's engine."""
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    template = ctx.value("lora_model_id_template") or "<name>"
    base = (served_names(ctx) or [""])[0]
    pairs: list[str] = []
    for item in items:
        if not str(item).strip():
            continue
        try:
            name, path = lora_module(str(item))
        except ValueError as e:
            raise Untranslatable("error", str(e), "handoff.lora_module_invalid") from None
        pairs.append(f"{template.replace('<base>', base).replace('<name>', name)}={path}")
    return pairs


def served_names(ctx: PlanContext) -> list[str]:
    names = ctx.value("served_model_name") or ctx.model.served_names
    return [str(n) for n in names] if names else []


def offline_env(value: bool, _: PlanContext) -> list[Out]:
    """Both engines download through huggingface_hub, so one variable keeps them offline."""
    return [Env("HF_HUB_OFFLINE", "1")] if value else []


def speculative_tokens(model: str | None, ctx: PlanContext) -> int | None:
    """How many tokens to draft, or None when speculative decoding is off. Both engines need a
    draft model (or the model-free n-gram method) and a token count; anything less is refused."""
    method = ctx.value("speculative_method")
    k = ctx.value("num_speculative_tokens")
    if model is None and method != "ngram":
        if k is not None or method is not None:
            raise Untranslatable("error", "speculative decoding needs --speculative-model "
                                 "(or --speculative-method ngram)",
                                 "handoff.speculative_needs_model")
        return None
    if k is None:
        raise Untranslatable("error", "speculative decoding needs --num-speculative-tokens",
                             "handoff.speculative_needs_tokens")
    return int(k)


# --------------------------------------------------------------------------- shared rows
# Rows whose settings reach every engine the same way (which settings fire them, the engine's
# default); the engine passes in its flags or emitters, and its TABLE splices the rows in at its
# own place (table order is argv order).

Emit = Callable[[Any, PlanContext], list[Out]]


def server_rows(names: Emit) -> tuple[Map, ...]:
    """--host, --port, the served name(s) (`names`: how many the engine takes) and --api-key,
    first on the line, as each engine's OpenAI server spells them."""
    return (Map("host", "--host", always=True),
            Map("port", "--port", always=True),
            Map("served_model_name", emit=names, always=True),
            Map("api_key", "--api-key"))


def kv_cache_dtype_row(literals: Mapping[str, str], known: Iterable[str]) -> Map:
    """kv_cache_dtype as --kv-cache-dtype, through kv_cache_dtype() with the engine's literals."""
    def convert(value: str, ctx: PlanContext) -> str | None:
        return kv_cache_dtype(value, ctx, flag="--kv-cache-dtype", literals=literals, known=known)

    return Map("kv_cache_dtype", "--kv-cache-dtype", convert=convert)


def switch(on: str | None = None, off: str | None = None) -> Emit:
    """An emitter for a boolean setting: the bare flag `on` when true, `off` when false."""
    def emit(value: bool, _: PlanContext) -> list[Out]:
        flag = on if value else off
        return [Arg(flag)] if flag else []

    return emit


def parallel_rows(tp_flag: str, pp_flag: str, nodes: Emit) -> tuple[Map, ...]:
    """Tensor, pipeline and node parallelism. 1 is every engine's default, so only more is sent;
    `nodes` also reads where rank 0 is."""
    return (Map("tensor_parallel_size", tp_flag, engine_default=1),
            Map("pipeline_parallel_size", pp_flag, engine_default=1),
            Map("nnodes", emit=nodes, engine_default=1, also=("node_rank", "dist_init_addr")))


def extension_rows(lora: Emit, speculative: Emit, offload: Emit) -> tuple[Map, ...]:
    """LoRA adapters, speculative decoding and CPU expert offload, in that order. Each row also
    fires on the settings that qualify it (`also`), so its emitter sees them together."""
    return (Map("lora_modules", emit=lora, also=("lora_model_id_template",)),
            Map("max_lora_rank", "--max-lora-rank"),
            Map("speculative_model", emit=speculative,
                also=("num_speculative_tokens", "speculative_method")),
            Map("cpu_offload_experts", emit=offload, engine_default=False, also=KT_SETTINGS))


def ignored_rows(**why: str) -> tuple[Map, ...]:
    """Settings the engine has no counterpart for, each with the note the plan's warning shows
    (the setting is passed over, the server still starts: none changes what the model computes)."""
    return tuple(Map(setting, unsupported="warn", note=note) for setting, note in why.items())
