"""SamplingParams validation and the batched Sampler, checked against independent per-row references."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.sampler import Sampler, apply_penalties, apply_top_k, apply_top_p, make_generator
from pagedkv.sampling_params import SamplingParams

VOCAB = 512


def sample(logits, params, prompts=None, outputs=None, generators=None, eos=()):
    rows = len(params)
    return Sampler(eos_token_ids=eos)(
        logits,
        params,
        generators if generators is not None else [make_generator(p.seed) for p in params],
        prompts if prompts is not None else [[] for _ in range(rows)],
        outputs if outputs is not None else [[] for _ in range(rows)],
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": 1.0}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must"):
        SamplingParams(**kwargs)


def test_params_normalisation():
    p = SamplingParams(stop="###", top_k=-1, temperature=0, max_tokens=None)
    assert p.stop == ["###"] and p.stop_token_ids == [] and p.top_k == 0 and p.greedy
    assert SamplingParams().stop == [] and not SamplingParams().greedy
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(logprobs=0).logprobs == 0 and SamplingParams(min_tokens=16).min_tokens == 16


def test_greedy_is_argmax_and_leaves_logits_untouched():
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    out = sample(logits, [SamplingParams(temperature=0.0)] * 7)
    assert out.token_ids == logits.argmax(-1).tolist() and out.logprobs is None
    mixed = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(seed=3, top_p=0.5)] * 3
    sample(logits[:6], mixed)
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(min_p=1.0),
        SamplingParams(temperature=1e-3, seed=1),
    ],
)
def test_degenerate_filters_equal_greedy(params):
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    for _ in range(3):
        assert sample(logits, [params] * 16).token_ids == logits.argmax(-1).tolist()


def test_min_p_keeps_exactly_the_tokens_above_the_ratio():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = probs.log().expand(4000, -1).contiguous()
    torch.manual_seed(0)
    drawn = torch.tensor(sample(logits, [SamplingParams(min_p=0.5)] * 4000).token_ids)
    counts = torch.bincount(drawn, minlength=5)
    assert counts[2:].sum() == 0, "0.15 < 0.5 * 0.4 must never be drawn"
    assert abs(counts[0] / 4000 - 4 / 7) < 0.04


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [0.05, 0.5, 1.0, 2.0, 10.0])
def test_empirical_distribution_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.5, -0.5, 0.0])
    draws = 20_000
    torch.manual_seed(1)
    out = sample(logits.expand(draws, -1).contiguous(), [SamplingParams(temperature=temperature)] * draws)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).double()
    # df = 3: P(chi2 > 25) ~ 1.6e-5, so a correct sampler essentially never fails this.
    assert chi_square(counts, torch.softmax(logits.double() / temperature, -1)) < 25


def test_seeded_rows_follow_the_same_distribution():
    logits = torch.tensor([[0.2, 1.5, -1.0, 0.7]])
    generator = make_generator(123)
    counts = torch.zeros(4, dtype=torch.float64)
    for _ in range(3000):
        counts[sample(logits, [SamplingParams(seed=123)], generators=[generator]).token_ids[0]] += 1
    assert chi_square(counts, torch.softmax(logits[0].double(), -1)) < 25


def test_top_k_and_top_p_renormalise_over_the_kept_tokens():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20_000, -1).contiguous()
    torch.manual_seed(2)
    for params, expected in [
        (SamplingParams(top_p=0.7), [5 / 8, 3 / 8, 0, 0]),  # mass above token 2 is 0.8 >= 0.7
        (SamplingParams(top_p=0.85), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
        (SamplingParams(top_k=3), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    ]:
        counts = torch.bincount(torch.tensor(sample(logits, [params] * 20_000).token_ids), minlength=4)
        kept = torch.tensor(expected, dtype=torch.float64) > 0
        assert counts[~kept].sum() == 0
        assert chi_square(counts[kept].double(), torch.tensor(expected, dtype=torch.float64)[kept]) < 25


def test_top_p_matches_a_full_sort_reference_on_flat_and_peaked_rows():
    gen = torch.Generator().manual_seed(3)
    # Flat rows need more than the first candidate stages; peaked ones stop early.
    logits = torch.cat([torch.randn(4, 5000, generator=gen) * 0.1, torch.randn(4, 5000, generator=gen) * 8])
    ps = [0.3, 0.9, 0.99, 0.999, 0.5, 0.8, 1.0, 0.95]
    got = logits.clone()
    apply_top_p(got, ps)
    assert torch.equal(got[6], logits[6]), "p = 1 leaves the row alone"
    for row, p in enumerate(ps):
        probs = logits[row].double().softmax(-1)
        order = probs.argsort(descending=True)
        mass_above = probs[order].cumsum(0) - probs[order]
        expected = torch.zeros(5000, dtype=torch.bool)
        expected[order[mass_above < p]] = True
        assert torch.equal(torch.isfinite(got[row]), expected), f"row {row}, p={p}"


def test_top_k_keeps_the_k_largest_and_skips_disabled_rows():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(7))
    got = logits.clone()
    apply_top_k(got, [0, 3, 100, 1])
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    for row, k in ((1, 3), (3, 1)):
        kept = torch.isfinite(got[row]).nonzero().squeeze(1)
        assert set(kept.tolist()) == set(logits[row].topk(k).indices.tolist())
        assert torch.equal(got[row, kept], logits[row, kept])


def naive_penalties(row: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    row = list(row)
    for token in set(prompt) | set(output):
        rep = p.repetition_penalty
        row[token] = row[token] / rep if row[token] > 0 else row[token] * rep
    for token in set(output):
        row[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return row


def test_penalties_match_naive_per_row_reference():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 64, generator=gen) * 2
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4),
        SamplingParams(repetition_penalty=0.8, presence_penalty=-1.5, frequency_penalty=2.0),
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(repetition_penalty=2.0),
    ]
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (10, 3, 0, 7, 30)]
    outputs = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (5, 12, 9, 0, 40)]
    got = logits.clone()
    apply_penalties(got, params, [torch.tensor(prompts[0])] + prompts[1:], outputs)  # tensors work too
    for i, p in enumerate(params):
        expected = torch.tensor(naive_penalties(logits[i].tolist(), prompts[i], outputs[i], p))
        torch.testing.assert_close(got[i], expected)
    # End to end: greedy rows take the argmax of the penalised logits; rows without penalties are untouched.
    mixed = [SamplingParams(temperature=0, repetition_penalty=1.3), SamplingParams(temperature=0)]
    out = sample(logits[:2], mixed, prompts=prompts[:2], outputs=outputs[:2])
    assert out.token_ids == [got[0].argmax().item(), logits[1].argmax().item()]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(4, 10)
    logits[:, 3] = 10.0  # EOS is by far the most likely
    logits[:, 5] = 9.0  # then a stop token id
    logits[:, 7] = 8.0
    params = [SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5])] * 3 + [
        SamplingParams(temperature=0, min_tokens=3, ignore_eos=True)
    ]
    outputs = [[1], [1, 2], [1, 2, 4], [1]]
    assert sample(logits, params, outputs=outputs, eos=(3,)).token_ids == [7, 7, 3, 3]
    # Column-major logits and stop ids beyond the vocabulary are fine too.
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5, 99], repetition_penalty=1.5)] * 4
    assert sample(logits.t().contiguous().t(), params, outputs=outputs, eos=(3,)).token_ids == [7, 3, 3, 7]


def test_seeded_request_is_independent_of_its_batch_neighbours():
    gen = torch.Generator().manual_seed(5)
    steps = [torch.randn(5, VOCAB, generator=gen) * 2 for _ in range(20)]
    target = SamplingParams(seed=1234, temperature=0.9, top_p=0.95, top_k=200)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(seed=7, min_p=0.05),
        target,
        SamplingParams(),
        SamplingParams(temperature=1.5, top_p=0.5, presence_penalty=0.5),
    ]
    alone_gen = make_generator(1234)
    batch_gens = [make_generator(p.seed) for p in params]
    alone, batched = [], []
    for logits in steps:
        alone.append(sample(logits[2:3], [target], generators=[alone_gen]).token_ids[0])
        batched.append(sample(logits, params, generators=batch_gens, outputs=[[1, 2]] * 5).token_ids[2])
    assert alone == batched
    assert len(set(alone)) > 1, "the seeded row must actually sample, not collapse to greedy"


def test_different_seeds_draw_different_tokens():
    logits = torch.zeros(1, VOCAB)  # uniform: 20 equal draws from two seeds would be a ~1e-54 event
    draws = {}
    for seed in (0, 1):
        generator = make_generator(seed)
        draws[seed] = [
            sample(logits, [SamplingParams(seed=seed)], generators=[generator]).token_ids[0] for _ in range(20)
        ]
    assert draws[0] != draws[1]
    again = make_generator(0)
    assert draws[0] == [sample(logits, [SamplingParams(seed=0)], generators=[again]).token_ids[0] for _ in range(20)]


def test_logprobs_are_sorted_raw_log_softmax():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(6)) * 3
    params = [
        SamplingParams(logprobs=5, temperature=0.7, presence_penalty=1.0),
        SamplingParams(),
        SamplingParams(logprobs=0, temperature=0),
        SamplingParams(logprobs=20, top_k=3, seed=2),
    ]
    out = sample(logits, params, outputs=[[0, 1, 2]] * 4)
    reference = torch.log_softmax(logits.double(), -1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for row, token in enumerate(out.token_ids):
        assert out.logprobs[row] == pytest.approx(reference[row, token].item(), abs=1e-4)
    assert out.top_logprobs[1] is None and out.top_logprobs[2] == []
    for row, n in ((0, 5), (3, 20)):
        top = out.top_logprobs[row]
        values, ids = reference[row].topk(n)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:], strict=False))


def test_bfloat16_logits():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(8)).bfloat16()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=1), SamplingParams(top_k=1)]
    out = sample(logits, params)
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs[1] == pytest.approx(torch.log_softmax(logits.float()[1], -1).max().item(), abs=1e-5)


def test_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="logits must be"):
        sample(torch.zeros(2, 8), [SamplingParams()])
    with pytest.raises(ValueError, match="one entry per row"):
        Sampler()(torch.zeros(1, 8), [SamplingParams()], [None], [], [[]])
