"""Sampler: seeded reproducibility, penalties, top-k / top-p / min-p masks, min_tokens, logprobs.

Runs on CPU over synthetic logits (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.engine.request import Request
from kiln.engine.sampler import Sampler
from kiln.sampling_params import SamplingParams

V = 64
NEG = float("-inf")


def make_req(rid: str, prompt=(1, 2, 3), output=(), eos=(), **params) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**params), eos_token_ids=frozenset(eos))
    r.output_token_ids = list(output)
    return r


def logits_for(step: int, rid: str, batch: int = 1) -> torch.Tensor:
    """Logits that depend only on (step, request), so the batch around them does not matter."""
    g = torch.Generator().manual_seed(hash((step, rid)) & 0xFFFF_FFFF)
    return torch.randn(batch, V, generator=g) * 2


# --------------------------------------------------------------------------- seeds


def run_seeded(seed: int, others: int, position: int, steps: int = 12) -> list[int]:
    """Tokens a seeded request gets over `steps`, batched with `others` unseeded requests."""
    sampler = Sampler(V, torch.device("cpu"), seed=123 + others)
    me = make_req("me", temperature=1.0, top_p=0.9, seed=seed)
    crowd = [make_req(f"o{i}", temperature=0.7 + 0.1 * i) for i in range(others)]
    out = []
    for step in range(steps):
        batch = crowd[:position] + [me] + crowd[position:]
        logits = torch.cat([logits_for(step, r.request_id) for r in batch])
        tokens = sampler(logits, batch).token_ids
        out.append(tokens[batch.index(me)])
        me.output_token_ids.append(out[-1])
    return out


def test_same_seed_gives_the_same_tokens_whatever_the_batch():
    alone = run_seeded(7, others=0, position=0)
    assert run_seeded(7, others=3, position=0) == alone
    assert run_seeded(7, others=5, position=5) == alone
    assert run_seeded(7, others=2, position=1) == alone
    assert run_seeded(8, others=0, position=0) != alone  # the seed matters


def test_a_seeded_request_does_not_change_the_others_greedy_tokens():
    sampler = Sampler(V, torch.device("cpu"))
    greedy = make_req("g", temperature=0.0)
    seeded = make_req("s", temperature=1.0, seed=1)
    logits = torch.cat([logits_for(0, "g"), logits_for(0, "s")])
    tokens = sampler(logits, [greedy, seeded]).token_ids
    assert tokens[0] == logits[0].argmax().item()


def test_sampling_follows_the_distribution():
    sampler = Sampler(4, torch.device("cpu"), seed=0)
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    reqs = [make_req(f"r{i}", temperature=1.0) for i in range(4000)]
    tokens = torch.tensor(sampler(probs.log().expand(4000, 4).clone(), reqs).token_ids)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03) and freq[3] == 0


# --------------------------------------------------------------------------- penalties


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    sampler = Sampler(V, torch.device("cpu"))
    logits = torch.zeros(1, V)
    logits[0, 1], logits[0, 2], logits[0, 5], logits[0, 9] = 4.0, -4.0, 3.0, 2.0
    r = make_req("r", prompt=(1, 2), output=(5,), repetition_penalty=2.0)
    out = sampler._apply_penalties(logits, [r])
    assert out[0, 1] == 2.0 and out[0, 2] == -8.0  # prompt tokens count (HF/vLLM)
    assert out[0, 5] == 1.5  # and generated ones
    assert out[0, 9] == 2.0 and out[0, 0] == 0.0  # unseen tokens are untouched
    assert logits[0, 1] == 4.0  # the caller's logits are not modified


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    sampler = Sampler(V, torch.device("cpu"))
    logits = torch.full((1, V), 1.0)
    r = make_req("r", prompt=(3, 3, 3), output=(7, 7, 7, 8), presence_penalty=0.5,
                 frequency_penalty=0.25)
    out = sampler._apply_penalties(logits, [r])
    assert out[0, 7].item() == pytest.approx(1.0 - 0.5 - 3 * 0.25)
    assert out[0, 8].item() == pytest.approx(1.0 - 0.5 - 0.25)
    assert out[0, 3].item() == 1.0  # in the prompt only: OpenAI semantics leave it alone
    plain = make_req("p", output=(7,))
    assert torch.equal(sampler._apply_penalties(logits, [plain]), logits)


def test_penalties_apply_to_their_own_row_only():
    sampler = Sampler(V, torch.device("cpu"))
    logits = torch.ones(2, V)
    a = make_req("a", output=(4,), presence_penalty=1.0)
    b = make_req("b", output=(4,))
    out = sampler._apply_penalties(logits, [a, b])
    assert out[0, 4] == 0.0 and out[1, 4] == 1.0


def test_a_penalty_changes_the_greedy_choice():
    sampler = Sampler(V, torch.device("cpu"))
    logits = torch.zeros(1, V)
    logits[0, 10], logits[0, 11] = 5.0, 4.0
    r = make_req("r", output=(10,), temperature=0.0, frequency_penalty=2.0)
    assert sampler(logits, [r]).token_ids == [11]


# --------------------------------------------------------------------------- masks


def masked(logits: torch.Tensor, **params) -> list[int]:
    out = Sampler._apply_top_k_top_p_min_p(logits.clone(), [SamplingParams(**params)])
    return [i for i in range(logits.shape[1]) if out[0, i] != NEG]


PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])


def test_top_k_keeps_the_k_best():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    assert masked(logits, top_k=2) == [1, 3]
    assert masked(logits, top_k=0) == [0, 1, 2, 3, 4]


def test_top_p_keeps_the_smallest_set_reaching_p():
    lg = PROBS.log()
    assert masked(lg, top_p=0.8) == [0, 1]  # 0.5 + 0.3 reaches 0.8
    assert masked(lg, top_p=0.81) == [0, 1, 2]
    assert masked(lg, top_p=0.4) == [0]  # the best token always stays
    assert masked(lg, top_p=1.0, top_k=4) == [0, 1, 2, 3]


def test_top_p_one_with_top_k_keeps_a_peaked_distribution_whole():
    # The best token's probability rounds to 1.0 in fp32: a cumulative mass test against 1.0
    # would drop the whole tail from the top-k.
    logits = torch.zeros(1, 1000)
    logits[0, 0] = 25.0
    assert len(masked(logits, top_k=1000, top_p=1.0)) == 1000


def _sorted_cut(logits: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The reference: a full sort, top-k, then the smallest prefix reaching top_p."""
    vals, idx = logits.sort(descending=True)
    n = top_k if top_k > 0 else len(vals)
    probs = torch.softmax(vals[:n], dim=-1)
    cum_before = probs.cumsum(0) - probs
    n = int((cum_before < top_p).sum()) if top_p < 1.0 else n
    return set(idx[:n].tolist())


