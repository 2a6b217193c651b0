"""LoRA adapters in kiln's engine (kiln/engine/lora.py): PEFT folders made here with random
non-zero B, logits against transformers + peft in float32, several adapters and the base in one
batch, the prefix cache kept apart per adapter, and the checks made before any model work."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_model

from kiln.layers.kernels.choose import Choice
from kiln.sampling_params import SamplingParams

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, targets, rsLoRA): different ranks, scalings and partial packed shards
ADAPTERS = {"a1": (8, 16, ALL, False), "a2": (4, 8, ["q_proj", "v_proj", "down_proj"], False),
            "a3": (16, 32, ["k_proj", "o_proj", "up_proj"], True)}


def make_adapter(base, folder, rank: int, alpha: float, targets: list[str], rslora: bool = False,
                 seed: int = 0):
    """A PEFT LoRA adapter of `base` (an HF model) with random A and B (PEFT zeros B at init,
    which would test nothing), saved to `folder`; returns the PeftModel (the reference)."""
    import peft

    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                          lora_dropout=0.0)
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.normal_(0, 0.05)
    model.save_pretrained(folder)
    return model.eval()


def ref_logits(peft_model, ids: list[int], adapter: str | None) -> torch.Tensor:
    with torch.no_grad():
        if adapter is None:
            with peft_model.disable_adapter():
                return peft_model(torch.tensor([ids])).logits[0].float()
        peft_model.set_adapter(adapter)
        return peft_model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random llama, three PEFT adapters of it, and one PeftModel holding all three."""
    import peft
    import transformers

    root = tmp_path_factory.mktemp("lora")
    base_dir = make_tiny_model("llama", root / "base")
    paths = {}
    ref = None
    for i, (name, (r, alpha, targets, rs)) in enumerate(ADAPTERS.items()):
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        make_adapter(base, root / name, r, alpha, targets, rs, seed=i + 1)
        paths[name] = root / name
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    ref = peft.PeftModel.from_pretrained(base, paths["a1"], adapter_name="a1")
    for name in ("a2", "a3"):
        ref.load_adapter(paths[name], adapter_name=name)
    return base_dir, paths, ref.eval()


def tiny_engine(base_dir, paths, **kw):
    from kiln.engine.engine import Engine
    from kiln.settings.engine_config import EngineConfig

    cfg = EngineConfig.of(model=str(base_dir), dtype="float32", kv_cache_memory=8 << 20,
                       max_num_batched_tokens=256,
                       lora_modules=tuple(f"{n}={p}" for n, p in paths.items()), **kw)
    return Engine(cfg)


def test_lora_add_kernel_equals_the_grouped_matmuls(kernel_level):
    """ops.lora_add (one call per linear) against the per-group matmuls it replaces:
    uneven groups (1..9 rows: the 4-row blocks and their tails), base rows between them, an
    adapter slot the linear does not have, ranks below the stack's, block-diagonal pieces
    (a packed linear's shards) and widths that are not a multiple of 8."""
    from kiln.layers.kernels import ops

    g = torch.Generator().manual_seed(0)
    k, n, r_max = 70, 45, 12
    # slot -> (rank, pieces (j0, j1, lo, hi)); slot 2 is not in this linear
    adapters = {0: (12, [(0, 4, 0, 20), (4, 8, 20, 33), (8, 12, 33, 45)]),
                1: (5, [(0, 5, 0, 45)]), 3: (7, [(0, 3, 3, 11), (3, 7, 30, 45)])}
    order = sorted(adapters)
    a = torch.zeros(len(order), r_max, k)
    bt = torch.zeros(len(order), r_max, n)
    pieces = torch.zeros(len(order), 3, 4, dtype=torch.int32)
    local = torch.full((5,), -1, dtype=torch.int32)
    dense_b = {}
    for i, slot in enumerate(order):
        r, ps = adapters[slot]
        a[i, :r] = torch.randn(r, k, generator=g)
        b = torch.zeros(n, r)
        for j0, j1, lo, hi in ps:
            b[lo:hi, j0:j1] = torch.randn(hi - lo, j1 - j0, generator=g)
        bt[i, :r] = b.t()
        dense_b[slot] = b
        pieces[i, :len(ps)] = torch.tensor(ps, dtype=torch.int32)
        local[slot] = i
    ranks = torch.tensor([adapters[s][0] for s in order], dtype=torch.int32)
    # (slot, first row, end row); rows 0-2 and 16-17 are base rows
    groups = [(1, 3, 4), (0, 4, 13), (2, 13, 16), (3, 18, 24), (1, 24, 26)]
    x = torch.randn(26, k, generator=g)
    out = torch.randn(26, n, generator=g)
    want = out.clone()
    for slot, first, end in groups:
        if slot in adapters:
            r = adapters[slot][0]
            want[first:end] += (x[first:end] @ a[int(local[slot]), :r].t()) @ dense_b[slot].t()
    ops.lora_add(out, x, a, bt, pieces, ranks, torch.tensor(groups, dtype=torch.int64), local)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("form", ["kernel", pytest.param("torch", marks=pytest.mark.heavy)])
