"""What `kiln serve`, `kiln run`, the offline `LLM` and `kiln bench --offline` decide before
loading anything, the one way they build the engine, and the record of both.

    probe hardware -> resolve MODEL to files -> read the model's config (no weights)
      -> pick a preset -> resolve every setting (cli > env > file > preset > registry > auto)
      -> fail closed on the device -> [load weights, size the KV pool] -> serve

Each phase is named, so when startup fails the effective-config JSON and the decision trace are
still written, marked `"status": "failed"` with the phase and the error.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from kiln import startup_report
from kiln.errors import ConfigError, KilnError, ModelNotFoundError
from kiln.i18n import english, msg, set_lang
from kiln.kinds import AUDIO_FORMATS
from kiln.layers.kernels import isa as kernel_isa
from kiln.paths import check_cache_dir_writable
from kiln.resolve import ferrum, parallel, speculative
from kiln.settings import sources as S
from kiln.settings import table as C
from kiln.settings.engine_config import EngineConfig
from kiln.settings.resolve import ResolvedSettings, resolve_settings
from kiln.settings.rules import AutoContext
from kiln.startup_plan import StartupPlan


def model_spec(args: argparse.Namespace) -> str | None:
    """MODEL from the positional or -m/--model (the same thing, so both given must agree); the
    `model` row's KILN_MODEL and config-file key come in below them in plan()."""
    positional, option = getattr(args, "model", None), getattr(args, "model_option", None)
    if positional and option and positional != option:
        raise ConfigError(f"two models given: {positional!r} (MODEL) and {option!r} (--model)",
                          hint="give the model once, as MODEL or as --model",
                          code="config.two_models")
    return positional or option


def namespace_for(model: str | None, settings: dict[str, Any], config: Path | None = None
                  ) -> argparse.Namespace:
    """The arguments `kiln serve MODEL --flag value ...` would give, for the offline LLM: its
    keyword settings resolve through the same table, presets and auto rules, with the highest
    precedence (recorded as `LLM(name=...)`)."""
    unknown = sorted(set(settings) - set(C.BY_NAME))
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(unknown)}",
                          hint=f"known settings: {', '.join(sorted(C.BY_NAME))}",
                          code="config.unknown_setting")
    seen = {name: [(value, f"LLM({name}={value!r})")] for name, value in settings.items()}
    return argparse.Namespace(model=model, config=config, dry_run=False,
                              effective_config_json=None, decision_trace_jsonl=None,
                              _kiln_seen=seen)


