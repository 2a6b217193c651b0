"""prompt_logprobs in the engine: each prompt token's logprob given the ones before it, equal to a
whole-prompt forward pass, through chunked prefill and past a warm prefix cache."""

from __future__ import annotations

import torch
from conftest import run_to_completion

from kiln.sampling_params import SamplingParams

PROMPT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor "
          "jugs, and then the sphinx of black quartz judges my vow.")


def _reference(runner, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(runner.prompt_logits(ids).float(), dim=-1)


def test_prompt_logprobs_match_a_forward_pass_through_chunked_prefill(
        make_engine, smollm2_runner, smollm2_tokenizer) -> None:
    ids = smollm2_tokenizer.encode(PROMPT)
    assert len(ids) > 24
    # A 16-token budget splits the prompt into chunks (and may leave a one-token chunk).
    eng = make_engine(max_num_batched_tokens=16)
    eng.add_request("a", ids, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))
    outs = []
    while eng.has_unfinished:
        outs += eng.step()
    firsts = [o for o in outs if o.prompt_logprobs is not None]
    assert len(firsts) == 1, "prompt logprobs come once, on the first output"
    plp = firsts[0].prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    ref = _reference(smollm2_runner, ids)
    for p in range(1, len(ids)):
        lp = plp[p]
        assert lp is not None and lp.token_id == ids[p]
        assert abs(lp.logprob - ref[p - 1, ids[p]].item()) < 1e-4, p
        assert lp.rank == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
        assert [t for t, _ in lp.top] == ref[p - 1].topk(3).indices.tolist()


def test_prompt_logprobs_skip_the_prefix_cache(make_engine, smollm2_runner,
                                               smollm2_tokenizer) -> None:
    ids = smollm2_tokenizer.encode(PROMPT)
    eng = make_engine()
    eng.add_request("warm", ids, SamplingParams(max_tokens=1, temperature=0))
    run_to_completion(eng)
    eng.add_request("cached", ids, SamplingParams(max_tokens=1, temperature=0))
    outs = []
    while eng.has_unfinished:
        outs += eng.step()
    assert outs[-1].num_cached_tokens > 0  # the cache is warm for this prompt
    eng.add_request("scored", ids, SamplingParams(max_tokens=1, temperature=0,
                                                  prompt_logprobs=0))
    outs = []
    while eng.has_unfinished:
        outs += eng.step()
    assert outs[-1].num_cached_tokens == 0
    plp = next(o.prompt_logprobs for o in outs if o.prompt_logprobs is not None)
    ref = _reference(smollm2_runner, ids)
    got = torch.tensor([lp.logprob for lp in plp[1:]])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(got, want, atol=1e-4)
    assert all(lp.top == [] for lp in plp[1:])  # prompt_logprobs=0: the token alone
    eng.check_idle_integrity()
