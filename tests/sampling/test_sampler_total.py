"""The sampler is total: any accepted SamplingParams and any logits row give ids in [0, V), never an exception.

One hostile request (hostile params, or a model row full of NaN) must not crash or change the rest of its batch.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.sampler import Sampler, apply_top_p, make_generator
from pagedkv.sampling_params import (
    MAX_LOGPROBS,
    MIN_P_MIN,
    REPETITION_PENALTY_MAX,
    REPETITION_PENALTY_MIN,
    SAMPLING_EPS,
    TEMPERATURE_MAX,
    TOKEN_ID_LIMIT,
    TOP_P_MIN,
    SamplingParams,
)

INF, NAN = math.inf, math.nan
F32_MAX = torch.finfo(torch.float32).max
SPECIALS = (NAN, INF, -INF, F32_MAX, -F32_MAX, 1e30, -1e30, 0.0, 1e-45)
VOCABS = (1, 2, 7, 70)  # 70 > 64: top_p's first candidate stage does not cover the row
PROPERTY = settings(max_examples=200, deadline=None)


def floats_with_edges(lo: float, hi: float, *edges: float) -> st.SearchStrategy[float]:
    return st.sampled_from((lo, hi, *edges)) | st.floats(lo, hi)


def sampling_params(vocab: int) -> st.SearchStrategy[SamplingParams]:
    stop_token_ids = st.sampled_from([[], list(range(vocab)), [TOKEN_ID_LIMIT - 1]]) | st.lists(
        st.integers(0, vocab + 3), max_size=5
    )
    accepted = st.builds(
        SamplingParams,
        temperature=floats_with_edges(0.0, TEMPERATURE_MAX, SAMPLING_EPS / 2, SAMPLING_EPS, 1e-3, 1.0),
        top_p=floats_with_edges(TOP_P_MIN, 1.0, 1e-3, 0.5, 1.0 - 1e-9),
        top_k=st.sampled_from([-1, 0, 1, 2, vocab - 1, vocab, vocab + 1, 2**62]),
        min_p=st.just(0.0) | floats_with_edges(MIN_P_MIN, 1.0, 1e-30, 0.5),
        seed=st.none() | st.sampled_from([-(2**63), 0, 2**64 - 1]) | st.integers(-(2**63), 2**64 - 1),
        presence_penalty=floats_with_edges(-2.0, 2.0, 0.0),
        frequency_penalty=floats_with_edges(-2.0, 2.0, 0.0),
        repetition_penalty=floats_with_edges(REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX, 1.0, 1.3),
        min_tokens=st.integers(0, 3),
        stop_token_ids=stop_token_ids,
        ignore_eos=st.booleans(),
        logprobs=st.none() | st.integers(0, MAX_LOGPROBS),
    )
    plain_greedy = st.just(SamplingParams(temperature=0.0))  # a batch of only these takes the argmax path
    return st.one_of(plain_greedy, accepted, accepted, accepted)


# Built once: hypothesis re-analyses a strategy object each time a new one is made.
PARAMS = {vocab: sampling_params(vocab) for vocab in VOCABS}


@st.composite
def logits_row(draw: st.DrawFn, vocab: int) -> torch.Tensor:
    mode = draw(st.sampled_from(["normal", "all -inf", "all nan", "all +inf", "one finite"]))
    scale = draw(st.sampled_from([1.0, 30.0, 1e4, 1e30, 3e38]))  # 3e38 * randn overflows to +-inf too
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16)))) * scale
    if mode == "all -inf":
        row.fill_(-INF)
    elif mode == "all nan":
        row.fill_(NAN)
    elif mode == "all +inf":
        row.fill_(INF)
    elif mode == "one finite":
        row[torch.arange(vocab) != draw(st.integers(0, vocab - 1))] = draw(st.sampled_from([-INF, NAN]))
    for index, value in draw(st.lists(st.tuples(st.integers(0, vocab - 1), st.sampled_from(SPECIALS)), max_size=6)):
        row[index] = value
    return row


@st.composite
def batches(draw: st.DrawFn):
    vocab = draw(st.sampled_from(VOCABS))
    rows = draw(st.integers(1, 5))
    params = [draw(PARAMS[vocab]) for _ in range(rows)]
    logits = torch.stack([draw(logits_row(vocab)) for _ in range(rows)])
    logits = logits.to(draw(st.sampled_from([torch.float32, torch.bfloat16])))
    if draw(st.booleans()):
        logits = logits.t().contiguous().t()  # column-major, as a strided model output can be
    tokens = st.lists(st.integers(0, vocab - 1), max_size=4)
    prompts = [draw(tokens) for _ in range(rows)]
    outputs = [draw(tokens) for _ in range(rows)]
    eos = draw(st.sampled_from([(), (0,), (vocab - 1,), (0, vocab + 5)]))
    return logits, params, prompts, outputs, eos


def run(logits, params, prompts, outputs, eos=()):
    generators = [make_generator(p.seed) for p in params]
    return Sampler(eos_token_ids=eos)(logits, params, generators, prompts, outputs)


@PROPERTY
@given(batches())
def test_any_accepted_params_and_any_logits_give_ids_in_range(batch):
    logits, params, prompts, outputs, eos = batch
    vocab = logits.shape[1]
    out = run(logits, params, prompts, outputs, eos)
    assert len(out.token_ids) == len(params)
    assert all(isinstance(t, int) and 0 <= t < vocab for t in out.token_ids), out.token_ids
    if any(p.logprobs is not None for p in params):
        assert out.logprobs is not None and len(out.logprobs) == len(params)
        for p, top in zip(params, out.top_logprobs, strict=True):
            assert (top is None) == (p.logprobs is None)
            assert all(0 <= t < vocab for t, _ in top or [])
    # No row changes another: a greedy or seeded row draws the same token alone as in this batch.
    for i, p in enumerate(params):
        if p.greedy or p.seed is not None:
            alone = run(logits[i : i + 1], [p], prompts[i : i + 1], outputs[i : i + 1], eos)
            assert alone.token_ids[0] == out.token_ids[i], f"row {i}: {p}"


one_finite_params = st.builds(
    SamplingParams,
    temperature=floats_with_edges(0.0, TEMPERATURE_MAX, SAMPLING_EPS, 1.0),
    top_p=floats_with_edges(TOP_P_MIN, 1.0),
    top_k=st.integers(-1, 3),
    min_p=st.just(0.0) | floats_with_edges(MIN_P_MIN, 1.0),
    seed=st.none() | st.integers(0, 2**32),
    presence_penalty=floats_with_edges(-2.0, 2.0),
    logprobs=st.none() | st.integers(0, 3),
)


@PROPERTY
@given(
    vocab=st.sampled_from(VOCABS),
    position=st.integers(0, 10**6),
    value=st.sampled_from([0.0, 1e-45, -50.0, 50.0, 1e30, -1e30, F32_MAX, -F32_MAX])
    | st.floats(-1e30, 1e30)
    | st.floats(1e33, F32_MAX),  # / temperature overflows float32
    params=one_finite_params,
    filler=st.sampled_from([-INF, NAN]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_a_row_with_one_finite_token_samples_it(vocab, position, value, params, filler, dtype):
    position %= vocab
    if params.greedy:
        filler = -INF  # greedy is torch's argmax, where NaN counts as the largest value
    row = torch.full((vocab,), filler)
    row[position] = value
    neighbour = torch.randn(vocab)
    logits = torch.stack([row, neighbour]).to(dtype)
    if not math.isfinite(logits[0, position].item()):
        return  # F32_MAX is inf in bfloat16: the row has no finite token left
    batch = [params, SamplingParams(temperature=0.0 if not params.greedy else 1.0, seed=1)]
    out = run(logits, batch, [[position], [0]], [[position], []])
    assert out.token_ids[0] == position


@pytest.mark.parametrize("temperature", [SAMPLING_EPS, 1e-3, 0.5])
def test_a_row_that_overflows_at_low_temperature_takes_its_argmax(temperature):
    # 3e38 / T overflows float32 for every T < 1; the distribution is a point mass on it all the same.
    logits = torch.tensor([[1.0, 3e38, 2e38, -INF, 1e38, 0.0]] * 4)
    params = [SamplingParams(temperature=temperature, seed=seed) for seed in range(3)] + [
        SamplingParams(temperature=temperature, top_p=0.9, top_k=3, min_p=0.1)
    ]
    assert run(logits, params, [[]] * 4, [[]] * 4).token_ids == [1] * 4


def test_a_hostile_row_does_not_change_its_neighbours():
    vocab = 300
    gen = torch.Generator().manual_seed(0)
    steps = [torch.randn(3, vocab, generator=gen) * 3 for _ in range(8)]
    healthy = [SamplingParams(seed=11, top_p=0.9, top_k=50), SamplingParams(temperature=0.0, logprobs=2)]
    hostile = SamplingParams(
        temperature=TEMPERATURE_MAX,
        top_p=TOP_P_MIN,
        min_p=MIN_P_MIN,
        repetition_penalty=REPETITION_PENALTY_MIN,
        min_tokens=5,
        stop_token_ids=list(range(vocab)),
        seed=3,
        logprobs=MAX_LOGPROBS,
    )
    sampler, alone_sampler = Sampler(eos_token_ids=(0,)), Sampler(eos_token_ids=(0,))
    batch_gens = [make_generator(11), None, make_generator(3)]
    alone_gen = make_generator(11)
    for step, logits in enumerate(steps):
        logits[2] = NAN if step % 2 else -INF
        out = sampler(logits, [*healthy, hostile], batch_gens, [[1, 2]] * 3, [[]] * 3)
        assert 0 <= out.token_ids[2] < vocab
        assert out.token_ids[1] == logits[1].argmax().item()
        alone = alone_sampler(logits[:1], healthy[:1], [alone_gen], [[1, 2]], [[]])
        assert alone.token_ids[0] == out.token_ids[0]


def test_top_p_leaves_rows_without_finite_mass_and_filters_the_others():
    logits = torch.tensor([[-INF] * 4, [NAN] * 4, [2.0, 1.0, 0.0, -1.0]])
    apply_top_p(logits, [TOP_P_MIN, 0.5, TOP_P_MIN])
    assert torch.isfinite(logits[2]).tolist() == [True, False, False, False]


@pytest.mark.parametrize(
    ("field", "value", "bound"),
    [
        ("top_p", math.nextafter(TOP_P_MIN, 0.0), TOP_P_MIN),
        ("top_p", 1e-50, TOP_P_MIN),
        ("temperature", math.nextafter(TEMPERATURE_MAX, INF), TEMPERATURE_MAX),
        ("temperature", 1e300, TEMPERATURE_MAX),
        ("repetition_penalty", math.nextafter(REPETITION_PENALTY_MIN, 0.0), REPETITION_PENALTY_MIN),
        ("repetition_penalty", 1e-50, REPETITION_PENALTY_MIN),
        ("repetition_penalty", math.nextafter(REPETITION_PENALTY_MAX, INF), REPETITION_PENALTY_MAX),
        ("min_p", math.nextafter(MIN_P_MIN, 0.0), MIN_P_MIN),
        ("min_p", 1e-50, MIN_P_MIN),
        ("stop_token_ids", [TOKEN_ID_LIMIT], "2**63"),
    ],
)
def test_values_just_outside_a_bound_are_rejected_naming_field_and_range(field, value, bound):
    with pytest.raises(ValueError, match=rf"^{field} must") as info:
        SamplingParams(**{field: value})
    assert str(bound) in str(info.value)


def test_bounds_themselves_are_accepted_and_survive_float32():
    for kwargs in (
        {"top_p": TOP_P_MIN, "temperature": TEMPERATURE_MAX, "min_p": MIN_P_MIN},
        {"repetition_penalty": REPETITION_PENALTY_MIN, "stop_token_ids": [TOKEN_ID_LIMIT - 1]},
        {"repetition_penalty": REPETITION_PENALTY_MAX, "min_p": 0.0, "temperature": 0.0},
    ):
        SamplingParams(**kwargs)
    as_f32 = torch.tensor([TOP_P_MIN, MIN_P_MIN, REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX, TEMPERATURE_MAX])
    assert bool((as_f32 >= torch.finfo(torch.float32).tiny).all() and torch.isfinite(as_f32.log()).all())
    assert torch.tensor(TOKEN_ID_LIMIT - 1, dtype=torch.int64).item() == TOKEN_ID_LIMIT - 1


def test_stop_token_id_set_follows_stop_token_ids():
    params = SamplingParams(stop_token_ids=[5, 9, 5])
    assert params.stop_token_id_set == frozenset({5, 9}) and params.stop_token_ids == [5, 9, 5]
    assert dataclasses.replace(params, stop_token_ids=[1]).stop_token_id_set == frozenset({1})
    assert SamplingParams().stop_token_id_set == frozenset()
    assert "stop_token_id_set" not in repr(params)


def test_verify_for_model_rejects_masking_the_whole_vocabulary():
    vocab, eos = 8, (7,)
    full = SamplingParams(min_tokens=1, stop_token_ids=range(vocab - 1))  # with EOS: all 8 ids
    with pytest.raises(ValueError, match=r"^stop_token_ids must.*ignore_eos=True"):
        full.verify_for_model(vocab, eos)
    with pytest.raises(ValueError, match=r"^stop_token_ids must") as info:
        SamplingParams(min_tokens=2, stop_token_ids=[*range(vocab), 50], ignore_eos=True).verify_for_model(vocab, ())
    assert "ignore_eos" not in str(info.value), "do not suggest what is already set"
    # One id left, EOS freed by ignore_eos, EOS outside the vocabulary, or no min_tokens: fine.
    SamplingParams(min_tokens=1, stop_token_ids=[*range(vocab - 2), 99]).verify_for_model(vocab, eos)
    dataclasses.replace(full, ignore_eos=True).verify_for_model(vocab, eos)
    full.verify_for_model(vocab, (vocab,))
    dataclasses.replace(full, min_tokens=0).verify_for_model(vocab, eos)