def plan(args: argparse.Namespace, sp: StartupPlan | None = None) -> StartupPlan:
    """Everything up to (not including) loading weights. Fills `sp` as it goes, so a caller
    that catches a failure knows the phase it happened in."""
    from kiln.models.loader import read_hf_config
    from kiln.resolve import hardware, presets, sources
    from kiln.resolve.device import check_device

    sp = sp or StartupPlan(args)
    sp.phase = "config"
    if not getattr(args, "dry_run", False):  # a dry run writes nothing; serving caches a lot
        check_cache_dir_writable()
    cli = S.cli_values(args)
    env = S.env_values()
    file_settings, sp.engines_cfg, sp.config_file = S.load_config_file(args.config)

    given = model_spec(args)
    if given:  # MODEL (or -m/--model) is the `model` row's CLI value; KILN_MODEL, the file's below
        positional = getattr(args, "model", None) == given
        cli["model"] = (given, "MODEL" if positional else "--model")

    sp.phase = "hardware"
    sp.hardware = hardware.probe_hardware()

    sp.phase = "model"
    # Where to look, whether to download and which engine runs are settings too; take them
    # before the rest, which depend on the model.
    early_names = ("model", "model_path", "model_dirs", "offline", "engine", "device", "lang")
    early = resolve_settings(cli=_only(cli, *early_names), env=_only(env, *early_names),
                             file=_only(file_settings, *early_names))
    if early.source("lang") == "file":
        set_lang(early["lang"])
    if early.source("device") != "default":
        # A device a person asked for is checked before the model is resolved (which may
        # download): `--device cuda` without a GPU fails at once. `auto` is checked below.
        sp.phase = "device"
        try:
            check_device(early["device"], sp.hardware)
        except KilnError:
            sp.settings = early  # the effective config records what was asked (device, lang)
            raise
        sp.phase = "model"
    external = early["engine"] in ("vllm", "sglang")
    dirs = sources.configured_model_dirs(early.get("model_dirs") or [])
    spec = args.model = early["model"]
    model_path = early["model_path"]
    # A dry run never downloads; an external engine downloads by itself what is not local.
    download = not (args.dry_run or external)
    try:
        sp.source = sources.resolve_model(spec, model_dirs=dirs, offline=bool(early["offline"]),
                                          download=download, model_path=model_path)
    except ModelNotFoundError as e:
        remote = (_remote_source(spec, getattr(e, "registry_entry", None))
                  if external and not model_path else None)
        if remote is None:
            raise
        sp.source = remote
    # Plan from config.json alone unless kiln's own engine is sure to load the weights: an
    # external engine (or auto, which may pick one) serves architectures kiln's loader does
    # not know, so they must reach it unjudged. A GGUF's metadata is its config. An audio
    # model has neither: its own runtime reads it (kiln/kinds/).
    audio = sp.source.format in AUDIO_FORMATS
    if audio and external:
        raise ConfigError(f"{sp.source.name} is an audio model ({sp.source.format}): kiln "
                          "serves it itself", hint="drop --engine, or pass --engine kiln")
    if not audio and (sp.source.format == "gguf" or (sp.source.format != "remote"
                                                      and early["engine"] == "kiln")):
        open_for_kiln(sp)
    elif not audio and sp.source.format != "remote":
        sp.model_config = read_hf_config(sp.source.path, require_supported=False)
    mc = sp.model_config

    sp.phase = "settings"
    entry = sp.source.registry_entry
    preset_vals: dict[str, Any] = {}
    explicit_preset = _first(cli, env, file_settings, key="runtime_preset")
    model_kind = _model_kind(sp, mc)
    kind = _first(cli, env, file_settings, key="kind") or "auto"
    if explicit_preset:
        sp.preset = explicit_preset
        sp.preset_reason, sp.preset_code = "asked for", "preset.asked"
    elif not external and (kind if kind != "auto" else model_kind[0]) == "embed":
        sp.preset = "embed"
        sp.preset_reason, sp.preset_code = (
            ("--kind embed", "preset.embed_asked") if kind == "embed" else
            ("--kind auto found an embedding model", "preset.embed_found"))
    elif audio:
        sp.preset_reason = "none: an audio model runs in its own runtime (kiln/kinds/)"
        sp.preset_code = "preset.audio"
    elif external or mc is None:
        sp.preset_reason = "none inferred: the external engine picks its own defaults"
        sp.preset_code = "preset.external_engine"
    else:
        sp.preset, sp.preset_reason, sp.preset_code = presets.infer_preset(
            parallel.preset_info(sp, mc), sp.hardware)
    if sp.preset:
        preset_vals = dict(presets.get_preset(sp.preset).settings)
    hw = sp.hardware
    ctx = AutoContext(
        device="cuda" if hw.has_usable_cuda else "cpu",
        physical_cores=hw.physical_cores or 1,
        ram_available_bytes=hw.ram_available_bytes,
        gpu_count=hw.gpu_count if hw.has_usable_cuda else 0,
        gpu_memory_bytes=min((g.total_memory_bytes for g in hw.gpus), default=0),
        gpu_bf16=any((g.compute_capability or (0, 0))[0] >= 8 for g in hw.gpus),
        cpu_bf16=kernel_isa.cpu_native_bf16(),
        model_max_len=mc.context_length if mc else (entry.context_length
                                                             if entry else None),
        weight_bytes=sp.source.total_bytes,
        model_max_tp=parallel.model_max_tp(entry, mc),
        is_moe=parallel.model_is_moe(entry, mc),
        model_quant=sp.source.quant or (mc.quantization if mc else None),
        numa_nodes=hw.numa_nodes,
        cpu_amx=hw.cpu_amx,  # kt-kernel's AMX: the test check_kt makes
        cpu_kernels=kernel_isa.cpu_has_avx2(),
        model_kind=model_kind,
        model_names=served_names(sp.source),
        model_code=_model_code(sp.source),
    )
    registry_vals = dict(entry.recommended) if entry else {}

    def resolve() -> ResolvedSettings:
        # A preset value for a knob the preset's device does not have is noise; keep it
        # anyway: provenance shows it, and the user may override it.
        return resolve_settings(cli=cli, env=env, file=file_settings,
                                file_path=sp.config_file, preset=preset_vals,
                                preset_name=sp.preset, registry=registry_vals,
                                registry_name=entry.name if entry else None, ctx=ctx)

    s = resolve()
    if sp.preset is None and s["engine"] == "sglang" and s["cpu_offload_experts"] \
            and ctx.is_moe:
        # kt-kernel is on (its own rule decided, from the model and the flags): kt-cli's
        # launch flags come as a preset, below everything a person set.
        sp.preset, sp.preset_reason = "kt", ("SGLang with kt-kernel (an MoE model, experts "
                                             "split GPU/CPU): kt-cli's `kt run` flags")
        sp.preset_code = "preset.kt"
        preset_vals = dict(presets.get_preset("kt").settings)
        s = resolve()
    if s.source("lang") in ("cli", "env", "file"):
        # The CLI chose the language from --lang / KILN_LANG / the locale before this; only the
        # config file is news here (and LLM(lang=...), which has no CLI entry).
        set_lang(s["lang"])
    speculative.unpack_speculative_config(s)
    if sp.preset:
        s.values["runtime_preset"].value = sp.preset
        if s.values["runtime_preset"].source == "default":
            s.values["runtime_preset"].source = "auto"
            s.values["runtime_preset"].reason = sp.preset_reason
            s.values["runtime_preset"].code = sp.preset_code
    if mc is not None:
        _check_model_limits(s, mc.context_length)
    if s["engine"] != "kiln":  # kiln's own engine refuses TP > 1 below, whatever the model
        parallel.reduce_tp_to_model_max(s, parallel.model_max_tp(entry, mc))
    unknown = s["engine"] != "kiln" and entry is None and sp.source.kind in ("folder", "gguf")
    if unknown:
        # kt-cli's notice: a folder it cannot name runs with default parameters.
        s.warnings.append(msg("startup.no_registry_rule", name=sp.source.name,
                              path=sp.source.path))
    parallel.auto_gpu_experts(s, entry, hw, noted=unknown)
    sp.settings = s
    if s["engine"] == "sglang" and s["cpu_offload_experts"] and ctx.is_moe:
        parallel.check_kt(s, sp, hw)

    sp.phase = "device"
    device = check_device(s["device"], hw)  # fails closed before any model work
    if device != s["device"]:
        s.override("device", device, s.values["device"].reason or "resolved",
                   source=s.source("device"))
    if s["engine"] in ("vllm", "sglang"):
        sp.phase = "model"
        speculative.resolve_draft_for_engine(s, dirs, offline=bool(early["offline"]))
    if s["engine"] == "kiln":
        sp.phase = "model"
        speculative.resolve_draft_model(s, dirs, offline=bool(early["offline"]),
                                        download=download)
        sp.phase = "device"
        _check_kiln_engine_supports(s)
        sp.phase = "lora"
        _check_lora_adapters(s)
        sp.phase = "device"
        _check_kind(s, mc, sp.source.format)
        ferrum.answer_flags(s)
        parallel.plan_expert_placement(sp)
        if not args.dry_run:
            _install_stages(s)
    return sp