def test_mixed_batch_of_three_adapters_and_base_matches_peft_logits(tiny, form, monkeypatch):
    """One step prefills four prompts (base, a1, a2, a3); every prompt position's logprobs of
    its next token and top 5 equal transformers + peft's within 1e-3; then greedy decoding in
    the mixed batch gives peft's tokens. Both forms of the LoRA matmuls: kiln's CPU kernel
    (one call per linear), or PyTorch's matmuls per group of rows (other devices, bf16)."""
    from kiln.engine import lora

    if form == "torch":
        monkeypatch.setattr(lora, "choose_lora_kernel",
                            lambda device, dtype: Choice("torch", ("the test's torch form",)))
    elif not lora.choose_lora_kernel(torch.device("cpu"), torch.float32).kiln:
        pytest.skip("kiln's CPU kernels do not run on this CPU (no x86 AVX2)")
    base_dir, paths, ref = tiny
    eng = tiny_engine(base_dir, paths)
    g = torch.Generator().manual_seed(1)
    prompts = {k: torch.randint(0, 256, (n,), generator=g).tolist()
               for k, n in (("base", 11), ("a1", 17), ("a2", 9), ("a3", 14))}
    for k, ids in prompts.items():
        eng.add_request(k, ids, SamplingParams(temperature=0, max_tokens=6, min_tokens=6,
                                               prompt_logprobs=5,
                                               lora=None if k == "base" else k))
    got_lps: dict[str, list] = {}
    got_ids: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for o in eng.step():
            got_ids.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
            if o.prompt_logprobs is not None:
                got_lps[o.request_id] = o.prompt_logprobs
        # every prompt prefilled in the first step: one batch of three adapters and the base
        assert not eng.scheduler.waiting and len(got_lps) == 4
    for k, ids in prompts.items():
        adapter = None if k == "base" else k
        want = torch.log_softmax(ref_logits(ref, ids, adapter), -1)
        for pos, lp in enumerate(got_lps[k][1:]):
            row = want[pos]
            assert abs(lp.logprob - row[ids[pos + 1]].item()) < 1e-3, (k, pos)
            for tok, v in lp.top:
                assert abs(v - row[tok].item()) < 1e-3, (k, pos, tok)
        with torch.no_grad():
            if adapter is None:
                with ref.disable_adapter():
                    out = ref.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                       min_new_tokens=6, pad_token_id=0)
            else:
                ref.set_adapter(adapter)
                out = ref.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                   min_new_tokens=6, pad_token_id=0)
        assert got_ids[k] == out[0, len(ids):].tolist(), k
    # the adapters changed the answers: a zero B would pass everything above
    assert len({tuple(lp.top[0]) for lp in (got_lps[k][3] for k in prompts)}) > 1


def test_an_unloaded_adapters_slot_serves_the_next_one(tiny):
    """Unloading a1 frees its place in every target linear's stacks; a3, loaded next, takes
    it, and a batch of a3 and a2 still decodes as peft does (a stale stack would not)."""
    base_dir, paths, ref = tiny
    eng = tiny_engine(base_dir, {k: paths[k] for k in ("a1", "a2")})
    eng.unload_lora("a1")
    eng.load_lora("a3", str(paths["a3"]))
    assert eng.lora.adapters["a3"].slot == 0 and eng.lora.adapters["a2"].slot == 1
    ids = {"a3": [7, 1, 99, 42, 5, 13], "a2": [3, 3, 200, 17]}
    for k, p in ids.items():
        eng.add_request(k, p, SamplingParams(temperature=0, max_tokens=5, min_tokens=5, lora=k))
    got: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    for k, p in ids.items():
        ref.set_adapter(k)
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=5, min_new_tokens=5,
                                do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert got[k] == want, k


