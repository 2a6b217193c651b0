"""`kiln serve [MODEL]`: resolve, load, serve the OpenAI API (or hand off to vLLM / SGLang)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiln import pidfile, startup, startup_report
from kiln.i18n import coded, msg
from kiln.resolve import parallel
from kiln.settings.sources import add_common_arguments

log = logging.getLogger("kiln.serve")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve", help="serve MODEL over an OpenAI-compatible HTTP API",
        description="Serve MODEL (alias, owner/repo[:QUANT], folder or .gguf; default: the "
        "embedded SmolLM2-135M-Instruct) on http://127.0.0.1:8000/v1. With --engine vllm|sglang, "
        "options kiln does not know, and every argument after `--`, go to the external engine "
        "untouched.")
    p.add_argument("model", nargs="?", metavar="MODEL", help="what to serve")
    add_common_arguments(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from kiln.obs.trace import note_process_start

    note_process_start()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    unknown = list(getattr(args, "unknown_args", None) or [])
    if unknown and _engine_asked(args) == "kiln":
        _refuse_unknown(args, unknown)  # at once, before anything is resolved (exit 2)
    if _wants_router(args):
        return _serve_router(args)
    sp = startup.StartupPlan(args)
    try:
        startup.plan(args, sp)
        s = sp.settings
        assert s is not None
        logging.getLogger().setLevel(s["log_level"].upper())
        engine = s["engine"]
        if engine == "auto":
            engine = _choose_engine(sp)
            if engine == "kiln":
                if unknown:
                    _refuse_unknown(args, unknown)
                startup.commit_to_kiln(sp)  # planned from config.json: now kiln judges it
        if engine != "kiln":
            # Options kiln does not know are the engine's, ahead of those after `--`.
            args.passthrough = unknown + list(getattr(args, "passthrough", []) or [])
            return _serve_external(sp, engine)
        if args.dry_run:
            print(startup_report.describe(sp))
            startup_report.write_artifacts(sp, "dry-run")
            return 0
        return _serve_kiln(sp)
    except KeyboardInterrupt:
        return 130
    except BaseException as e:
        if isinstance(e, SystemExit):
            raise
        return startup_report.fail(sp, e)


def _engine_asked(args: argparse.Namespace) -> str:
    """The engine a person asked for (flag, KILN_ENGINE, config file), before any resolution:
    whether options kiln does not know may go to an external engine. A config file that does
    not load is reported by the normal path."""
    from kiln.errors import KilnError
    from kiln.settings import sources as S

    try:
        layers: list[dict[str, Any]] = [S.cli_values(args), S.env_values(),
                                        S.load_config_file(args.config)[0]]
    except KilnError:
        return "auto"
    for layer in layers:
        if "engine" in layer:
            value = layer["engine"]
            return str(value[0] if isinstance(value, tuple) else value)
    return "kiln"


def _refuse_unknown(args: argparse.Namespace, unknown: list[str]) -> None:
    from kiln.cli import unknown_args_error

    unknown_args_error(args.command_parser, unknown, why="serve.unknown_args")


def _wants_router(args: argparse.Namespace) -> bool:
    """--models (flag, KILN_MODELS or the config file's `models`): the router serves them."""
    from kiln.errors import KilnError
    from kiln.settings import sources as S

    try:
        if "models" in S.cli_values(args) or "models" in S.env_values():
            return True
        file_settings, _, _ = S.load_config_file(args.config)
    except KilnError:  # reported by the normal path, with its phase
        return False
    return "models" in file_settings


def _serve_router(args: argparse.Namespace) -> int:
    """Several models behind one endpoint: kiln/server/model_router.py over a ModelPool whose
    models each run in a `kiln serve` of their own, loaded on first use."""
    import tempfile

    import uvicorn

    from kiln import __version__
    from kiln.errors import KilnError
    from kiln.server.http import uvicorn_config
    from kiln.server.model_pool import ModelPool, child_settings
    from kiln.server.model_router import build_router_app
    from kiln.settings import sources as S
    from kiln.settings.resolve import resolve_settings

    try:
        file_settings, _, path = S.load_config_file(args.config)
        s = resolve_settings(cli=S.cli_values(args), env=S.env_values(), file=file_settings,
                             file_path=path)
        if startup.model_spec(args):
            raise KilnError("give MODEL or --models, not both",
                            hint="add MODEL to --models (NAME=MODEL names it)")
        entries = s["models"]
        if args.dry_run:
            print(json.dumps({"models": entries, "router": {
                k: s[k] for k in ("host", "port", "preload", "keep_alive", "max_loaded_models",
                                  "models_memory", "model_load_timeout")},
                "every model inherits": child_settings(s)}, indent=2, default=str))
            return 0
        _check_port_free(s["host"], s["port"])
    except KilnError as e:
        print(msg("cli.error", phase="config", error=e), file=sys.stderr)
        return e.exit_code
    workdir = Path(tempfile.mkdtemp(prefix="kiln-router-"))
    pool = ModelPool(entries, child_settings(s), keep_alive=s["keep_alive"],
                     max_loaded=s["max_loaded_models"], memory_budget=s["models_memory"],
                     load_timeout=s["model_load_timeout"], workdir=workdir)
    app = build_router_app(pool, api_key=s["api_key"], version=__version__,
                           max_body_bytes=s["max_request_body_bytes"],
                           max_header_bytes=s["max_header_bytes"], preload=s["preload"],
                           ui_pages=s["ui"])
    host, port = s["host"], s["port"]
    server = uvicorn.Server(uvicorn_config(app, host, port, max_header_bytes=s["max_header_bytes"],
                                           drain_timeout=s["drain_timeout"]))
    names = [e["name"] for e in entries]
    record = pidfile.ServerRecord(pid=os.getpid(), port=port, host=host, model=",".join(names),
                                  weights=f"{len(names)} models (router)", engine="router",
                                  version=__version__)
    pid_files = contextlib.ExitStack()
    started = server.startup

    async def startup_and_announce(sockets=None):  # type: ignore[no-untyped-def]
        await started(sockets)
        if server.started:
            _register(pid_files, record)
            print(f"kiln router on http://{host}:{port}/v1 serving {', '.join(names)} "
                  f"(loaded on first use; logs in {workdir})", flush=True)

    server.startup = startup_and_announce  # type: ignore[method-assign]
    server.capture_signals = lambda: _drain_on_signals(server)  # type: ignore[method-assign]
    _freeze_startup_heap()
    with pid_files:
        server.run()  # the app's lifespan stops every model's process on the way out
    print(msg("serve.stopped"), file=sys.stderr)
    return 0


def _check_port_free(host: str, port: int) -> None:
    """Binds (host, port) for a moment, as uvicorn will: a port someone listens on fails here,
    in a second, not after the model has loaded."""
    import socket

    from kiln.errors import KilnError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError as e:
            raise KilnError(msg("serve.port_in_use", host=host, port=port,
                                error=e.strerror or e),
                            hint=msg("serve.port_in_use.hint", port=port)) from None


def _choose_engine(sp: startup.StartupPlan) -> str:
    from kiln.backends import choose_engine, is_engine_available

    s = sp.settings
    assert s is not None
    engine, reason, code = choose_engine(
        "auto", s["tensor_parallel_size"], s["pipeline_parallel_size"], s["nnodes"],
        is_engine_available("vllm", engine_cfg=sp.engines_cfg.get("vllm")))
    s.override("engine", engine, reason, code=code)
    print(msg("serve.engine_chosen", engine=engine, reason=reason), file=sys.stderr)
    return engine


# --------------------------------------------------------------------------- kiln's own engine


def _serve_kiln(sp: startup.StartupPlan) -> int:
    from kiln import __version__
    from kiln.engine.async_engine import AsyncEngine
    from kiln.obs import trace
    from kiln.server.app import build_app
    from kiln.server.chat_output import ChatFormat
    from kiln.server.http import Cors
    from kiln.server.request_params import RequestLimits
    from kiln.server.routes.lora import LoRAOptions

    s = sp.settings
    src = sp.source
    assert s is not None and src is not None
    for w in s.warnings:
        print(msg("cli.warning", warning=w), file=sys.stderr)
    names = s["served_model_name"] or [src.name]
    sp.phase = "port"
    _check_port_free(s["host"], s["port"])  # before the load, which may take minutes

    sp.phase = "load"
    print(msg("serve.loading", name=src.name, path=src.gguf_file or src.path), file=sys.stderr)
    if s["kind"] in ("transcribe", "speech"):
        return _serve_audio(sp, names)
    tokenizer = startup.load_tokenizer(sp)
    if s["kind"] == "embed":
        return _serve_embed(sp, tokenizer, names)
    # The engine is built on its own thread (see kiln/engine/async_engine.py for why).
    aengine = AsyncEngine(lambda: startup.build_engine(sp, tokenizer, progress=_progress_bar()),
                          max_queue=s["max_queue"]).start(wait=False)
    engine = aengine.wait_built()
    cfg, plan = engine.config, engine.runner.plan
    for w in plan.warnings:
        print(msg("cli.warning", warning=w), file=sys.stderr)

    sp.phase = "serve"
    dumper = None
    if s["request_dump_dir"]:
        from kiln.obs.dump import RequestDumper

        dumper = RequestDumper(s["request_dump_dir"], startup_report.config_hash(sp))
    app = build_app(aengine, tokenizer, names, api_key=s["api_key"],
                    max_model_len=engine.max_model_len, version=__version__,
                    limits=RequestLimits.from_settings(s), dumper=dumper, faults=engine.faults,
                    responses_store_size=s["responses_store_size"],
                    coalesce_system=s["interleaved_system_coalescing"],
                    chat=ChatFormat.from_settings(s), cors=Cors.from_settings(s),
                    ui_pages=s["ui"], effective_config=lambda: startup_report.effective_config(sp, "ok"),
                    lora=LoRAOptions.from_settings(s, engine))
    trace.stage("ready")
    startup_report.write_artifacts(sp, "ok")

    def details() -> dict[str, str]:
        return {
            "weights": str(src.gguf_file or src.path),
            "device": f"{cfg.device}, {cfg.dtype}, {engine.runner.config.num_threads or ''}"
                      f"{' threads' if cfg.device == 'cpu' else ''}".rstrip(", "),
            "kv cache": f"{plan.num_blocks} blocks x {plan.block_size} tokens "
                        f"({engine.runner.kv_dtype_name}, {plan.kv_bytes / 2**30:.2f} GiB)",
            "context": f"{engine.max_model_len} tokens",
            "ready in": f"{time.monotonic() - sp.started:.1f} s",
        }

    pages = ["GET /", "GET /dashboard"] if s["ui"] else []  # the chat page, the dashboard
    return _run_server(sp, app, aengine, names, details,
                       ["POST /v1/chat/completions", "POST /v1/completions", *pages])


def _serve_embed(sp: startup.StartupPlan, tokenizer: Any, names: list[str]) -> int:
    """--kind embed: the embedder on its own thread (kiln/kinds/embedding.py), the same app
    (its generating routes refuse with a clear 400) and the same server loop."""
    from kiln import __version__
    from kiln.kinds.embedding import EmbeddingEngine
    from kiln.obs import trace
    from kiln.server.app import build_app
    from kiln.server.http import Cors
    from kiln.server.request_params import RequestLimits

    s, src = sp.settings, sp.source
    assert s is not None and src is not None
    eng = EmbeddingEngine(lambda: startup.build_embedder(sp),
                          max_batch_tokens=s["max_num_batched_tokens"],
                          max_batch_seqs=s["max_num_seqs"], max_queue=s["max_queue"])
    emb = eng.start(wait=False).wait_built()
    sp.phase = "serve"
    app = build_app(eng, tokenizer, names, api_key=s["api_key"],  # type: ignore[arg-type]
                    max_model_len=emb.max_len, version=__version__,
                    limits=RequestLimits.from_settings(s), kind="embed", embedder=eng,
                    cors=Cors.from_settings(s), ui_pages=s["ui"],
                    effective_config=lambda: startup_report.effective_config(sp, "ok"))
    trace.stage("ready")
    startup_report.write_artifacts(sp, "ok")

    def details() -> dict[str, str]:
        return {"weights": str(src.gguf_file or src.path), "kind": f"embed ({emb.description})",
                "dimensions": f"{emb.dim}{', normalized' if emb.pooling.normalize else ''}",
                "context": f"{emb.max_len} tokens per input",
                "batches": f"up to {s['max_num_seqs']} inputs, "
                           f"{s['max_num_batched_tokens']} tokens",
                "ready in": f"{time.monotonic() - sp.started:.1f} s"}

    return _run_server(sp, app, eng, names, details,
                       ["POST /v1/embeddings", "POST /v1/rerank"])


def _serve_audio(sp: startup.StartupPlan, names: list[str]) -> int:
    """--kind transcribe / speech: the audio model on its own thread (kiln/kinds/worker.py),
    the same app (the other kinds' routes refuse with a clear 400) and the same server loop."""
    from kiln import __version__
    from kiln.kinds.worker import AudioWorker
    from kiln.obs import trace
    from kiln.server.app import build_app
    from kiln.server.http import Cors
    from kiln.server.request_params import RequestLimits

    s, src = sp.settings, sp.source
    assert s is not None and src is not None
    kind = s["kind"]
    slots = s["tts_slots"] if kind == "speech" else 1
    if slots > 1 and s["num_threads"]:
        # Each slot's voice gets its share of the threads: N runs at once on N x --threads
        # threads would fight over the cores (recorded, so the effective config says so).
        share = max(1, s["num_threads"] // slots)
        s.override("num_threads", share, f"{s['num_threads']} ({s.source('num_threads')}) "
                   f"shared by {slots} speech slots (--tts-slots)", source=s.source("num_threads"),
                   code="num_threads.tts_slots_share")
    worker = AudioWorker(lambda: startup.build_audio(sp), max_queue=s["max_queue"],
                         name=f"kiln-{kind}", slots=slots)
    model = worker.start(wait=False).wait_built()
    sp.phase = "serve"
    app = build_app(worker, None, names, api_key=s["api_key"],  # type: ignore[arg-type]
                    max_model_len=448 if kind == "transcribe" else 4096, version=__version__,
                    limits=RequestLimits.from_settings(s), kind=kind,
                    cors=Cors.from_settings(s))
    trace.stage("ready")
    startup_report.write_artifacts(sp, "ok")

    def details() -> dict[str, str]:
        slot_note = ({"slots": f"{slots} (each its own voice, {s['num_threads']} thread(s))"}
                     if slots > 1 else {})
        return {"weights": str(src.path), "kind": f"{kind} ({model.description})", **slot_note,
                "ready in": f"{time.monotonic() - sp.started:.1f} s"}

    routes = (["POST /v1/audio/transcriptions", "POST /v1/audio/translations"]
              if kind == "transcribe" else ["POST /v1/audio/speech"])
    rc = _run_server(sp, app, worker, names, details, routes)
    # Drained, traces closed, pid file gone: nothing is left to do, but the interpreter's exit
    # with CTranslate2 / onnxruntime and torch loaded took 3-16 s more (native thread pools
    # torn down after Python's own finalization; measured on a loaded 2-core machine).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _run_server(sp: startup.StartupPlan, app: Any, aengine: Any, names: list[str],
                details: Any, routes: list[str] | None = None) -> int:
    """uvicorn over `app` until SIGINT/SIGTERM (drained), the pid file while it serves."""
    import uvicorn

    from kiln import __version__
    from kiln.backends import format_running_block
    from kiln.engine.async_engine import wait_idle
    from kiln.obs import trace
    from kiln.server.http import uvicorn_config

    s, src = sp.settings, sp.source
    assert s is not None and src is not None
    host, port = s["host"], s["port"]
    server = uvicorn.Server(uvicorn_config(app, host, port, max_header_bytes=s["max_header_bytes"],
                                           drain_timeout=s["drain_timeout"]))

    started = server.startup
    # The pid file (kiln ps / kiln stop) exists from "ready" until the process ends.
    record = pidfile.ServerRecord(pid=os.getpid(), port=port, host=host, model=names[0],
                                  weights=str(src.gguf_file or src.path), version=__version__)
    pid_files = contextlib.ExitStack()

    async def startup_and_announce(sockets=None):  # type: ignore[no-untyped-def]
        await started(sockets)
        if server.started:
            _register(pid_files, record)
            print(format_running_block(names[0], "kiln", host, port, details(), routes),
                  flush=True)

    server.startup = startup_and_announce  # type: ignore[method-assign]
    server.capture_signals = lambda: _drain_on_signals(server)  # type: ignore[method-assign]
    _freeze_startup_heap()
    with pid_files:
        server.run()
        # uvicorn has stopped accepting and waited for in-flight requests (drain_timeout).
        drained = wait_idle(aengine, 1.0)
        aengine.shutdown()  # the engine thread closes (flushes) the step traces
        trace.shutdown_stages()
    print(msg("serve.stopped" if drained else "serve.stopped_cut"), file=sys.stderr)
    return 0


def _freeze_startup_heap() -> None:
    """What loading left on the Python heap (the tokenizer's tables, the model's modules: ~225k
    objects for the MoE benchmark model) lives as long as the server; each full garbage
    collection walked all of it, ~85 ms on 2 cores (AMD EPYC Zen 3), a pause of whatever step it
    fell into (5 of them in ~1,700 steps of c=1 decoding). Frozen, the collector never walks it
    again (vLLM freezes its heap after startup too). In-process c=1 decode of that model, the
    heap frozen vs not, alternated 8 times: 1.02x (6 of 8 faster)."""
    gc.collect()
    gc.freeze()
    log.info("froze the startup heap: %d objects that no full garbage collection walks again",
             gc.get_freeze_count())


@contextlib.contextmanager
def _drain_on_signals(server: Any) -> Iterator[None]:
    """SIGINT/SIGTERM: uvicorn stops accepting and drains in-flight requests. Unlike uvicorn's
    own handler we do not re-raise the signal afterwards: a drained shutdown exits 0."""

    def handler(sig: int, frame: Any) -> None:
        print(msg("serve.draining", signal=signal.Signals(sig).name), file=sys.stderr,
              flush=True)
        server.handle_exit(sig, frame)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _progress_bar():  # type: ignore[no-untyped-def]
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    bar: list[Any] = []

    def update(done: int, total: int) -> None:
        if not bar:
            bar.append(tqdm(total=total, desc="loading weights", unit="tensor", leave=False))
        bar[0].n = done
        bar[0].refresh()
        if done >= total:
            bar[0].close()

    return update


# --------------------------------------------------------------------------- vLLM / SGLang


def _serve_external(sp: startup.StartupPlan, engine: str) -> int:
    from kiln.backends import BackendModel, build_plan, launch, plan_to_dry_run, prepare_launch

    s = sp.settings
    src = sp.source
    assert s is not None and src is not None
    args = sp.args
    entry = src.registry_entry
    if src.format == "remote":
        model_arg = src.repo_id
    elif src.format == "gguf":
        # vLLM/SGLang want an HF folder (their GGUF loaders fetch a tokenizer from the Hub):
        # kiln exports the GGUF once into its cache.
        from kiln.backends.export import export_dir_for, export_gguf_as_hf

        gguf = Path(src.gguf_file or src.path)
        if args.dry_run:
            model_arg = str(export_dir_for(gguf))
        else:
            print(msg("serve.exporting", file=gguf.name, engine=engine), file=sys.stderr)
            model_arg = str(export_gguf_as_hf(gguf))
    else:
        model_arg = str(src.path)
    # MoE-ness and the TP limit from the registry, else from the model's own config.json.
    bm = BackendModel(path=model_arg, served_names=s["served_model_name"] or [src.name],
                      is_moe=parallel.model_is_moe(entry, sp.model_config),
                      max_tp=parallel.model_max_tp(entry, sp.model_config))
    passthrough = list(getattr(args, "passthrough", []) or [])
    ecfg = sp.engines_cfg.get(engine, {})
    sp.phase = "engine"
    if args.dry_run:
        plan = build_plan(engine, s, bm, passthrough=passthrough, engine_cfg=ecfg)
        print(startup_report.describe(sp))
        print(msg("serve.engine_command", engine=engine))
        print(plan_to_dry_run(plan, include_warnings=True))
        sp.extra = {"engine": {"name": engine, "argv": plan.argv, "env": plan.env,
                               "warnings": [coded(w) for w in plan.warnings]}}
        startup_report.write_artifacts(sp, "dry-run")
        return 0
    plan = prepare_launch(engine, s, bm, passthrough=passthrough, engine_cfg=ecfg)
    # What the dry run shows, before the engine takes minutes to start (kt-cli's summary and
    # its "Launching server with command" line): what runs, and why.
    print(startup_report.describe(sp), file=sys.stderr)
    for w in plan.warnings:
        print(msg("cli.warning", warning=w), file=sys.stderr)
    print(msg("serve.launching", command=plan_to_dry_run(plan)), file=sys.stderr, flush=True)
    sp.extra = {"engine": {"name": engine, "argv": plan.argv, "env": plan.env}}
    startup_report.write_artifacts(sp, "ok")
    # kiln supervises the engine (a SIGTERM to kiln drains it), so the pid file names kiln.
    record = pidfile.ServerRecord(pid=os.getpid(), port=s["port"], host=s["host"],
                                  model=bm.served_names[0], weights=model_arg, engine=engine)
    with contextlib.ExitStack() as pid_files:
        return launch(plan, host=s["host"], port=s["port"], drain_timeout_s=s["drain_timeout"],
                      on_ready=lambda: _register(pid_files, record))


def _register(pid_files: contextlib.ExitStack, record: pidfile.ServerRecord) -> None:
    """The pid file from "ready" until `pid_files` closes; a warning if it cannot be written
    (serving matters more than being listed by kiln ps)."""
    try:
        record.started_at = time.time()
        pid_files.enter_context(pidfile.registered(record))
    except OSError as e:
        print(msg("cli.warning", warning=msg("serve.pidfile_unwritable",
                                             path=pidfile.path_for(record.port), error=e)),
              file=sys.stderr)