def _check_lora_adapters(s: ResolvedSettings) -> None:
    """kiln's engine: every --lora adapter's folder read and checked (files, rank, targets)
    before any model work, so a typo fails in a second, not after the weights load."""
    adapters = s["lora_modules"] or []
    if not adapters:
        return
    from kiln.engine.lora import inspect_adapter

    if len(adapters) > s["max_loras"]:
        raise ConfigError(f"{len(adapters)} LoRA adapters given, --max-loras is "
                          f"{s['max_loras']}", hint=f"pass --max-loras {len(adapters)}")
    for item in adapters:
        name, path = item.split("=", 1)
        inspect_adapter(name, path, s["max_lora_rank"])


def _model_kind(sp: StartupPlan, mc: Any) -> tuple[str, str]:
    """What the model's files (or kiln's registry) say it is for, before settings."""
    from kiln.kinds import kind_of

    assert sp.source is not None
    if sp.source.format == "remote":
        return kind_of(None, "", sp.source.registry_entry)
    return kind_of(sp.source.path, mc.architecture if mc is not None else None,
                   sp.source.registry_entry)


def _check_kind(s: ResolvedSettings, mc: Any, fmt: str) -> None:
    """An audio kind for an audio model only (and nothing else for one), an encoder only as an
    embedder."""
    r = s.values["kind"]
    needs = {"transcribe": "ctranslate2", "speech": "piper"}.get(r.value)
    if needs is not None and fmt != needs:
        what = ("a Whisper model in CTranslate2's format (a folder with model.bin and its "
                "config.json), e.g. whisper-tiny.en" if needs == "ctranslate2" else
                "a Piper voice (.onnx with its .onnx.json), e.g. piper-joe")
        raise ConfigError(f"--kind {r.value} ({r.source}) serves {what}; this model is "
                          f"{fmt}", hint="pass such a model, or --kind auto",
                          code="kind.needs_audio_model")
    if needs is None and fmt in AUDIO_FORMATS:
        raise ConfigError(f"this is an audio model ({fmt}): it cannot be served as --kind "
                          f"{r.value} ({r.source})", hint="drop --kind, or pass --kind auto",
                          code="kind.audio_model")
    if r.value == "generate" and mc is not None and mc.is_encoder:
        raise ConfigError(f"{mc.architecture} is an encoder: it has no LM head to generate "
                          f"with ({r.source} asked --kind generate)",
                          hint="serve it with --kind embed (or --kind auto)",
                          code="kind.encoder_cannot_generate")