def test_top_k_top_p_over_a_large_vocab_equal_a_full_sort():
    """The cut is searched in a window of the best logits (topk) and widened when a nucleus
    may pass it: peaked, flat (nucleus wider than every window) and top-k rows in one batch all
    keep exactly the tokens a full sort keeps."""
    g = torch.Generator().manual_seed(3)
    vocab = 8192
    rows = [(0, 0.9, 4.0), (40, 1.0, 3.0), (0, 0.95, 0.01), (300, 0.5, 2.0), (0, 1.0, 1.0),
            (5000, 0.99, 0.05)]  # (top_k, top_p, logit scale): scale 0.01 is nearly flat
    logits = torch.cat([torch.randn(1, vocab, generator=g) * sc for _, _, sc in rows])
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p) for k, p, _ in rows]
    out = Sampler._apply_top_k_top_p_min_p(logits, params)
    for i, (k, p, _) in enumerate(rows):
        got = set(torch.nonzero(out[i] > NEG).flatten().tolist())
        want = _sorted_cut(logits[i], k, p)
        assert got == want, f"row {i}: {len(got)} vs {len(want)} tokens"
    assert len(_sorted_cut(logits[2], 0, 0.95)) > 4096  # the flat row needed the full width


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    lg = PROBS.log()
    assert masked(lg, min_p=0.2) == [0, 1, 2]  # 0.05 < 0.2 * 0.5
    assert masked(lg, min_p=0.61) == [0]


