"""kiln's CPU kernel layer (kiln/layers/kernels): the ISA probe and its level table, every level
compiled (loaded where the CPU runs it), every level computing the same bits, the chooser and
its reasons, --cpu-isa, the one-call layer against the layer's modules, an int4 engine through
the layer kernel or the eager modules, and the cut that keeps CPU-flag reads in one place."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from conftest import KERNEL_LEVELS

from kiln.layers import kernels
from kiln.layers.kernels import isa
from kiln.layers.kernels.flags import flags_amx

ROOT = Path(__file__).resolve().parents[2]


def test_the_probe_reconciles_flags_and_the_os():
    """On x86 Linux XCR0 is read (the OS's word, not a flag's), and a level runs exactly where
    its flags are there and XCR0 enables its registers."""
    if not isa.x86_linux():
        assert KERNEL_LEVELS == []
        return
    x = isa.xcr0()
    assert x is not None and x & isa.XCR0_AVX == isa.XCR0_AVX  # every x86-64 Linux enables AVX
    for lv in isa.LEVELS:
        runs = lv.flags <= isa.cpu_flags() and x & lv.xcr0 == lv.xcr0
        assert (isa.cpu_runs(lv) is None) == runs, (lv.name, isa.cpu_runs(lv))
    # AMX: granted only where the flag, XCR0's tile bits and the kernel's permission agree
    if not flags_amx(isa.cpu_flags()):
        assert not isa.amx_granted()


def test_every_level_the_cpu_runs_loads_and_the_others_compile():
    """A level the CPU runs must build and pass its self-check (never a skip); one it lacks is
    still compiled, so its code cannot rot on CPUs that never load it."""
    from kiln.layers.kernels.build import compile_only, library

    for lv in isa.LEVELS:
        if lv.name in KERNEL_LEVELS:
            assert library(lv.name), f"{lv.name} runs here but did not build or self-check"
            assert getattr(torch.ops, f"kiln_{lv.name}").isa() == lv.name
        else:
            ok, err = compile_only(lv.name)
            assert ok, f"{lv.name} does not compile: {err}"
    if KERNEL_LEVELS:
        assert kernels.runnable_levels() == KERNEL_LEVELS  # best first, as auto picks


def test_the_prefetch_distance_is_the_cpus(monkeypatch):
    """Every loaded level prefetches as far ahead as prefetch_ahead says for this CPU (2 KB on
    a Zen 3 EPYC, 1 KB elsewhere until measured); the table reads the CPU's identity."""
    from kiln.layers.kernels.build import library

    want, why = isa.prefetch_ahead()
    assert want in (1024, 2048) and why
    for name in KERNEL_LEVELS:
        assert library(name)
        ns = getattr(torch.ops, f"kiln_{name}")
        assert ns.set_prefetch_ahead(want) == want  # what loading set (returns the old value)
        with pytest.raises(RuntimeError, match="whole cache lines"):
            ns.set_prefetch_ahead(100)
    if isa.x86_linux():
        assert isa.cpu_model_id() is not None
    for ident, bytes_ in [(("AuthenticAMD", 25, 1), 2048), (("AuthenticAMD", 25, 0x11), 1024),
                          (("AuthenticAMD", 23, 49), 1024), (("GenuineIntel", 6, 143), 1024),
                          (None, 1024)]:
        monkeypatch.setattr(isa, "cpu_model_id", lambda ident=ident: ident)
        assert isa.prefetch_ahead()[0] == bytes_, ident