def _install_stages(s: ResolvedSettings) -> None:
    """Startup stages from here on write --memory-profile-jsonl and fail a startup:STAGE
    fault (kiln/obs/trace.py); the runner marks the stages inside loading."""
    from kiln.obs import trace

    fault = next((f.arg for f in s["diagnostic_faults"] or () if f.kind == "startup"), None)
    trace.install(s["memory_profile_jsonl"], fault)
    trace.stage("settings_resolved")


def open_for_kiln(sp: StartupPlan) -> None:
    """kiln's own loader opens the model (config judged against the architectures kiln's engine
    runs, weight files listed, nothing loaded). plan() does it when the engine is kiln; serve
    when `--engine auto` picks kiln; build_engine in any case."""
    from kiln.models.loader import open_checkpoint

    if sp.checkpoint is not None or sp.source is None or \
            sp.source.format in ("remote", *AUDIO_FORMATS):
        return
    phase, sp.phase = sp.phase, "model"
    sp.checkpoint = open_checkpoint(sp.source.gguf_file or sp.source.path)
    sp.model_config = sp.checkpoint.config
    sp.phase = phase


def commit_to_kiln(sp: StartupPlan) -> None:
    """`--engine auto` picked kiln's own engine after planning: what plan() checks for
    `--engine kiln` (settings it honours, an architecture it runs) is checked now."""
    assert sp.settings is not None
    phase, sp.phase = sp.phase, "device"
    _check_kiln_engine_supports(sp.settings)
    sp.phase = "lora"
    _check_lora_adapters(sp.settings)
    sp.phase = phase
    open_for_kiln(sp)


