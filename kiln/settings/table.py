"""One table of settings: every setting kiln knows, declared once.

Each row of `SETTINGS` gives a setting's name, parser, default or auto rule (kiln/settings/rules.py),
CLI flag(s) (vLLM's spelling first where vLLM has the same knob), env var `KILN_<NAME>`,
config-file key (the name), what it affects and which engines honour it. The CLI flags,
`--dry-run`, the effective-config JSON, the decision trace and docs/flags.md are all generated
from this table, so they cannot disagree. This module is the table (and the one parser that reads
it, `--models`); resolving it with provenance is kiln/settings/resolve.py, the engine's frozen view
kiln/settings/engine_config.py. It stays one declarative table past 600 lines: tests/unit/test_settings_table.py
keeps its rows consistent (names, flags and env vars unique, defaults parse and are among the
choices), and tests/unit/test_docs.py keeps docs/flags.md what the table generates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.errors import ConfigError
from kiln.settings.rules import (
    AutoRule,
    auto_batched_tokens,
    auto_cpu_isa,
    auto_cpu_offload_experts,
    auto_dense_weights,
    auto_device,
    auto_dtype,
    auto_engine,
    auto_kind,
    auto_kt_cpuinfer,
    auto_kt_gpu_prefill_token_threshold,
    auto_kt_method,
    auto_kt_threadpool_count,
    auto_kv_cache_dtype,
    auto_lang,
    auto_max_model_len,
    auto_max_num_seqs,
    auto_num_speculative_tokens,
    auto_quantization,
    auto_served_model_name,
    auto_spec_disable_by_batch_size,
    auto_threads,
    auto_tp,
    auto_trust_remote_code,
)
from kiln.settings.values import (
    fraction,
    non_negative_int,
    parse_bool,
    parse_bytes,
    parse_duration,
    parse_env_hash,
    parse_faults,
    parse_http_list,
    parse_json_object,
    parse_lora_modules,
    parse_name_list,
    parse_str_list,
    positive_bytes,
    positive_int,
    positive_int_or_auto,
    positive_wait_ms,
)

# --------------------------------------------------------------------------- parsers that read the table


def parse_models(value: Any) -> list[dict[str, Any]]:
    """--models / KILN_MODELS / the config file's `models` -> [{"name", "model", "settings"}].

    'a,b' or ['a', 'b']: each MODEL (alias, owner/repo[:QUANT], folder, .gguf) served under its
    own name (the alias or id as written; a path's file or folder name), or 'NAME=MODEL';
    a TOML table `[models.NAME]` with `model = ...` and any other settings for that model
    alone. Names must be unique; settings are checked here, before anything loads."""
    if isinstance(value, dict):
        items: list[Any] = [{"name": k, **(v if isinstance(v, dict) else {"model": v})}
                            for k, v in value.items()]
    elif isinstance(value, list):
        items = value
    else:
        items = [v.strip() for v in str(value).split(",") if v.strip()]
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, dict):
            entry = dict(item)
            name, model = entry.pop("name", None), entry.pop("model", None)
        else:
            name, sep, model = str(item).partition("=")
            if not sep:
                name, model = _default_model_name(str(item)), str(item)
        if not model:
            raise ValueError(f"models entry {name!r} has no model (give `model = ...`)")
        name = str(name or _default_model_name(str(model)))
        settings = {} if not isinstance(item, dict) else {k.replace("-", "_"): v
                                                          for k, v in entry.items()}
        for key, raw in settings.items():
            if key not in BY_NAME or key in ROUTER_SETTINGS:
                raise ValueError(f"models entry {name!r}: {key!r} is not a per-model setting")
            BY_NAME[key].parse(raw)
        if any(e["name"] == name for e in out):
            raise ValueError(f"two models are named {name!r}: name them (NAME=MODEL)")
        out.append({"name": name, "model": str(model), "settings": settings})
    if not out:
        raise ValueError("no models given")
    return out


def _default_model_name(model: str) -> str:
    """What a --models entry is called when no NAME= is given: an alias or Hugging Face id as
    written; a local file or folder by its name (SmolLM2-135M-Instruct.Q4_1.gguf ->
    SmolLM2-135M-Instruct.Q4_1)."""
    import os

    path = os.path.expanduser(model)
    if os.path.exists(path):
        base = os.path.basename(os.path.normpath(path))
        return base[:-5] if base.lower().endswith(".gguf") else base
    return model


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Setting:
    name: str
    parse: Callable[[Any], Any]
    default: Any = None
    help: str = ""
    flags: tuple[str, ...] = ()  # first is canonical, the rest are aliases
    neg_flags: tuple[str, ...] = ()  # booleans: flags that set False
    choices: tuple[Any, ...] | None = None
    affects: str = "performance"  # correctness | performance | memory | observability | server
    auto: AutoRule | None = None
    group: str = "engine"
    metavar: str | None = None
    # Who honours the setting. "kiln" is kiln itself: its own engine, or its front-end (finding
    # the model and the engine, presets, draining). "vllm"/"sglang": that backend's table hands
    # it to the engine. A setting without "kiln" is refused on kiln's own engine when a person
    # set it; one without an external engine is not translated for it (nor warned about).
    engines: tuple[str, ...] = ("kiln", "vllm", "sglang")
    # The flag may be given several times; the values are collected into one list.
    repeatable: bool = False
    nargs: str | None = None  # argparse's: "+" takes several values per flag (vLLM's lists)

    @property
    def env_var(self) -> str:
        return "KILN_" + self.name.upper()

    @property
    def is_bool(self) -> bool:
        return self.parse is parse_bool


SETTINGS: list[Setting] = [
    # -- server
    Setting("host", str, "127.0.0.1", "address to bind (default loopback only)", ("--host",),
            affects="server", group="server"),
    Setting("port", positive_int, 8000, "port to listen on", ("--port", "-p"), affects="server",
            group="server"),
    # ferrum's spelling (`--served-model-name a --served-model-name b`) or `a,b`; not vLLM's
    # `a b`, which would swallow a MODEL given after it. Unset: the name MODEL was given as,
    # then its registry id and HF repo, so a client may ask by either (as ferrum serves the
    # requested name and the canonical id).
    Setting("served_model_name", parse_name_list, None,
            "names the API serves the model as (first is primary; repeatable or "
            "comma-separated; auto: MODEL as given, then its registry id and HF repo)",
            ("--served-model-name",), affects="server", group="server", metavar="NAME",
            auto=auto_served_model_name, repeatable=True),
    Setting("api_key", str, None, "require 'Authorization: Bearer KEY' on /v1", ("--api-key",),
            affects="server", group="server"),
    Setting("drain_timeout", float, 30.0,
            "seconds to let in-flight requests finish on SIGINT/SIGTERM", ("--drain-timeout",),
            affects="server", group="server", engines=("kiln",)),
    Setting("max_queue", positive_int, 1024,
            "waiting requests beyond which the server answers 503", ("--max-queue",),
            affects="server", group="server", engines=("kiln", "sglang")),
    # Caps on what one request may ask for: far above what honest clients send (OpenAI allows
    # n <= 128 and 4 stop sequences), low enough that one request cannot occupy the engine or
    # its memory for everyone else ("n": 1000000 once queued 242k sequences and 6 GB).
    Setting("max_n", positive_int, 128,
            "most sequences one request may start (n, best_of; n x prompts)", ("--max-n",),
            affects="server", group="server", engines=("kiln",)),
    Setting("max_stop_sequences", positive_int, 64,
            "most stop strings, and most stop token ids, one request may give",
            ("--max-stop-sequences",), affects="server", group="server", engines=("kiln",)),
    Setting("max_stop_length", positive_int, 1024,
            "longest stop string, in characters", ("--max-stop-length",),
            affects="server", group="server", engines=("kiln",)),
    # /v1/responses keeps finished responses (and their conversations) for
    # previous_response_id and GET /v1/responses/{id}: in memory, least recently used go first.
    Setting("responses_store_size", positive_int, 1024,
            "most /v1/responses answers kept for previous_response_id and GET (LRU)",
            ("--responses-store-size",), affects="server", group="server", metavar="N",
            engines=("kiln",)),
    # Some chat templates raise on a system message that is not the first; ferrum's flag.
    Setting("interleaved_system_coalescing", parse_bool, False,
            "merge every system message into one at the start of the conversation (templates "
            "that refuse a later system message then render; off: such a request is a 400)",
            ("--enable-interleaved-system-coalescing",),
            neg_flags=("--disable-interleaved-system-coalescing",), affects="correctness",
            group="server", engines=("kiln",)),
    # -- chat output: tool calls and reasoning (kiln/server/tool_parsers.py, reasoning_parsers.py)
    Setting("tool_call_parser", str, "auto",
            "how tool calls are read out of the model's text (auto: the format the chat template "
            "writes, decided when the tokenizer loads; none: calls stay text)",
            ("--tool-call-parser",), choices=("auto", "none", "hermes", "llama3_json", "mistral"),
            affects="correctness", group="server", engines=("kiln",)),
    Setting("enable_auto_tool_choice", parse_bool, True,
            "read tool calls for tool_choice auto (vLLM wants this flag; kiln has it on: off "
            "leaves the calls of tool_choice auto in the content)",
            ("--enable-auto-tool-choice",), neg_flags=("--no-enable-auto-tool-choice",),
            affects="correctness", group="server", engines=("kiln",)),
    Setting("reasoning_parser", str, "auto",
            "split <think>...</think> into the message's reasoning_content (auto: when the chat "
            "template knows <think>; none: it stays in the content)",
            ("--reasoning-parser",), choices=("auto", "none", "qwen3", "deepseek_r1"),
            affects="correctness", group="server", engines=("kiln",)),
    Setting("enable_thinking", parse_bool, None,
            "the chat template's enable_thinking for requests whose chat_template_kwargs do not "
            "set it (unset: the template's own default)",
            ("--enable-thinking",), neg_flags=("--disable-thinking",), affects="correctness",
            group="server", engines=("kiln",)),
    # HTTP limits, checked before a request reaches the API: a body over the limit is a 413
    # from its Content-Length (or as soon as a chunked body passes it), never read whole; the
    # request line and headers together beyond the header limit are a 431.
    Setting("max_request_body_bytes", positive_bytes, 32 << 20,
            "largest request body accepted (413 beyond)", ("--max-request-body-bytes",),
            affects="server", group="server", engines=("kiln",), metavar="BYTES"),
    Setting("max_header_bytes", positive_bytes, 64 << 10,
            "largest request line + headers accepted (431 beyond)", ("--max-header-bytes",),
            affects="server", group="server", engines=("kiln",), metavar="BYTES"),
    # CORS is off unless origins are named: a browser page from elsewhere cannot call the API
    # (vLLM's flags, but vLLM allows every origin by default).
    Setting("allowed_origins", parse_http_list, None,
            "origins browsers may call the API from (CORS; off unless set; '*' for any)",
            ("--allowed-origins",), affects="server", group="server", engines=("kiln",),
            metavar="A,B"),
    Setting("allowed_methods", parse_http_list, ["*"],
            "CORS: methods allowed from those origins", ("--allowed-methods",),
            affects="server", group="server", engines=("kiln",), metavar="A,B"),
    Setting("allowed_headers", parse_http_list, ["*"],
            "CORS: request headers allowed from those origins", ("--allowed-headers",),
            affects="server", group="server", engines=("kiln",), metavar="A,B"),
    Setting("allow_credentials", parse_bool, False,
            "CORS: allow cookies / credentials from those origins", ("--allow-credentials",),
            affects="server", group="server", engines=("kiln",)),
    # -- several models behind one endpoint (kiln/server/model_router.py): a router process
    # starts one `kiln serve` per model when a request first names it and stops it when idle.
    Setting("models", parse_models, None,
            "serve several models behind this one endpoint: MODEL or NAME=MODEL, comma-"
            "separated (or a [models.NAME] table per model in the config file), each loaded "
            "when a request first names it", ("--models",), affects="server", group="server",
            metavar="A,B", engines=("kiln",)),
    Setting("preload", parse_bool, False, "with --models: load every model at start",
            ("--preload",), neg_flags=("--no-preload",), affects="server", group="server",
            engines=("kiln",)),
    Setting("keep_alive", parse_duration, 300.0,
            "with --models: how long an idle model stays loaded (Ollama's keep_alive: 300, "
            "'5m', 0 = unload after each request, -1 = forever); a request's keep_alive field "
            "overrides it for its model", ("--keep-alive",), affects="server", group="server",
            metavar="DURATION", engines=("kiln",)),
    Setting("max_loaded_models", positive_int, None,
            "with --models: most models loaded at once (unset: as many as memory allows); "
            "the least recently used idle one is unloaded first", ("--max-loaded-models",),
            affects="memory", group="server", metavar="N", engines=("kiln",)),
    Setting("models_memory", positive_bytes, None,
            "with --models: memory the loaded models may use together (unset: what the "
            "machine has available, less 1 GiB)", ("--models-memory",), affects="memory",
            group="server", metavar="BYTES", engines=("kiln",)),
    Setting("model_load_timeout", float, 600.0,
            "with --models: seconds a request waits for its model to load before a 503",
            ("--model-load-timeout",), affects="server", group="server", metavar="SECONDS",
            engines=("kiln",)),
    # The browser pages (kiln/ui/): a chat at / and a dashboard at /dashboard.
    Setting("ui", parse_bool, True,
            "serve the chat page at / and the dashboard at /dashboard (--no-ui: neither)",
            ("--ui",), neg_flags=("--no-ui",), affects="server", group="server",
            engines=("kiln",)),
    # -- model
    # MODEL itself: the positional and -m/--model are its CLI (kiln/startup.py records them as
    # this row's cli value); KILN_MODEL and the config file's `model` give a default model.
    Setting("model", str, None,
            "what to serve when MODEL is not given: alias, owner/repo[:QUANT], folder or .gguf",
            (), affects="correctness", group="model", engines=("kiln",)),
    Setting("model_path", str, None,
            "the model's files when MODEL names a registry model (kt-cli's --model-path: the "
            "registry's rules apply to this folder, nothing is downloaded); without MODEL, the "
            "model to serve", ("--model-path",), affects="correctness", group="model",
            metavar="PATH", engines=("kiln",)),
    Setting("offline", parse_bool, False, "never download; use local files only",
            ("--offline",), affects="correctness", group="model"),
    Setting("model_dirs", parse_str_list, None, "extra folders searched for models",
            ("--model-dir",), affects="correctness", group="model", metavar="DIR",
            engines=("kiln",)),
    Setting("kind", str, "auto",
            "what the model serves: generate (chat, completions), embed (/v1/embeddings, "
            "/v1/rerank; a causal LM then embeds with its hidden states), transcribe "
            "(/v1/audio/transcriptions: a Whisper model), speech (/v1/audio/speech: a Piper "
            "voice) (auto: from the model's config and files)", ("--kind",),
            choices=("auto", "generate", "embed", "transcribe", "speech"),
            affects="correctness", auto=auto_kind, group="model", engines=("kiln",)),
    # ferrum's --tts-slots: one voice per slot, each on its own thread (kiln/kinds/worker.py).
    Setting("tts_slots", positive_int, 1,
            "--kind speech: voices loaded, each on its own thread, so N /v1/audio/speech requests "
            "are synthesized at once, --threads shared among them (ferrum's --tts-slots; "
            "ferrum's default is 2, kiln's 1: one request at a time on every thread)",
            ("--tts-slots",), affects="performance", group="model", metavar="N",
            engines=("kiln",)),
    Setting("pooling", str, "auto",
            "--kind embed: how token states become one vector (auto: the model's "
            "sentence-transformers 1_Pooling config; else CLS for an encoder, the last token "
            "for a decoder)", ("--pooling",), choices=("auto", "mean", "cls", "last", "max"),
            affects="correctness", group="model", engines=("kiln",)),
    # -- engine
    Setting("engine", str, "kiln", "which engine runs the model", ("--engine",),
            choices=("kiln", "vllm", "sglang", "auto"), affects="correctness",
            auto=auto_engine, engines=("kiln",)),
    Setting("engine_command", str, None, "command that starts the external engine",
            ("--engine-command",), affects="correctness", engines=("kiln",)),
    Setting("runtime_preset", str, None, "a named bundle of settings", ("--runtime-preset",),
            affects="performance", engines=("kiln",)),
    Setting("device", str, "auto", "device to run on: auto, cpu, cuda or cuda:N", ("--device",),
            affects="correctness", auto=auto_device),
    Setting("dtype", str, "auto", "weight and activation dtype", ("--dtype",),
            choices=("auto", "float32", "bfloat16", "float16"), affects="correctness",
            auto=auto_dtype),
    Setting("quantization", str, "auto",
            "weight-only quantization of linear layers at load (auto: on CPU, follow the "
            "GGUF's own: Q4 -> int4, Q5-Q8 -> int8)", ("--quantization", "-q"),
            choices=("auto", "none", "int8", "int4"), affects="correctness",
            auto=auto_quantization, engines=("kiln", "sglang")),
    Setting("dense_weights", parse_bool, None,
            "with --quantization, also keep a bf16 copy of the weights for prefill and large "
            "batches (auto: on CPU when it fits in 1/4 of available RAM)",
            ("--dense-weights",), neg_flags=("--no-dense-weights",), affects="memory",
            auto=auto_dense_weights, engines=("kiln",)),
    Setting("num_threads", positive_int, None, "CPU threads for compute",
            ("--threads", "--num-threads"), affects="performance", auto=auto_threads,
            engines=("kiln", "sglang")),
    Setting("seed", int, 0, "random seed for requests without their own", ("--seed",),
            affects="correctness"),
    Setting("max_model_len", positive_int, None, "context length (prompt + output)",
            ("--max-model-len", "--context-length"), affects="memory", auto=auto_max_model_len),
    Setting("max_num_seqs", positive_int, None, "most sequences in one step",
            ("--max-num-seqs", "--max-running-requests"), affects="performance",
            auto=auto_max_num_seqs),
    Setting("max_num_batched_tokens", positive_int, None, "token budget of one step",
            ("--max-num-batched-tokens", "--chunked-prefill-size"), affects="performance",
            auto=auto_batched_tokens),
    # ferrum's scheduler knobs (kiln/engine/scheduler.py), off unless set: kiln's one rule
    # (decodes first, then prompts in budget-sized chunks) is what runs without them.
    Setting("sequence_fit_policy", str, "immediate-only",
            "when a waiting request is admitted: immediate-only (its first chunk's KV blocks "
            "are free) or full-input-must-fit (its whole prompt's are: no admission that "
            "preemption undoes halfway)", ("--sequence-fit-policy",),
            choices=("immediate-only", "full-input-must-fit"), affects="performance",
            engines=("kiln",)),
    Setting("scheduler_prefill_first_until_active", positive_int, None,
            "while fewer than N requests decode and prompts wait, steps prefill only: the "
            "waiting cohort catches up and decodes with the rest (TTFT down, a pause in the "
            "decodes)", ("--scheduler-prefill-first-until-active",), affects="performance",
            metavar="N", engines=("kiln",)),
    Setting("scheduler_prefill_step_chunk", positive_int, None,
            "most prompt tokens one request prefills in a step (unset: the step's budget; "
            "vLLM: --long-prefill-token-threshold)",
            ("--scheduler-prefill-step-chunk",), affects="performance", metavar="TOKENS",
            engines=("kiln", "vllm")),
    Setting("scheduler_active_decode_prefill_chunk", positive_int, None,
            "most prompt tokens all requests together prefill in a step that also decodes "
            "(keeps the decodes' inter-token latency down; unset: the step's budget)",
            ("--scheduler-active-decode-prefill-chunk",), affects="performance",
            metavar="TOKENS", engines=("kiln",)),
    # ferrum's --greedy-argmax: temperature-0 rows picked by an argmax on the device, only the
    # ids leaving it. kiln's sampler has no other greedy path (kiln/engine/sampler.py), so the
    # row records that, and off is noted, not obeyed (kiln/resolve/ferrum.py).
    Setting("greedy_argmax", parse_bool, True,
            "temperature-0 rows take the argmax of their logits where the logits are, with no "
            "softmax and no logprobs unless asked (kiln's only greedy path; vLLM and SGLang do "
            "the same; ferrum's --disable-greedy-argmax is noted and changes nothing)",
            ("--greedy-argmax",), neg_flags=("--disable-greedy-argmax",),
            affects="performance", engines=("kiln",)),
    Setting("block_size", positive_int, 16, "tokens per KV cache block",
            ("--block-size", "--kv-block-size"), affects="memory"),
    Setting("kv_cache_dtype", str, "auto", "KV cache storage dtype",
            ("--kv-cache-dtype", "--kv-dtype"),
            choices=("auto", "fp32", "bf16", "fp16", "int8"), affects="memory",
            auto=auto_kv_cache_dtype),
    Setting("gpu_memory_utilization", fraction, 0.9,
            "fraction of GPU memory kiln may use (weights + activations + KV)",
            ("--gpu-memory-utilization", "--mem-fraction-static"), affects="memory"),
    Setting("cpu_memory_utilization", fraction, 0.7,
            "fraction of available RAM the KV pool may take after the weights",
            ("--cpu-memory-utilization",), affects="memory", engines=("kiln",)),
    Setting("kv_cache_memory", parse_bytes, None, "KV pool size in bytes (overrides fractions)",
            ("--kv-cache-memory",), affects="memory", metavar="BYTES", engines=("kiln", "vllm")),
    Setting("kv_max_blocks", positive_int, None, "cap on the number of KV blocks",
            ("--kv-max-blocks",), affects="memory"),
    Setting("enable_prefix_caching", parse_bool, True, "reuse KV blocks of shared prefixes",
            ("--enable-prefix-caching", "--enable-prefix-cache"),
            neg_flags=("--no-enable-prefix-caching", "--disable-prefix-cache"),
            affects="performance"),
    Setting("compile", parse_bool, False, "torch.compile the decode step", ("--compile",),
            neg_flags=("--no-compile",), affects="performance"),
    Setting("batch_invariant", parse_bool, True,
            "a greedy request's tokens and logprobs do not depend on the batch it runs in, the "
            "chunking of its prefill or prefix-cache hits: attention per row in one fixed order "
            "(kiln's attend_rows kernel), one kernel per layer whatever the step's row count, decode "
            "steps as one call per layer of the kernels the eager steps chain, and off: "
            "torch.compile of decode (its fused graphs round differently from the eager steps "
            "that mix decodes with prefill) and cascade attention (another merge order for "
            "shared prefixes)",
            ("--batch-invariant",), neg_flags=("--no-batch-invariant",), affects="correctness",
            engines=("kiln",)),
    Setting("cpu_kernels", parse_bool, True,
            "kiln's C++ CPU kernels (int4 and GGUF-block linears, grouped MoE, batch-invariant "
            "attention, the one-call layer; x86 with AVX2 or better, built once per machine)",
            ("--cpu-kernels",), neg_flags=("--no-cpu-kernels",), affects="performance",
            engines=("kiln",)),
    Setting("cpu_isa", str, "auto",
            "the instruction level kiln's CPU kernels run at: auto (the best this CPU and OS "
            "run: avx512 where AVX512 F/BW/VL/DQ/VNNI run, else avx2) or a lower one; every "
            "level computes the same numbers (kiln/layers/kernels/isa.py)",
            ("--cpu-isa",), choices=("auto", "avx512", "avx2"), affects="performance",
            auto=auto_cpu_isa, engines=("kiln",)),
    Setting("adaptive_threads", parse_bool, True,
            "while other processes keep some of the CPUs kiln may run on busy, run fewer compute "
            "threads (one per CPU left, at least 1; back up to --threads once they free), so no "
            "parallel region waits for a thread the OS gave away (kiln/layers/kernels/threads.py)",
            ("--adaptive-threads",), neg_flags=("--no-adaptive-threads",),
            affects="performance", engines=("kiln",)),
    Setting("gguf_kernels", parse_bool, True,
            "with --quantization on CPU, run a GGUF's Q8_0/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K blocks as "
            "they are (kiln's GGUF-block kernels, no re-quantization); off: re-quantize them to "
            "--quantization's int4/int8",
            ("--gguf-kernels",), neg_flags=("--no-gguf-kernels",), affects="correctness",
            engines=("kiln",)),
    Setting("tile_cache", parse_bool, True,
            "keep a GGUF's weights as kiln repacked them (a Q4_0/Q4_1 file's MoE experts in "
            "int4 tiles; the other weights past 32 MB, as moved to huge pages) in kiln's cache "
            "folder (tiles/, about their size) and map them at later starts instead of "
            "repacking or copying (kiln/layers/tile_cache.py)",
            ("--tile-cache",), neg_flags=("--no-tile-cache",), affects="performance",
            engines=("kiln",)),
    Setting("tensor_parallel_size", positive_int, None, "GPUs per model replica (external engines)",
            ("--tensor-parallel-size", "-tp", "--tp"), affects="performance", auto=auto_tp),
    Setting("pipeline_parallel_size", positive_int, 1, "pipeline stages (external engines)",
            ("--pipeline-parallel-size", "-pp"), affects="performance"),
    Setting("nnodes", positive_int, 1, "machines the external engine spans (Ray for vLLM)",
            ("--nnodes",), affects="performance"),
    Setting("node_rank", non_negative_int, 0,
            "this machine's rank among --nnodes (0 is the head node)", ("--node-rank",),
            affects="correctness", engines=("vllm", "sglang")),
    Setting("dist_init_addr", str, None,
            "HOST:PORT of the rank-0 node, the same on every node (SGLang multi-node)",
            ("--dist-init-addr",), affects="correctness", metavar="HOST:PORT",
            engines=("vllm", "sglang")),
    # -- LoRA adapters (kiln's engine: kiln/engine/lora.py; handed to vLLM / SGLang)
    Setting("lora_modules", parse_lora_modules, None,
            "LoRA adapter(s) to serve: NAME=PATH (a PEFT folder; a bare PATH is named after its "
            "folder) or vLLM's JSON {\"name\": ..., \"path\": ...}; several per flag, and the "
            "flag repeatable", ("--lora-modules", "--lora"), affects="correctness",
            metavar="NAME=PATH", nargs="+", repeatable=True),
    Setting("lora_model_id_template", str, "<name>",
            "the model id a LoRA adapter is asked for by: <name> (the adapter's) and <base> "
            "(the served model name), e.g. '<base>:<name>'", ("--lora-model-id-template",),
            affects="server", metavar="TEMPLATE"),
    Setting("max_loras", positive_int, 8,
            "most LoRA adapters loaded at once (kiln's engine mixes all of them in one batch; "
            "vLLM / SGLang: adapters per batch)", ("--max-loras",), affects="memory"),
    Setting("max_lora_rank", positive_int, 16, "largest LoRA rank an adapter may have",
            ("--max-lora-rank",), affects="memory"),
    Setting("enable_lora_runtime_updates", parse_bool, False,
            "POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING)", ("--enable-lora-runtime-updates",),
            affects="server"),
    # -- speculative decoding (external engines)
    Setting("speculative_model", str, None,
            "draft model for speculative decoding, resolved like MODEL (alias, folder, GGUF, "
            "cached id); it must share the model's tokenizer",
            ("--speculative-model", "--speculative-draft-model-path", "--spec-draft"),
            affects="performance", metavar="DRAFT"),
    Setting("speculative_config", parse_json_object, None,
            "vLLM's form of the three above, a JSON object: model, num_speculative_tokens, "
            "method (draft_model = draft), prompt_lookup_min / _max, disable_by_batch_size; "
            "unpacked into them",
            ("--speculative-config",), affects="performance", metavar="JSON",
            engines=("kiln",)),
    Setting("speculative_method", str, None,
            "speculative decoding method (default: a separate draft model; kiln's engine: "
            "ngram, prompt lookup in the request's own tokens)",
            ("--speculative-method",), choices=("draft", "eagle", "eagle3", "ngram", "mtp"),
            affects="performance"),
    Setting("num_speculative_tokens", positive_int_or_auto, None,
            "tokens the draft proposes per step (kiln's engine: auto follows the measured "
            "acceptance, 1-8)", ("--num-speculative-tokens", "--spec-tokens"),
            affects="performance", auto=auto_num_speculative_tokens),
    Setting("ngram_prompt_lookup_min", positive_int, 2,
            "ngram speculation: shortest suffix looked up in the request's tokens (vLLM's "
            "prompt_lookup_min)", ("--ngram-prompt-lookup-min",), affects="performance",
            engines=("kiln",)),
    Setting("ngram_prompt_lookup_max", positive_int, 5,
            "ngram speculation: longest suffix looked up, tried first (vLLM's "
            "prompt_lookup_max)", ("--ngram-prompt-lookup-max",), affects="performance",
            engines=("kiln",)),
    Setting("speculative_disable_by_batch_size", positive_int, None,
            "speculative decoding drafts only while at most this many requests are decoding "
            "(vLLM's disable_by_batch_size); above it, steps run without drafts",
            ("--speculative-disable-by-batch-size",), affects="performance",
            auto=auto_spec_disable_by_batch_size, engines=("kiln",)),
    Setting("speculative_prompt_lookup", non_negative_int, 4,
            "draft model: where the request's own tokens predict a run of up to N tokens "
            "(prompt lookup, as --speculative-method ngram) and the draft model's first token "
            "agrees with it, that run is the step's drafts and the draft model's other steps are "
            "skipped (greedy rows); 0: off", ("--speculative-prompt-lookup",),
            affects="performance", metavar="N", engines=("kiln",)),
    Setting("speculative_draft_vocab", non_negative_int, 0,
            "draft model: its head scores only the first N token ids (BPE vocabularies number "
            "tokens in merge order, roughly by frequency: cheaper drafts of English and code, "
            "fewer accepted in other scripts); outputs are unchanged (the target checks every "
            "token); 0: the whole vocabulary", ("--speculative-draft-vocab",),
            affects="performance", engines=("kiln",)),
    # -- hybrid MoE: hot experts on the GPU, the rest on the CPU: kiln's own engine (device pool +
    # CPU pools, kiln/engine/expert_placement.py) or SGLang + kt-kernel. cpu_offload_experts
    # comes first: the kt_* rules read it (its own rule reads only which kt_* were given).
    Setting("cpu_offload_experts", parse_bool, None,
            "MoE: keep some experts of each layer on the GPU and run the rest on the CPU "
            "(auto: on for MoE models with --engine sglang; with kiln's engine, when the model "
            "leaves the GPU too little room; on a CPU, two CPU pools)",
            ("--cpu-offload-experts",), neg_flags=("--no-cpu-offload-experts",),
            affects="memory", auto=auto_cpu_offload_experts, engines=("kiln", "sglang")),
    Setting("num_gpu_experts", non_negative_int, None,
            "MoE with CPU offload: experts per layer kept on the GPU (auto: kiln's engine "
            "fills the GPU memory left after the dense weights and a KV reserve, hottest "
            "experts first; SGLang: the registry's rule for the GPU memory and TP)",
            ("--num-gpu-experts", "--kt-num-gpu-experts", "--gpu-experts"), affects="memory",
            engines=("kiln", "sglang")),
    Setting("expert_calibration", str, "on",
            "MoE with CPU offload in kiln's engine: rank experts by the tokens routed to them "
            "over built-in prompts (once per model file, cached) to keep the hottest on the GPU; "
            "off: the first N", ("--expert-calibration",), choices=("on", "off"),
            affects="performance", engines=("kiln",)),
    Setting("kt_method", str, None,
            "kt-kernel CPU expert format: AMXINT4 (kt-cli's default; needs AMX), AMXINT8, "
            "LLAMAFILE, or BF16/FP8/RAWINT4 (these read the model's own weights)",
            ("--kt-method",), affects="correctness", auto=auto_kt_method, engines=("sglang",)),
    Setting("kt_weight_path", str, None,
            "folder of the CPU expert weights converted by kt-kernel (default: the model folder, "
            "as kt-cli)", ("--kt-weight-path", "--weights-path"), affects="correctness",
            metavar="DIR", engines=("sglang",)),
    Setting("kt_threadpool_count", positive_int, None,
            "CPU expert thread pools, kt-kernel's or kiln's (auto: one per NUMA node)",
            ("--kt-threadpool-count", "--numa-nodes"),
            affects="performance", auto=auto_kt_threadpool_count, engines=("kiln", "sglang")),
    Setting("kt_cpuinfer", positive_int, None,
            "CPU expert threads, kt-kernel's or kiln's (auto: 80 percent of the physical cores "
            "of the NUMA nodes used; kiln on a CPU: all)",
            ("--kt-cpuinfer", "--cpu-threads"), affects="performance", auto=auto_kt_cpuinfer,
            engines=("kiln", "sglang")),
    Setting("kt_gpu_prefill_token_threshold", positive_int, None,
            "prefill chunks of at least this many tokens run every expert on the GPU, the CPU "
            "experts' weights streamed there (auto: 4096, kt-cli's)",
            ("--kt-gpu-prefill-token-threshold", "--kt-gpu-prefill-threshold"),
            affects="performance",
            auto=auto_kt_gpu_prefill_token_threshold, engines=("kiln", "sglang")),
    # -- SGLang's own knobs that kt-cli's `kt run` sets on every launch: the preset "kt" gives
    # them its values for SGLang with kt-kernel (kiln/resolve/presets.py), each overridable.
    Setting("attention_backend", str, None,
            "SGLang's attention kernels: triton, flashinfer, fa3, ... (unset: SGLang's choice; "
            "preset kt: triton, as kt-cli)", ("--attention-backend",), affects="performance",
            metavar="NAME", engines=("sglang",)),
    Setting("max_total_tokens", positive_int, None,
            "SGLang: tokens the KV pool holds (beats --kv-max-blocks x --block-size from a lower "
            "source; preset kt: 40000)", ("--max-total-tokens",), affects="memory",
            metavar="N", engines=("sglang",)),
    Setting("watchdog_timeout", float, None,
            "SGLang: seconds one batch may run before the server is stopped as hung (preset "
            "kt: 3000, for CPU experts' long prefills)", ("--watchdog-timeout",),
            affects="server", metavar="SECONDS", engines=("sglang",)),
    Setting("enable_mixed_chunk", parse_bool, None,
            "SGLang: run prefill chunks and decodes in one batch (kiln's engine always does; "
            "preset kt: on)", ("--enable-mixed-chunk",), neg_flags=("--no-enable-mixed-chunk",),
            affects="performance", engines=("sglang",)),
    Setting("enable_p2p_check", parse_bool, None,
            "SGLang: test GPU peer-to-peer access before relying on it (preset kt: on)",
            ("--enable-p2p-check",), neg_flags=("--no-enable-p2p-check",),
            affects="correctness", engines=("sglang",)),
    Setting("disable_shared_experts_fusion", parse_bool, None,
            "SGLang: run an MoE's shared experts apart from the routed ones (the registry turns "
            "it on for DeepSeek-V3 and MiniMax-M2, as kt-cli's does)",
            ("--disable-shared-experts-fusion",),
            neg_flags=("--enable-shared-experts-fusion",), affects="performance",
            engines=("sglang",)),
    Setting("trust_remote_code", parse_bool, None,
            "let the external engine run the Python code a checkpoint ships (auto: when its "
            "config.json's auto_map names some, or the registry says the model needs it: Kimi, "
            "DeepSeek, MiniMax); kiln's engine runs none", ("--trust-remote-code",),
            neg_flags=("--no-trust-remote-code",), affects="correctness",
            auto=auto_trust_remote_code, engines=("vllm", "sglang")),
    # -- observability
    Setting("log_level", str, "info", "log verbosity", ("--log-level",),
            choices=("debug", "info", "warning", "error"), affects="observability"),
    # The CLI reads --lang / KILN_LANG / the locale before this table resolves (kiln/i18n/
    # says why); the row gives the choice provenance and lets the config file set it.
    Setting("lang", str, "auto",
            "language of kiln's messages: en or zh (auto: zh when the locale LC_ALL / "
            "LC_MESSAGES / LANG starts with zh); JSON, logs and API errors stay English",
            ("--lang",), choices=("auto", "en", "zh"), affects="observability", auto=auto_lang,
            engines=("kiln",)),
    # -- traces, request dumps and faults while serving (kiln/obs/)
    Setting("profile_jsonl", str, None,
            "write per-step phase timings (schedule, prepare, forward, sample, detokenize) "
            "as JSONL", ("--profile-jsonl",), affects="observability", group="observability",
            metavar="PATH", engines=("kiln",)),
    Setting("profile_detail", str, "basic",
            "basic: phases per step; layers: also each decoder layer's ms (eager steps)",
            ("--profile-detail",), choices=("basic", "layers"), affects="observability",
            group="observability", engines=("kiln",)),
    Setting("profile_sample_rate", fraction, 1.0, "fraction of steps the profile records",
            ("--profile-sample-rate",), affects="observability", group="observability",
            metavar="F", engines=("kiln",)),
    Setting("profile_commit_sha", str, None, "commit recorded in the profile's meta line",
            ("--profile-commit-sha",), affects="observability", group="observability",
            engines=("kiln",)),
    Setting("profile_env_hash", parse_env_hash, None,
            "environment hash recorded in the profile's meta line (sha256:<hex>)",
            ("--profile-env-hash",), affects="observability", group="observability",
            metavar="sha256:HEX", engines=("kiln",)),
    Setting("profile_model", str, None, "model label recorded in the profile's meta line",
            ("--profile-model",), affects="observability", group="observability",
            engines=("kiln",)),
    Setting("profile_concurrency", positive_int, None,
            "client concurrency recorded in the profile's meta line", ("--profile-concurrency",),
            affects="observability", group="observability", metavar="N", engines=("kiln",)),
    Setting("profile_runtime_flags_json", parse_json_object, None,
            "a JSON object of runtime flags recorded in the profile's meta line",
            ("--profile-runtime-flags-json",), affects="observability", group="observability",
            metavar="JSON", engines=("kiln",)),
    Setting("memory_profile_jsonl", str, None,
            "write RSS (and CUDA memory) at each startup stage and at shutdown as JSONL",
            ("--memory-profile-jsonl",), affects="observability", group="observability",
            metavar="PATH", engines=("kiln",)),
    Setting("scheduler_trace_jsonl", str, None,
            "write per-step queue lengths, tokens by kind, prefix hits, preemptions and free "
            "KV blocks as JSONL", ("--scheduler-trace-jsonl",), affects="observability",
            group="observability", metavar="PATH", engines=("kiln",)),
    Setting("request_dump_dir", str, None,
            "write one JSON bundle per request (secrets removed) for `kiln replay`",
            ("--request-dump-dir",), affects="observability", group="observability",
            metavar="DIR", engines=("kiln",)),
    Setting("diagnostic_faults", parse_faults, None,
            "inject a fault (repeatable): startup:STAGE, step_raise:N, step_delay_ms:N, "
            "kv_alloc[:N], drop_stream:N", ("--diagnostic-fault",), affects="correctness",
            group="observability", metavar="KIND[:ARG]", engines=("kiln",), repeatable=True),
    # -- KV cache that remembers (kiln's engine)
    Setting("prefix_rendezvous_max_wait_ms", positive_wait_ms, None,
            "a request whose prefix another request is prefilling right now waits up to N ms "
            "for those blocks instead of computing them twice (off unless set)",
            ("--prefix-rendezvous-max-wait-ms",), affects="performance", metavar="N",
            engines=("kiln",)),
    Setting("session_cache", str, "off",
            "keep each conversation's KV blocks pinned between turns (session id: the OpenAI "
            "`user` field or the X-Session-Id header)", ("--session-cache",),
            choices=("off", "memory"), affects="performance", engines=("kiln",)),
    Setting("session_cache_max_entries", positive_int, 256,
            "most conversations the session cache keeps (least recently used go first)",
            ("--session-cache-max-entries",), affects="memory", engines=("kiln",)),
    Setting("session_cache_max_tokens", positive_int, None,
            "most tokens of KV the session cache keeps pinned (default: half the KV pool)",
            ("--session-cache-max-tokens",), affects="memory", engines=("kiln",)),
]

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
# The router's own settings: not handed to the `kiln serve` it starts per model.
ROUTER_SETTINGS = frozenset({"models", "preload", "keep_alive", "max_loaded_models",
                             "models_memory", "model_load_timeout", "host", "port",
                             "served_model_name", "model", "model_path"})


def setting(name: str) -> Setting:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ConfigError(f"unknown setting {name!r}", code="config.unknown_setting") from None