def test_masked_tokens_are_never_sampled():
    sampler = Sampler(V, torch.device("cpu"), seed=3)
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0)).expand(500, V)
    top5 = set(logits[0].topk(5).indices.tolist())
    reqs = [make_req(f"r{i}", temperature=1.5, top_k=5) for i in range(500)]
    assert set(sampler(logits.clone(), reqs).token_ids) <= top5


# --------------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    sampler = Sampler(V, torch.device("cpu"))
    logits = torch.zeros(1, V)
    logits[0, 0], logits[0, 1], logits[0, 2] = 9.0, 8.0, 7.0  # eos, stop, ordinary
    for n_out, want in ((0, 2), (2, 2), (3, 0)):
        r = make_req("r", output=[5] * n_out, eos=(0,), temperature=0.0, min_tokens=3,
                     stop_token_ids=[1])
        assert sampler(logits, [r]).token_ids == [want], n_out
        assert logits[0, 0] == 9.0  # masked on a copy, not in the caller's logits
    r = make_req("r", eos=(0,), temperature=0.0, min_tokens=3, ignore_eos=True)
    assert sampler(logits, [r]).token_ids == [0]  # ignore_eos: EOS is an ordinary token


# --------------------------------------------------------------------------- logprobs


def test_logprobs_match_log_softmax_of_the_raw_logits():
    sampler = Sampler(V, torch.device("cpu"), seed=5)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(9)) * 3
    reqs = [make_req("a", temperature=0.0, logprobs=5),
            make_req("b", temperature=1.0, logprobs=0, repetition_penalty=1.5),
            make_req("c", temperature=0.8)]
    ref = torch.log_softmax(logits, dim=-1)
    out = sampler(logits.clone(), reqs)
    a, b, c = out.logprobs
    assert c is None
    assert a.token_id == out.token_ids[0] == ref[0].argmax().item()
    assert math.isclose(a.logprob, ref[0, a.token_id].item(), abs_tol=1e-5)
    top_v, top_i = ref[0].topk(5)
    assert [t for t, _ in a.top] == top_i.tolist()
    assert all(math.isclose(x, y, abs_tol=1e-5) for (_, x), y in zip(a.top, top_v.tolist()))
    assert b.top == [] and b.token_id == out.token_ids[1]
    assert math.isclose(b.logprob, ref[1, b.token_id].item(), abs_tol=1e-5)


def test_top_logprobs_break_ties_by_the_lowest_token_id_like_argmax():
    """bf16 logits tie often: the greedy token (argmax: lowest id among equals) comes first, and
    the list equals a stable sort of the whole vocabulary, also across the k-th place."""
    sampler = Sampler(V, torch.device("cpu"))
    logits = torch.zeros(2, V)
    logits[0, [7, 3, 40, 12]] = 2.0  # four-way tie for the best, asked for 3
    logits[1, [9, 20]] = 1.0
    logits[1, 5] = 3.0
    reqs = [make_req("a", temperature=0.0, logprobs=3), make_req("b", temperature=0.0, logprobs=4)]
    out = sampler(logits.clone(), reqs)
    ref = torch.log_softmax(logits, dim=-1)
    for i, lp in enumerate(out.logprobs):
        ids = ref[i].sort(descending=True, stable=True).indices
        n = reqs[i].params.logprobs
        assert [t for t, _ in lp.top] == ids[:n].tolist()
        assert lp.top[0][0] == out.token_ids[i] == ref[i].argmax().item()
    assert [t for t, _ in out.logprobs[0].top] == [3, 7, 12]
    assert [t for t, _ in out.logprobs[1].top] == [5, 9, 20, 0]