def _remote_source(spec: str | None, entry: Any = None) -> Any:
    """A model the external engine will fetch itself: a registry alias (or the registry model a
    short name picked, `entry`) or owner/repo that is not on disk. kiln passes the repo id
    through instead of downloading it."""
    from pathlib import Path

    from kiln.resolve.registry import infer_entry, lookup
    from kiln.resolve.sources import ModelSource

    if not spec:
        return None
    if lookup(spec) is None and entry is not None:
        spec = entry.name  # a short name the registry search turned into this model
    entry = lookup(spec)
    repo = entry.hf_repo if entry else (spec if spec.count("/") == 1 and ":" not in spec
                                        and not Path(spec).exists() else None)
    if repo is None:
        return None
    return ModelSource(spec=spec, kind="alias" if entry else "hf", path=Path(repo),
                       format="remote", repo_id=repo, registry_entry=entry or infer_entry(repo),
                       origin="remote (the engine downloads it)")


def served_names(src: Any) -> tuple[str, ...]:
    """What a client may ask for the model by (the served_model_name auto rule's input): the
    name MODEL was given as, then, for a registry alias or an HF id, the registry's id and HF
    repo. A folder's guessed registry entry adds nothing: the guess may be wrong."""
    if src is None:
        return ()
    names = [src.name]
    entry = src.registry_entry
    if entry is not None and src.kind in ("alias", "hf"):
        names += [entry.name, entry.hf_repo]
    out: list[str] = []
    for n in names:
        if n and n.lower() not in {o.lower() for o in out}:
            out.append(n)
    return tuple(out)


def _model_code(src: Any) -> str:
    """The model's own code its config.json's auto_map names ("" when none, or no config.json
    on disk): where an external engine needs --trust-remote-code."""
    import json

    if src is None or src.format == "remote":
        return ""
    folder = src.path if src.path.is_dir() else src.path.parent
    try:
        auto_map = json.loads((folder / "config.json").read_text()).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        return ""
    if not isinstance(auto_map, dict) or not auto_map:
        return ""
    code = auto_map.get("AutoModelForCausalLM") or next(iter(auto_map.values()))
    return str(code[0] if isinstance(code, list) else code)


def _only(d: dict[str, Any], *names: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k in names}


def _first(*layers: dict[str, Any], key: str) -> Any:
    for layer in layers:
        if key in layer:
            v = layer[key]
            return v[0] if isinstance(v, tuple) else v
    return None


def _check_model_limits(s: ResolvedSettings, model_len: int) -> None:
    r = s.values["max_model_len"]
    if r.source in ("preset", "registry", "auto") and r.value > model_len:
        s.override("max_model_len", model_len,
                   f"{r.source} asked {r.value}, capped by the model's context {model_len}")
        s.warnings.append(msg("startup.max_len_capped", asked=r.value, source=r.source,
                              model_len=model_len))


def _check_kiln_engine_supports(s: ResolvedSettings) -> None:
    # Settings the table says kiln's engine does not honour: an error when a person set them,
    # not a silent no-op.
    for spec in C.SETTINGS:
        if "kiln" in spec.engines:
            continue
        r = s.values.get(spec.name)
        if r is not None and r.source in ("cli", "env", "file") and r.value not in (None, False):
            which = msg("startup.engines_or").join(f"--engine {e}" for e in spec.engines)
            hint = "hint_one" if len(spec.engines) == 1 else "hint_many"
            raise ConfigError(msg("startup.not_on_kiln", flag=spec.flags[0]),
                              hint=msg(f"startup.not_on_kiln.{hint}", engines=which))
    # Speculative decoding kiln's engine cannot do (a method, K without one): refused here,
    # before any weights load, by the check the engine itself makes.
    from kiln.engine.spec import spec_config

    spec_config(EngineConfig.from_settings(s, ""))
    # kiln's engine honours these at 1 (one device, one machine); the limit is on the value.
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
        r = s.values[name]
        if r.value and r.value > 1:
            flag = C.setting(name).flags[0]
            raise ConfigError(
                msg("startup.one_device", flag=flag, value=r.value, source=r.source),
                hint=msg("startup.one_device.hint"))