def test_prefix_cache_is_not_shared_between_adapters(tiny):
    """The same prompt again hits the cache under the same adapter, never under another one
    (or the base): the adapter id is part of every block hash."""
    base_dir, paths, _ = tiny
    eng = tiny_engine(base_dir, paths, block_size=16)
    ids = list(range(1, 70))

    def cached(tag: str, adapter: str | None) -> int:
        eng.add_request(tag, ids, SamplingParams(temperature=0, max_tokens=2, lora=adapter))
        n = 0
        while eng.has_unfinished:
            for o in eng.step():
                n = max(n, o.num_cached_tokens)
        return n

    assert cached("first", "a1") == 0
    assert cached("same", "a1") == 64  # the full blocks of the prompt
    assert cached("other", "a2") == 0
    assert cached("base", None) == 0
    eng.kv.check_integrity()


def test_offline_llm_takes_an_adapter_per_generate_call(tiny, smollm2_tokenizer):
    """LLM(lora_modules=[...]).generate(..., lora=name) gives the engine's answers for that
    adapter; an adapter loaded later (LLM.load_lora) too; an unknown name is a clear error."""
    from kiln import LLM
    from kiln.engine.lora import LoRANotFoundError

    base_dir, paths, ref = tiny
    # (the tiny model has no tokenizer: SmolLM2's detokenizes its ids < 256)
    llm = LLM(str(base_dir), tokenizer=smollm2_tokenizer, dtype="float32", compile=False, kv_cache_memory=8 << 20,
              max_model_len=256, lora_modules=[f"a1={paths['a1']}"])
    ids = [5, 9, 33, 2, 71, 100, 4]
    greedy = SamplingParams(temperature=0, max_tokens=5, min_tokens=5)
    llm.load_lora("a3", str(paths["a3"]))
    for adapter in ("a1", "a3"):
        got = llm.generate([ids], greedy, lora=adapter)[0].outputs[0].token_ids
        ref.set_adapter(adapter)
        with torch.no_grad():
            want = ref.generate(torch.tensor([ids]), max_new_tokens=5, min_new_tokens=5,
                                do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
        assert got == want, adapter
    with pytest.raises(LoRANotFoundError) as e:
        llm.generate([ids], greedy, lora="a2")
    assert e.value.code == "lora.not_loaded" and "'a2'" in str(e.value)


# --------------------------------------------------------------------------- checks, settings


def _peft_folder(folder, keys: dict[str, tuple[int, ...]], **cfg):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: torch.ones(s) for k, s in keys.items()},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8,
                                                            "lora_alpha": 16, **cfg}))
    return folder


QA = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
QB = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize("case,code,names", [
    ("missing", "lora.file_missing", "adapter_config.json"),
    ("rank", "lora.rank_too_large", "--max-lora-rank 16"),
    ("embed_key", "lora.unknown_target", "'embed_tokens'"),
    ("target_list", "lora.unknown_target", "lm_head"),
    ("dora", "lora.unsupported_option", "use_dora=True"),
])
def test_bad_adapter_folders_are_one_clear_error(tmp_path, case, code, names):
    from kiln.engine.lora import LoRAError, inspect_adapter

    folder = tmp_path / case
    if case == "rank":
        _peft_folder(folder, {QA: (32, 64), QB: (64, 32)})
    elif case == "embed_key":
        _peft_folder(folder, {QA: (8, 64), QB: (64, 8),
                              "base_model.model.model.embed_tokens.lora_A.weight": (8, 64)})
    elif case == "target_list":
        _peft_folder(folder, {QA: (8, 64), QB: (64, 8)}, target_modules=["q_proj", "lm_head"])
    elif case == "dora":
        _peft_folder(folder, {QA: (8, 64), QB: (64, 8)}, use_dora=True)
    with pytest.raises(LoRAError) as e:
        inspect_adapter("x", folder, max_rank=16)
    assert e.value.code == code and names in str(e.value)  # what is wrong, by name
    assert e.value.hint  # says what to do