def _q4_case(n: int, k: int, m: int, seed: int):
    from kiln.layers.kernels import reference

    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    s = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    mn = (-8 * s + torch.randn(n, k // 32, generator=g) * 0.01).half().float()
    return torch.randn(m, k, generator=g), reference.pack_q4(q, s, mn)


@pytest.mark.skipif(len(KERNEL_LEVELS) < 2, reason="one ISA level runs here: nothing to compare")
def test_every_level_computes_the_same_bits():
    """The levels differ in instructions, not arithmetic (simd.h): q4_linear, moe_q4 and every
    GGUF block type give identical results at each level (so greedy tokens do too)."""
    from kiln.layers.kernels import ops, reference
    from kiln.layers.quant import gguf_blocks

    x, packed = _q4_case(77, 512, 19, 0)
    ids = torch.tensor([[0, 2], [1, 2], [3, 0]])
    w = torch.rand(3, 2)
    g = torch.Generator().manual_seed(1)
    # 9 and 21 rows: the AVX-512 level's pairs of tiles whole (16 rows) and cut short
    parts = [reference.random_blocks(9 + 12 * (i % 2), 512, t, g)
             for i, t in enumerate(("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q5_1", "Q8_0"))]
    w13 = torch.stack([_q4_case(64, 512, 1, e)[1] for e in range(4)])
    w2 = torch.stack([_q4_case(512, 32, 1, 10 + e)[1] for e in range(4)])
    results = {}
    for lv in KERNEL_LEVELS:
        with kernels.at_level(lv):
            tiles = [gguf_blocks.pack(p) for p in parts]
            results[lv] = (ops.q4_linear(x, packed, 77),
                           gguf_blocks.kq_linear(x, tiles, [p.type_id for p in parts],
                                            [p.raw.shape[0] for p in parts]),
                           ops.moe_q4(x[:3], ids, w, w13, w2))
    first, *others = results.values()
    for other in others:
        for a, b in zip(first, other):
            assert torch.equal(a, b)


def test_the_chooser_names_the_level_and_says_why_not(kernel_level):
    from kiln.layers.kernels.choose import choose_linear_kernel

    cpu = torch.device("cpu")
    c = choose_linear_kernel("int4", cpu, 64, 128)
    assert c.kernel == "q4" and c.kiln and f"at {kernel_level}" in c.why
    off = choose_linear_kernel("int4", cpu, 64, 128, use_kernels=False, native=True)
    assert off.kernel == "torch-int4" and off.why.startswith("q4_linear: --no-cpu-kernels")
    odd = choose_linear_kernel("int4", cpu, 64, 128, group_size=64)
    assert odd.kernel == "reference" and "groups of 64" in odd.why
    assert choose_linear_kernel("gguf", cpu, 64, 256).kernel == "gguf"
    from kiln.layers.kernels.choose import choose_cpu_kernels, choose_lora_kernel

    lora = choose_lora_kernel(cpu, torch.float32)
    assert lora.kernel == "lora_add" and lora.kiln and f"at {kernel_level}" in lora.why
    assert choose_lora_kernel(cpu, torch.bfloat16).why.startswith("lora_add: torch.bfloat16")
    assert not choose_lora_kernel(torch.device("meta"), torch.float32).kiln
    whole = choose_cpu_kernels(cpu)
    assert whole.kiln and f"at {kernel_level}" in whole.why
    assert choose_cpu_kernels(cpu, use_kernels=False).why.startswith("--no-cpu-kernels")


def test_cpu_isa_above_what_runs_is_refused_with_what_does():
    from kiln.errors import ConfigError

    missing = [lv.name for lv in isa.LEVELS if lv.name not in KERNEL_LEVELS]
    with pytest.raises(ConfigError) as e:
        kernels.select("avx9000")
    assert "auto" in str(e.value)
    for name in missing:
        with pytest.raises(ConfigError) as e:
            kernels.select(name)
        assert "this machine runs" in (e.value.hint or "")
    for name in KERNEL_LEVELS:  # and each level that runs can be forced
        with kernels.at_level(name):
            assert kernels.level() == name


def test_cpu_isa_setting_reaches_the_runner_and_the_decision_trace(tmp_path, kernel_level):
    """--cpu-isa LEVEL (here each level the CPU runs) is the level the engine's layers run at,
    and the effective config's decision says so."""
    from conftest import make_tiny_model

    from kiln.engine.model_runner import ModelRunner
    from kiln.models.loader import open_checkpoint
    from kiln.settings.engine_config import EngineConfig

    folder = make_tiny_model("llama", tmp_path / "tiny", hidden_size=256)
    cfg = EngineConfig.of(model=str(folder), quantization="int4", cpu_isa=kernel_level,
                       kv_cache_memory=8 << 20, max_num_seqs=4, max_num_batched_tokens=64)
    r = ModelRunner(cfg, open_checkpoint(folder))
    d = r.decisions.to_dict()["cpu_kernels"]
    assert d["value"] == kernel_level and d["code"] == "cpu_kernels.chosen"
    assert "--cpu-isa" in d["reason"] and "on q4" in d["reason"]  # asked for; the layers' kernel


def test_decode_layer_equals_the_layer_modules(tmp_path, kernel_level):
    """One int4 decoder layer's step as one decode_layer call equals the layer's modules with
    PyTorch's attention (norms, RoPE, K/V written to the pool, attention over ragged contexts,
    the MLP, the residuals), to the kernels' int8 activation rounding; a slot outside the pool
    is an error, not a write."""
    from conftest import make_tiny_model

    from kiln.engine.engine import Engine
    from kiln.layers.attention import AttentionMetadata, set_context
    from kiln.settings.engine_config import EngineConfig

    folder = make_tiny_model("llama", tmp_path / "tiny", hidden_size=256)
    cfg = EngineConfig.of(model=str(folder), dtype="float32", quantization="int4",
                       kv_cache_dtype="fp32", dense_weights=False, kv_cache_memory=8 << 20,
                       max_num_seqs=4, max_num_batched_tokens=64, compile=False)
    model = Engine(cfg).runner.model
    layer = model.model.layers[1]
    kv = layer.self_attn.attn.kv
    assert layer.decode_kernel_rows() > 0 and kv.invariant
    g = torch.Generator().manual_seed(5)
    b, length = 3, 40
    x = torch.randn(b, 256, generator=g)
    own = torch.tensor([39, 20, 5])  # each row's last position
    cos, sin = model.model._rotary[0].lookup(own, torch.float32)
    gather = torch.arange(b * length).view(b, length) + 64
    mask = torch.arange(length)[None, :] <= own[:, None]
    meta = AttentionMetadata(slot_mapping=gather[torch.arange(b), own], num_decodes=b,
                             decode_gather=gather, decode_mask=mask[:, None, None, :],
                             decode_lens=own + 1)
    meta.step_rows = (gather, torch.arange(b), own + 1)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    pool = kv.k.clone(), kv.v.clone()
    set_context(meta)
    try:
        with torch.inference_mode():
            kv.invariant = False  # the layer's modules, PyTorch's attention
            want = layer(cos, sin, x)
            want_pool = kv.k.clone(), kv.v.clone()
            kv.invariant = True
            kv.k.copy_(pool[0])
            kv.v.copy_(pool[1])
            got = layer.forward_decode_kernel(cos, sin, x)
    finally:
        set_context(None)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * scale)
    torch.testing.assert_close(kv.k, want_pool[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(kv.v, want_pool[1])
    meta.slot_mapping = torch.tensor([0, 1, kv.k.shape[0]])
    set_context(meta)
    try:
        with pytest.raises(RuntimeError, match="outside the pool"):
            layer.forward_decode_kernel(cos, sin, x)
    finally:
        set_context(None)


def test_int4_engine_decodes_with_the_layer_kernel_graphs_or_eager_alike(tmp_path, kernel_level):
    """An int4 engine: batch-invariant (the layer kernel runs every step, decode_stack) and not
    (compiled graphs or eager modules calling q4_linear) give the same greedy tokens on a random
    tiny model up to near-ties; the kernel's steps call the level's ops, none of PyTorch's int4."""
    from conftest import make_tiny_model, run_to_completion

    from kiln.engine.engine import Engine
    from kiln.sampling_params import SamplingParams
    from kiln.settings.engine_config import EngineConfig

    folder = make_tiny_model("llama", tmp_path / "tiny", hidden_size=256)
    common = {"model": str(folder), "quantization": "int4", "kv_cache_memory": 8 << 20,
              "max_num_seqs": 4, "max_num_batched_tokens": 64}
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)
    outs, ns = {}, f"kiln_{kernel_level}::"
    for mode, kw in (("kernel", {}), ("eager", {"batch_invariant": False, "compile": False})):
        e = Engine(EngineConfig.of(**common, **kw))
        assert (e.runner.decode_kernel_rows > 0) == (mode == "kernel")
        for i, p in enumerate(prompts):
            e.add_request(str(i), p, params)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            outs[mode] = run_to_completion(e)
        calls = {ev.key: ev.count for ev in prof.key_averages()}
        assert not any("int4pack" in key for key in calls)
        if mode == "kernel":
            assert calls.get(ns + "decode_stack", 0) >= 10, calls
        else:
            layers = e.runner.model_config.num_hidden_layers
            assert calls.get(ns + "q4_linear", 0) >= 10 * 4 * layers, calls
    total = sum(len(t) for t in outs["eager"].values())
    assert total == 30
    same = sum(a == b for rid in outs["eager"] for a, b in zip(outs["kernel"][rid],
                                                                 outs["eager"][rid]))
    assert all(outs["kernel"][r][:3] == outs["eager"][r][:3] for r in outs["eager"])
    assert same / total >= 0.8, f"{same}/{total}"


# The cut this layer keeps: no module outside it reads CPU flags or asks a kernel library whether
# it loaded; they ask the choosers (kiln.layers.kernels.choose) or the probe's answers
# (kiln.layers.kernels.isa, HardwareInfo's properties). hardware.py is the probe's /proc reader.
_PROBE = "resolve/hardware.py"  # under the package
_LIBRARY_CHECKS = {"available", "library", "runnable_levels"}
# flag names as /proc/cpuinfo spells them; the bare level names ("avx512", "avx2": --cpu-isa's
# values) are not here, a comparison with the flags themselves is caught as a flag read
_FLAG_NAME = re.compile(r"(avx512[a-z0-9]*_?[a-z0-9_]+|amx_[a-z0-9_]+|avx_vnni[a-z0-9_]*|fma|f16c)")


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def kernel_layer_leaks(root: Path, package: str = "kiln") -> list[str]:
    """"path:line: what" for each CPU-flag read or kernel-library check in `package` outside
    its layers/kernels/ and the hardware probe."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(f"{package}/layers/kernels/") or rel == f"{package}/{_PROBE}":
            continue
        tree = ast.parse(path.read_text(), filename=rel)
        docs = _docstrings(tree)
        from_kernels: set[str] = set()  # names this module imported from the kernel layer
        shown: set[int] = set()  # `", ".join(hw.cpu_flags)`: the flags printed, not read
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    f"{package}.layers.kernels"):
                from_kernels |= {a.asname or a.name for a in node.names}
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "join"):
                shown |= {id(a) for a in node.args}
        for node in ast.walk(tree):
            what = None
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if name in _LIBRARY_CHECKS and (isinstance(f, ast.Attribute) or name in from_kernels):
                    what = f"asks whether a kernel library loaded ({name}())"
                elif name == "cpu_flags" or (name.startswith("flags_") and (
                        isinstance(f, ast.Attribute) or name in from_kernels)):
                    what = f"reads CPU flags ({name}())"
                elif (name == "getattr" and node.args and isinstance(node.args[0], ast.Attribute)
                      and node.args[0].attr in ("ops", "classes")):
                    what = "looks a kernel library up in torch.ops"
            elif isinstance(node, ast.Attribute):
                if node.attr.startswith("kiln_") and isinstance(node.value, ast.Attribute) and \
                        node.value.attr in ("ops", "classes"):
                    what = f"reaches a kernel library (torch.{node.value.attr}.{node.attr})"
                elif node.attr == "cpu_flags" and id(node) not in shown:
                    what = "reads CPU flags (.cpu_flags)"
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and id(node) not in docs):
                if node.value.strip("/") in ("cpuinfo", "proc/cpuinfo"):
                    what = "reads /proc/cpuinfo"
                elif _FLAG_NAME.fullmatch(node.value):
                    what = f"names a CPU flag ({node.value!r})"
            if what:
                found.append(f"{rel}:{node.lineno}: {what}")
    return found


def test_no_cpu_flag_read_or_library_check_outside_the_kernel_layer():
    assert kernel_layer_leaks(ROOT) == []


def test_a_flag_read_or_library_check_outside_the_kernel_layer_is_named(tmp_path):
    """The check above finds each form, by file and line, and lets the kernel layer, the
    probe, docstrings and printed flags be."""
    files = {
        "pkg/layers/kernels/isa.py": "def f(hw):\n    return 'avx512f' in hw.cpu_flags\n",
        "pkg/resolve/hardware.py": "P = 'proc/cpuinfo'\n",
        "pkg/ok.py": ('"""reads avx512_vnni from /proc/cpuinfo"""\n'
                      "def show(hw):\n    return ' '.join(hw.cpu_flags), 'avx512', 'avx2'\n"),
        "pkg/a.py": ("from pkg.layers import kernels\n"
                     "from pkg.layers.kernels.build import library\n"
                     "from pkg.layers.kernels.flags import flags_amx\n"
                     "import torch\n"
                     "def f(hw):\n"
                     "    x = kernels.available()\n"
                     "    y = library('avx2')\n"
                     "    z = flags_amx(hw.flags)\n"
                     "    return torch.ops.kiln_avx2, getattr(torch.ops, 'k'), 'amx_tile'\n"),
        "pkg/b.py": "def g(hw):\n    return 'avx2' in hw.cpu_flags or open('/proc/cpuinfo')\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    got = sorted(kernel_layer_leaks(tmp_path, "pkg"))
    assert got == sorted([
        "pkg/a.py:6: asks whether a kernel library loaded (available())",
        "pkg/a.py:7: asks whether a kernel library loaded (library())",
        "pkg/a.py:8: reads CPU flags (flags_amx())",
        "pkg/a.py:9: reaches a kernel library (torch.ops.kiln_avx2)",
        "pkg/a.py:9: looks a kernel library up in torch.ops",
        "pkg/a.py:9: names a CPU flag ('amx_tile')",
        "pkg/b.py:2: reads CPU flags (.cpu_flags)",
        "pkg/b.py:2: reads /proc/cpuinfo",
    ])


def test_a_quantized_gemma3_gguf_runs_with_the_cpu_defaults(tmp_path, kernel_level):
    """A Q8_0 Gemma 3 GGUF (sliding-window layers, Gemma's norms) with what the settings table
    picks for it on this CPU: it loads (the old AVX-512 bf16 kernels failed here), every step
    runs batch-invariant, and a row's greedy tokens are the same alone and among four."""
    from conftest import make_tiny_model, run_to_completion

    from kiln.engine.engine import Engine
    from kiln.models.gguf_writer import write_gguf
    from kiln.models.loader import iter_tensors, open_checkpoint
    from kiln.sampling_params import SamplingParams
    from kiln.settings.engine_config import EngineConfig
    from kiln.settings.resolve import resolve_settings
    from kiln.settings.rules import AutoContext

    ck = open_checkpoint(make_tiny_model("gemma3", tmp_path / "g3"))
    path = write_gguf(tmp_path / "g3.gguf", ck.config, iter_tensors(ck), qtype="Q8_0")
    s = resolve_settings(ctx=AutoContext(model_quant="Q8_0", cpu_kernels=True))
    picked = {k: s[k] for k in ("dtype", "quantization", "kv_cache_dtype", "batch_invariant",
                                "compile", "gguf_kernels")}
    assert picked["dtype"] == "float32" and picked["batch_invariant"] is True
    cfg = EngineConfig.of(model=str(path), **picked, kv_cache_memory=8 << 20, max_num_seqs=4,
                       max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    prompts = [[5, 9, 11, 3, 200], [7] * 30, [1, 2, 3], list(range(40, 80))]
    eng = Engine(cfg)
    assert eng.runner.decisions.batch_invariant.value, eng.runner.decisions.batch_invariant.reason
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    together = run_to_completion(eng)
    for i, p in enumerate(prompts):
        eng.add_request(f"alone{i}", p, params)
        assert run_to_completion(eng)[f"alone{i}"] == together[str(i)]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_moe_layers_run_as_one_call_with_the_eager_layers_bits(tmp_path, kernel_level, family):
    """An int4 MoE model (Qwen3-MoE: q/k norms; Mixtral; Qwen2-MoE: a gated shared expert,
    absorbed into the stacked experts as two virtual ones): every step runs each layer as one
    moe_layer call, and greedy tokens and logprobs equal those of the eager layers (the layer
    kernel off) bit for bit, for sixteen requests batched (issue 41's "16 concurrent greedy MoE
    requests") and each alone; the routing counters see the same tokens either way."""
    from conftest import make_tiny_model

    from kiln.engine.engine import Engine
    from kiln.layers.moe import experts_of
    from kiln.sampling_params import SamplingParams
    from kiln.settings.engine_config import EngineConfig

    shared = {"shared_expert_intermediate_size": 128} if family == "qwen2_moe" else {}
    folder = make_tiny_model(family, tmp_path / family, hidden_size=128,
                             moe_intermediate_size=64, intermediate_size=64, **shared)
    eng = Engine(EngineConfig.of(model=str(folder), quantization="int4", kv_cache_memory=8 << 20,
                              max_num_seqs=16, max_num_batched_tokens=64))
    runner = eng.runner
    assert runner.decode_kernel_rows > 0, runner.decisions.decode_path.reason
    if family == "qwen2_moe":
        blocks = [m for m in runner.model.modules() if hasattr(m, "shared_gate_in_router")]
        assert blocks and all(b.experts.num_shared == 2 and b.shared_expert is None
                              and b.shared_gate_in_router for b in blocks)
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logprobs=1)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist()
               for n in (5, 17, 30, 9, 3, 12, 26, 7, 21, 14, 6, 33, 10, 18, 4, 25)]

    def run(batched: bool) -> dict[str, tuple[list[int], list[float]]]:
        out: dict[str, tuple[list[int], list[float]]] = {}
        groups = [list(enumerate(prompts))] if batched else [[ip] for ip in enumerate(prompts)]
        for group in groups:
            for i, p in group:
                eng.add_request(str(i), p, params)
            while eng.has_unfinished:
                for o in eng.step():
                    ids, lps = out.setdefault(o.request_id, ([], []))
                    ids += o.outputs[0].token_ids
                    lps += [lp.logprob for lp in o.outputs[0].logprobs or []]
        return out

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        kernel = run(batched=True)
    calls = {ev.key: ev.count for ev in prof.key_averages()}
    moe = len(experts_of(runner.model))
    # every decode step ran all its layers (moe_layer's and decode_layer's) in one
    # decode_stack call; none of them layer by layer from Python
    assert moe and calls.get(f"kiln_{kernel_level}::decode_stack", 0) >= 8, calls
    assert not calls.get(f"kiln_{kernel_level}::moe_layer"), calls
    # every row the kernel run computed was routed and counted: prompts and 7 decode rows each
    counted = sum(int(e.tokens_per_expert.sum()) for e in experts_of(runner.model))
    top_k = runner.model_config.num_experts_per_tok
    assert counted == sum(len(p) + 7 for p in prompts) * top_k * moe
    rows, runner.decode_kernel_rows = runner.decode_kernel_rows, 0
    try:
        eager = run(batched=True)
    finally:
        runner.decode_kernel_rows = rows
    assert eager == kernel
    assert run(batched=False) == kernel