# --------------------------------------------------------------------------- loading


def load_tokenizer(sp: StartupPlan) -> Any:
    from kiln.tokenizer import load_tokenizer as load

    assert sp.source is not None
    sp.phase = "load"
    tok = load(sp.source.path, sp.source.gguf_file)
    record_chat_parsers(sp, tok.chat_template)
    return tok


def record_chat_parsers(sp: StartupPlan, template: str | None) -> None:
    """--tool-call-parser / --reasoning-parser auto: the format the chat template writes,
    decided once the tokenizer (and so the template) is loaded, written back with the reason."""
    from kiln.server import reasoning_parsers, tool_parsers

    s = sp.settings
    if s is None:
        return
    for name, choose in (("tool_call_parser", tool_parsers.choose_for_template),
                         ("reasoning_parser", reasoning_parsers.choose_for_template)):
        if name in s.values and s[name] == "auto":
            value, reason = choose(template)
            s.override(name, value, reason)


def build_engine(sp: StartupPlan, tokenizer: Any, progress: Any = None) -> Any:
    """Loads the planned model into kiln's Engine (the one way `kiln serve`, `kiln run`, the
    offline LLM and `kiln bench --offline` build it), then writes what the load decided back
    into the settings, so the effective config tells what actually runs."""
    from kiln.engine.engine import Engine
    from kiln.settings.engine_config import EngineConfig

    open_for_kiln(sp)
    s, src = sp.settings, sp.source
    assert s is not None and src is not None
    if s["kind"] != "generate":  # kiln run, LLM, bench: they generate
        r = s.values["kind"]
        raise ConfigError(f"{src.name} is served as --kind {r.value} ({r.source}: "
                          f"{r.reason}): it does not generate text",
                          hint="serve it with `kiln serve` (/v1/embeddings, /v1/rerank), or "
                          "pass --kind generate for a causal LM")
    sp.phase = "load"
    t0 = time.monotonic()
    cfg = EngineConfig.from_settings(s, str(src.gguf_file or src.path))
    meta = {"commit_sha": s["profile_commit_sha"], "env_hash": s["profile_env_hash"],
            "model": s["profile_model"] or src.name, "concurrency": s["profile_concurrency"],
            "runtime_flags": s["profile_runtime_flags_json"],
            "config_hash": startup_report.config_hash(sp)
            } if cfg.diagnostics.profile_jsonl else None
    engine = Engine(cfg, ckpt=sp.checkpoint, tokenizer=tokenizer, progress=progress,
                    trace_meta=meta)
    record_engine(sp, engine, time.monotonic() - t0)
    return engine


def build_embedder(sp: StartupPlan) -> Any:
    """--kind embed: the planned model as an embedder (kiln/kinds/embedding.py: an encoder as
    itself, a causal LM by its hidden states); what loading decided (pooling, the longest
    input) is written back into the settings, as build_engine does."""
    from kiln.kinds.embedding import build_embedder as build

    open_for_kiln(sp)
    s, src = sp.settings, sp.source
    assert s is not None and src is not None and sp.checkpoint is not None
    sp.phase = "load"
    t0 = time.monotonic()
    cfg = EngineConfig.from_settings(s, str(src.gguf_file or src.path))
    asked = s["pooling"]
    emb = build(sp.checkpoint, pooling_mode=None if asked == "auto" else asked, dtype=cfg.dtype,
                device=cfg.device, num_threads=cfg.num_threads, max_model_len=s["max_model_len"])
    if asked == "auto":
        s.override("pooling", emb.pooling.mode, emb.pooling.reason, source="engine")
    if emb.max_len != s["max_model_len"]:
        s.override("max_model_len", emb.max_len, "the longest input the embedder takes: "
                   "sentence-transformers' max_seq_length (sentence_bert_config.json), as vLLM "
                   "reads it, or the position limit", source="engine")
    sp.extra = {"engine": {"name": "kiln", "kind": "embed", "embedder": emb.description,
                           "dimensions": emb.dim, "normalize": emb.pooling.normalize,
                           "matryoshka": emb.pooling.matryoshka or emb.pooling.any_dimensions,
                           "max_input_tokens": emb.max_len,
                           "load_seconds": round(time.monotonic() - t0, 2)}}
    return emb


