"""LoRA adapters in kiln's engine (kiln/engine/lora.py): PEFT folders made here with random
non-zero B, logits against transformers + peft in float32, several adapters and the base in one
batch, the prefix cache kept apart per adapter, and the checks made before any model work."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

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
    from kiln.config import EngineConfig
    from kiln.engine.engine import Engine

    cfg = EngineConfig(model=str(base_dir), dtype="float32", kv_cache_memory=8 << 20,
                       max_num_batched_tokens=256,
                       lora_modules=tuple(f"{n}={p}" for n, p in paths.items()), **kw)
    return Engine(cfg)


def test_mixed_batch_of_three_adapters_and_base_matches_peft_logits(tiny):
    """One step prefills four prompts (base, a1, a2, a3); every prompt position's logprobs of
    its next token and top 5 equal transformers + peft's within 1e-3; then greedy decoding in
    the mixed batch gives peft's tokens."""
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
            got_ids.setdefault(o.request_id, []).extend(o.new_token_ids)
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