def test_serve_refuses_a_bad_adapter_before_loading_the_model(tmp_path, gguf_path):
    """`kiln serve --lora` checks the folder in the planning phase: the error names the adapter
    and the flag, and no weights are loaded (the dry run would load none either)."""
    from kiln import startup
    from kiln.errors import KilnError

    _peft_folder(tmp_path / "big", {QA: (64, 576), QB: (576, 64)})
    args = startup.namespace_for(str(gguf_path), {"lora_modules": [f"big={tmp_path / 'big'}"]})
    sp = startup.StartupPlan(args)
    with pytest.raises(KilnError) as e:
        startup.plan(args, sp)
    assert e.value.code == "lora.rank_too_large" and "'big'" in str(e.value)
    assert sp.phase == "lora" and sp.checkpoint is not None  # opened, nothing loaded


def test_lora_flags_take_vllm_forms_and_repeat():
    """--lora NAME=PATH repeatable, --lora-modules with several values, bare paths and vLLM's
    JSON form all resolve to one list of NAME=PATH; a name given twice is refused."""
    import argparse

    from kiln.errors import ConfigError
    from kiln.settings import sources as S
    from kiln.settings.resolve import resolve_settings

    p = argparse.ArgumentParser()
    S.add_setting_arguments(p)
    args = p.parse_args(["--lora", "a=~/ad/a", "--lora-modules", "/ad/b",
                         '{"name": "c", "path": "/ad/c", "base_model_name": "m"}',
                         "--lora-model-id-template", "<base>:<name>"])
    s = resolve_settings(cli=S.cli_values(args))
    assert s["lora_modules"] == ["a=~/ad/a", "b=/ad/b", "c=/ad/c"]
    assert s["lora_model_id_template"] == "<base>:<name>"
    assert (s["max_loras"], s["max_lora_rank"], s["enable_lora_runtime_updates"]) == (8, 16, False)
    env = resolve_settings(env={"lora_modules": ("a=/x,b=/y", "KILN_LORA_MODULES")})
    assert env["lora_modules"] == ["a=/x", "b=/y"]
    with pytest.raises(ConfigError) as e:
        resolve_settings(cli=S.cli_values(p.parse_args(["--lora", "a=/x", "--lora", "a=/y"])))
    assert e.value.causes == ("lora.name_given_twice",) and "'a'" in str(e.value)


# --------------------------------------------------------------------------- SmolLM2 (Q4_1 GGUF)

SMOL = {"s1": (8, 16, ALL, False), "s2": (4, 8, ["q_proj", "v_proj", "down_proj"], False),
        "s3": (16, 16, ["k_proj", "o_proj", "gate_proj", "up_proj"], True)}


@pytest.fixture(scope="module")
def smol(tmp_path_factory, gguf_path, smollm2_runner):
    """SmolLM2 as transformers dequantizes its GGUF (fp32) with three PEFT adapters saved to
    folders, and kiln's fp32 engine over the shared runner serving them; the adapters are
    taken off the shared runner afterwards. (Loading the GGUF into transformers takes longer
    than the default run's budget: the tests that use it are heavy.)"""
    import peft
    import transformers

    from kiln.engine.engine import Engine
    from kiln.settings.engine_config import EngineConfig

    root = tmp_path_factory.mktemp("smol-lora")
    base = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()
    ref = None
    torch.manual_seed(7)
    for name, (r, alpha, targets, rs) in SMOL.items():
        cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rs,
                              lora_dropout=0.0)
        if ref is None:
            ref = peft.get_peft_model(base, cfg, adapter_name=name)
        else:
            ref.add_adapter(name, cfg)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.03)
    paths = {}
    for name in SMOL:
        ref.save_pretrained(root, selected_adapters=[name])
        paths[name] = root / name
    cfg = EngineConfig.of(model=str(gguf_path), dtype="float32", max_num_seqs=32,
                       max_num_batched_tokens=512,
                       lora_modules=tuple(f"{n}={p}" for n, p in paths.items()))
    eng = Engine(cfg, runner=smollm2_runner)
    yield ref.eval(), paths, eng
    if smollm2_runner.lora is not None:
        smollm2_runner.lora.detach()
        smollm2_runner.lora = None