def build_audio(sp: StartupPlan) -> Any:
    """--kind transcribe / speech: the Whisper model or Piper voice in its own runtime
    (kiln/kinds/transcription.py, speech.py); what loading decided (CTranslate2's compute type)
    is written back into the settings, as build_engine does."""
    s, src = sp.settings, sp.source
    assert s is not None and src is not None
    sp.phase = "load"
    t0 = time.monotonic()
    threads = s["num_threads"]
    if s["kind"] == "transcribe":
        from kiln.kinds.transcription import build_transcriber

        # The table's auto rule judges kiln's linears ("not quantized" here): CTranslate2's
        # own choice applies unless a person asked.
        asked = s.source("quantization") in ("cli", "env", "file")
        model = build_transcriber(src.path, device=s["device"],
                                  quantization=s["quantization"] if asked else "auto",
                                  dtype=s["dtype"] if s.source("dtype") in ("cli", "env", "file")
                                  else "auto", num_threads=threads)
        s.override("quantization", "int8" if "int8" in model.compute_type else "none",
                   f"CTranslate2 compute type {model.compute_type}: {model.compute_reason}",
                   source="engine")
        facts: dict[str, Any] = {"compute_type": model.compute_type,
                                 "multilingual": model.multilingual}
    else:
        from kiln.kinds.speech import build_voice

        model = build_voice(src.files[0], device=s["device"], num_threads=threads)
        facts = {"sample_rate": model.sample_rate, "speakers": sorted(model.speakers)}
    sp.extra = {"engine": {"name": "kiln", "kind": s["kind"], "runtime": model.description,
                           **facts, "load_seconds": round(time.monotonic() - t0, 2)}}
    return model


def record_engine(sp: StartupPlan, engine: Any, load_seconds: float) -> None:
    s = sp.settings
    assert s is not None
    plan = engine.runner.plan
    if plan.max_model_len < (s["max_model_len"] or plan.max_model_len):
        s.override("max_model_len", plan.max_model_len, english(plan.warnings[0])
                   if plan.warnings else "lowered to fit the KV pool", source="engine")
    s.warnings.extend(plan.warnings)
    decisions = engine.runner.decisions.to_dict()
    for name, setting in (("kv_cache_dtype", "kv_cache_dtype"), ("compiled", "compile"),
                          ("dense_weights", "dense_weights")):
        d, r = decisions[name], s.values[setting]
        if d["value"] != r.value:
            # What ran differs from what was resolved (compile on, but the layer kernel leaves
            # nothing to compile; a dense copy asked for, but int4 kernel layers keep none).
            s.override(setting, d["value"], f"{d['reason']} (resolved {r.value!r} from "
                       f"{r.source})", source="engine", code=d["code"])
    placement = engine.runner.placement
    sp.extra = {"engine": {"name": "kiln", "load_seconds": round(load_seconds, 2),
                           "decode_path": decisions["decode_path"]["value"],
                           "kv_blocks": plan.num_blocks, "kv_block_size": plan.block_size,
                           "kv_token_capacity": plan.token_capacity,
                           "kv_dtype": engine.runner.kv_dtype_name,
                           "kv_bytes": plan.kv_bytes, "weight_bytes": plan.weight_bytes,
                           "activation_bytes": plan.activation_bytes,
                           "max_model_len": engine.max_model_len},
                "decisions": {"kv_pool": {"chosen": plan.num_blocks, "reason": plan.reason},
                              **{k: {"chosen": d["value"], "reason": d["reason"],
                                     "code": d["code"]} for k, d in decisions.items()}}}
    if placement is not None:
        parallel.record_placement(sp, placement, source="engine")