def test_greedy_tokens_is_torch_argmax_ties_nan_and_views():
    """greedy_tokens (NumPy's argmax on CPU fp32) picks what torch's argmax picks: the lowest id
    among equal maxima, the first NaN, on contiguous rows and on a column-cut view (the
    verifier's logits[:, :V])."""
    from kiln.engine.sampler import greedy_tokens

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1000, generator=g)
    x[1, 7] = x[1, 9] = x[1, 900] = 100.0
    x[2, 3] = x[2, 5] = float("nan")
    x[3] = 0.0
    for t in (x, x[:, :500], x[2:5], x.to(torch.bfloat16)):
        got = greedy_tokens(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(dim=-1))
    assert greedy_tokens(x).tolist()[1:4] == [7, 3, 0]


# --------------------------------------------------------------------------- greedy rows


class _SoftmaxRows(torch.overrides.TorchFunctionMode):
    """Records the row count of every softmax / log-softmax the sampler computes."""

    def __init__(self) -> None:
        super().__init__()
        self.softmax: list[int] = []
        self.log_softmax: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax):
            self.softmax.append(args[0].shape[0])
        if func in (torch.log_softmax, torch.Tensor.log_softmax,
                    torch.nn.functional.log_softmax):
            self.log_softmax.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


def test_greedy_rows_take_the_argmax_without_a_softmax_or_logprobs_unless_asked():
    """ferrum's --greedy-argmax, kiln's only greedy path: in a batch of 6 where 2 rows sample
    and 1 asks for logprobs, the distribution is built for the 2 and log-softmax for the 1; the
    tokens are what a whole-batch pass gives (same seed, same draws)."""
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(3)) * 2
    reqs = [make_req("g0", temperature=0.0), make_req("s1", temperature=0.9, top_p=0.8),
            make_req("g2", temperature=0.0, logprobs=2), make_req("g3", temperature=0.0),
            make_req("s4", temperature=1.2, seed=4), make_req("g5", temperature=0.0)]
    with _SoftmaxRows() as seen:
        out = Sampler(V, torch.device("cpu"), seed=11)(logits.clone(), reqs)
    assert seen.softmax == [2] and seen.log_softmax == [1]
    for i in (0, 2, 3, 5):
        assert out.token_ids[i] == logits[i].argmax().item()
    assert [lp is None for lp in out.logprobs] == [True, True, False, True, True, True]
    assert out.logprobs[2] is not None and out.logprobs[2].token_id == out.token_ids[2]
    assert math.isclose(out.logprobs[2].logprob,
                        torch.log_softmax(logits[2], -1)[out.token_ids[2]].item(), abs_tol=1e-5)
    # The sampled rows drew what they draw with every row sampling (rows 0, 2, 3, 5 at
    # temperature 1 change nothing for rows 1 and 4).
    every = [make_req(r.request_id, **{**vars(r.params), "temperature": r.params.temperature
                                       or 1.0, "logprobs": None}) for r in reqs]
    whole = Sampler(V, torch.device("cpu"), seed=11)(logits.clone(), every).token_ids
    assert out.token_ids[1] == whole[1] and out.token_ids[4] == whole[4]
    # An all-greedy batch computes no softmax at all.
    greedy = [make_req(f"g{i}", temperature=0.0) for i in range(6)]
    with _SoftmaxRows() as seen:
        out = Sampler(V, torch.device("cpu"))(logits.clone(), greedy)
    assert seen.softmax == [] and seen.log_softmax == []
    assert out.token_ids == logits.argmax(dim=-1).tolist()