@pytest.mark.heavy
def test_smollm2_mixed_adapters_match_peft_logits(smol, smollm2_tokenizer):
    """SmolLM2 with three adapters and the base in one batch: each prompt position's
    logprobs (its next token and top 5) equal transformers + peft's within 1e-3."""
    ref, _, eng = smol
    prompts = {"base": "The capital of France is", "s1": "def fibonacci(n):",
               "s2": "Once upon a time, in a land", "s3": "The three primary colors are"}
    ids = {k: smollm2_tokenizer.encode(p) for k, p in prompts.items()}
    for k in prompts:
        eng.add_request(f"p-{k}", ids[k], SamplingParams(
            temperature=0, max_tokens=1, prompt_logprobs=5, lora=None if k == "base" else k))
    got = {}
    while eng.has_unfinished:
        for o in eng.step():
            if o.prompt_logprobs is not None:
                got[o.request_id[2:]] = o.prompt_logprobs
    assert len(got) == 4
    worst = 0.0
    for k, toks in ids.items():
        want = torch.log_softmax(ref_logits(ref, toks, None if k == "base" else k), -1)
        for pos, lp in enumerate(got[k][1:]):
            worst = max(worst, abs(lp.logprob - want[pos, toks[pos + 1]].item()),
                        *(abs(v - want[pos, t].item()) for t, v in lp.top))
    assert worst < 1e-3
    # and the adapters matter: their logprobs are not the base's
    with torch.no_grad(), ref.disable_adapter():
        plain = torch.log_softmax(ref(torch.tensor([ids["s1"]])).logits[0], -1)
    assert abs(got["s1"][1].logprob - plain[0, ids["s1"][1]].item()) > 1e-2


# --------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def smol_adapters(tmp_path_factory, gguf_path, smollm2_runner):
    """Three random PEFT folders for SmolLM2 (written directly: the server test compares with
    kiln's offline engine, not with transformers), and kiln's fp32 engine over the shared
    runner serving them; the adapters are taken off the shared runner afterwards."""
    from benchmarks.lora import write_adapter
    from kiln.engine.engine import Engine
    from kiln.settings.engine_config import EngineConfig

    root = tmp_path_factory.mktemp("smol-adapters")
    paths = {n: write_adapter(root / n, smollm2_runner.model_config, rank, seed=i, std=0.08)
             for i, (n, rank) in enumerate((("t1", 8), ("t2", 4), ("t3", 16)))}
    cfg = EngineConfig.of(model=str(gguf_path), dtype="float32", max_num_seqs=32,
                       max_num_batched_tokens=512,
                       lora_modules=tuple(f"{n}={p}" for n, p in paths.items()))
    yield paths, Engine(cfg, runner=smollm2_runner)
    if smollm2_runner.lora is not None:
        smollm2_runner.lora.detach()
        smollm2_runner.lora = None


def test_layer_kernel_adds_adapters_as_the_eager_layers_do(kernel_level, smol_adapters, gguf_path,
                                                          smollm2_tokenizer, monkeypatch):
    """On the layer kernel (the CPU default) a step with adapter rows runs the kernel, which
    adds each linear's adapters with the same lora_add the eager hooks call: a batch mixing
    three adapters and the base gives the same tokens and logprobs, bit for bit, with the
    kernel turned off (every step eager)."""
    from kiln.engine.model_runner import DECODE_KERNEL_ANY_ROWS
    from kiln.layers.kernels import ops
    from kiln.llm import LLM

    paths, _ = smol_adapters
    # kiln's CPU defaults (int4 layers, batch-invariant): what `kiln serve --lora` runs
    llm = LLM(str(gguf_path), kv_cache_memory=128 << 20,
              lora_modules=tuple(f"{n}={p}" for n, p in paths.items()))
    eng = llm.engine
    runner = eng.runner
    assert runner.decode_kernel_rows >= DECODE_KERNEL_ANY_ROWS and runner.lora.kernel, \
        runner.decisions.decode_path.reason
    prompts = {"base": "The capital of France is", "t1": "def fibonacci(n):",
               "t2": "Once upon a time", "t3": "The three primary colors are"}

    def run() -> dict[str, tuple[list[int], list[float]]]:
        for k, text in prompts.items():
            eng.add_request(f"k-{k}", smollm2_tokenizer.encode(text), SamplingParams(
                temperature=0, max_tokens=6, ignore_eos=True, logprobs=2,
                lora=None if k == "base" else k))
        got: dict[str, tuple[list[int], list[float]]] = {k: ([], []) for k in prompts}
        while eng.has_unfinished:
            for o in eng.step():
                ids, lps = got[o.request_id[2:]]
                ids += o.outputs[0].token_ids
                lps += [lp.logprob for lp in o.outputs[0].logprobs or []]
        return got

    calls = {"with adapters": 0}
    real = ops.decode_layer

    def counted(*a, **kw):
        if len(a) > 19 and a[19]:
            calls["with adapters"] += 1
        return real(*a, **kw)

    with monkeypatch.context() as m:
        m.setattr(ops, "decode_layer", counted)
        kernel = run()
    assert calls["with adapters"] > 0
    rows, runner.decode_kernel_rows = runner.decode_kernel_rows, 0
    try:
        eager = run()
    finally:
        runner.decode_kernel_rows = rows
    assert kernel == eager and all(len(ids) == 6 for ids, _ in kernel.values())


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, gguf_path, smol_adapters):
    """`kiln serve` (fp32, test_server's flags) with adapters t1, t2 named <base>:<name>, and
    runtime updates on."""
    from test_server import _serve

    paths, _ = smol_adapters
    yield from _serve(tmp_path_factory.mktemp("lora-serve"), gguf_path,
                      "--lora", f"t1={paths['t1']}", f"t2={paths['t2']}",
                      "--lora-model-id-template", "<base>:<name>",
                      "--enable-lora-runtime-updates")


