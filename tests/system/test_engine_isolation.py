"""A request that fails inside the engine fails alone: the others finish exactly as they would have without it.

Faults are injected where a real bug or a hostile input would strike -- the sampler, the detokenizer, the
model call, a caller interrupted in ``LLM.generate`` -- and every test checks the survivors against the
same engine's undisturbed greedy outputs, and that no request or KV block is left behind.
"""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.engine.request import INTERNAL_ERROR

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time", "List three colours:"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
VICTIM_SEED = 4242  # marks the request the injected fault hits


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=256, max_model_len=512, num_threads=1)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def assert_clean(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_used_blocks == 0
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting and not llm.engine.scheduler.requests


def victim_params() -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0.8, seed=VICTIM_SEED)


def run_with_victim(llm: LLM) -> list:
    """The three reference prompts (greedy) plus one seeded request that the fault targets, in one batch."""
    params = [GREEDY] * len(PROMPTS) + [victim_params()]
    return llm.generate([*PROMPTS, "Tell me about cats."], params, use_tqdm=False)


def test_a_sampler_fault_fails_only_its_request(llm, reference, monkeypatch):
    real = llm.engine.core.sampler

    class FaultySampler:
        def __call__(self, logits, params, *args):
            if any(p.seed == VICTIM_SEED for p in params):
                raise RuntimeError("injected sampler fault")
            return real(logits, params, *args)

    monkeypatch.setattr(llm.engine.core, "sampler", FaultySampler())
    outs = run_with_victim(llm)
    assert [o.token_ids for o in outs[:3]] == reference
    assert outs[3].finish_reason == "error" and outs[3].error == INTERNAL_ERROR
    assert llm.stats()["requests_failed"] >= 1
    assert_clean(llm)


def test_a_detokenizer_fault_fails_only_its_request(llm, reference, monkeypatch):
    real_add = llm.engine.add_request

    def add_request(*args, **kwargs):
        request_id = real_add(*args, **kwargs)
        if kwargs["params"].seed == VICTIM_SEED:
            for sample in llm.engine.processor.groups[request_id].samples:
                monkeypatch.setattr(sample.detokenizer, "add_token", _raise)
        return request_id

    monkeypatch.setattr(llm.engine, "add_request", add_request)
    outs = run_with_victim(llm)
    assert [o.token_ids for o in outs[:3]] == reference
    assert outs[3].finish_reason == "error" and outs[3].outputs[0].token_ids == outs[3].token_ids
    assert_clean(llm)


def _raise(*_args, **_kwargs):
    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")


def test_a_model_fault_fails_that_step_and_the_engine_keeps_serving(llm, reference, monkeypatch):
    real_execute = llm.engine.runner.execute
    calls = {"n": 0}

    def execute(step):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected model fault")
        return real_execute(step)

    monkeypatch.setattr(llm.engine.runner, "execute", execute)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(o.finish_reason == "error" for o in outs)  # all three were in the failed step
    assert all(len(o.token_ids) < GREEDY.max_tokens for o in outs)
    assert_clean(llm)
    monkeypatch.setattr(llm.engine.runner, "execute", real_execute)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference


def test_generate_interrupted_leaves_nothing_behind(llm, reference, monkeypatch):
    real_step = llm.engine.step
    calls = {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_clean(llm)
    monkeypatch.setattr(llm.engine, "step", real_step)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cache_salt": "\ud800"}, "cache_salt"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"prompt_token_ids": [1, 2.5, 3]}, "integers"),
        ({"prompt_token_ids": [1, 10**30]}, "prompt token ids"),
        ({"prompt_token_ids": []}, "empty"),
    ],
)
def test_bad_requests_are_refused_whole(llm, kwargs, message):
    prompt = {"prompt_token_ids": list(range(1, 40))}  # > 2 blocks: its keys are hashed at add time
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", params=SamplingParams(n=3), **(prompt | kwargs))
    assert "bad" not in llm.engine.processor.groups and not llm.engine.scheduler.requests
    assert_clean(llm)
    assert llm.engine.step() == []


def test_a_request_that_could_never_stop_is_refused(llm):
    vocab = llm.engine.hf_config.vocab_size
    everything = SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=list(range(vocab)))
    with pytest.raises(ValueError, match="min_tokens"):
        llm.engine.add_request(prompt_token_ids=[1, 2, 3], params=everything)
    assert_clean(llm)