def _offline(eng, prompt_ids: list[int], adapter: str | None, tag: str) -> list[int]:
    eng.add_request(tag, prompt_ids, SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True, lora=adapter))
    out: list[int] = []
    while eng.has_unfinished:
        for o in eng.step():
            out += o.outputs[0].token_ids
    return out


@pytest.mark.heavy  # a server start with adapters: outside make test's time budget
def test_server_answers_each_adapter_as_offline_and_loads_unloads(lora_server, smol_adapters,
                                                                   smollm2_tokenizer):
    """Base and two adapters asked at once through the openai client: each answer's tokens
    are the offline engine's for that adapter. /v1/models lists the adapters with the base as
    parent; an adapter loaded at runtime answers as offline too; unloaded, it is a 404, as an
    unknown model is; a bad path is a 400 naming lora_path."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import openai
    from test_server import API_KEY, NAMES

    paths, eng = smol_adapters
    client = lora_server.client()
    prompt = "Write one sentence about the sea."
    ids = smollm2_tokenizer.encode(prompt)

    def ask(model: str) -> str:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text

    base, t1, t2 = NAMES[0], f"{NAMES[0]}:t1", f"{NAMES[0]}:t2"
    models = {m["id"]: m for m in httpx.get(
        f"{lora_server.base_url}/v1/models",
        headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"]}
    assert models[t1]["parent"] == base and models[t2]["root"] == str(paths["t2"])
    assert models[base]["parent"] is None
    with ThreadPoolExecutor(3) as pool:
        texts = dict(zip((None, "t1", "t2"), pool.map(ask, [base, t1, t2])))
    for adapter, got in texts.items():
        want = smollm2_tokenizer.decode(_offline(eng, ids, adapter, f"off-{adapter}"),
                                         skip_special_tokens=True)
        assert got == want, adapter
    assert len(set(texts.values())) == 3  # three different answers

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{lora_server.base_url}/v1/{path}", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"})

    r = post("load_lora_adapter", {"lora_name": "t3", "lora_path": str(paths["t3"])})
    assert r.status_code == 200 and "t3" in r.text
    assert ask(f"{base}:t3") == smollm2_tokenizer.decode(_offline(eng, ids, "t3", "off-t3"),
                                                         skip_special_tokens=True)
    bad = post("load_lora_adapter", {"lora_name": "t4", "lora_path": "/nonexistent/t4"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert bad.json()["error"]["code"] == "lora.file_missing"
    assert "/nonexistent/t4" in bad.json()["error"]["message"]
    assert post("unload_lora_adapter", {"lora_name": "t3"}).status_code == 200
    with pytest.raises(openai.NotFoundError) as gone_model:
        ask(f"{base}:t3")
    assert gone_model.value.code == "model_not_found"
    gone = post("unload_lora_adapter", {"lora_name": "t3"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
