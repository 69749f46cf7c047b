"""EngineLoop with no model: the core on the fake runner of tests/engine/test_core.py, the real OutputProcessor on
the byte tokenizer. The loop keeps the core's and the processor's registries in step (add all or nothing,
aborts from both), finishes a request in the core in the very step its stop string completes, and the server's
engine thread, driving the same loop, reports exactly what the offline loop does. Expected texts come from the
made-up model's greedy reference decoded whole and cut with ``str.find``, never from the loop itself.
"""

from __future__ import annotations

import asyncio

import pytest

from pagedkv.engine.core import EngineCore
from pagedkv.engine.core_thread import AddCommand, EngineThread
from pagedkv.engine.loop import EngineLoop
from pagedkv.engine.output_processor import OutputProcessor
from pagedkv.engine.request import OutputKind, Request, RequestOutput
from pagedkv.sampling_params import SamplingParams
from tests.engine.byte_tokenizer import ByteTokenizer
from tests.engine.harness import assert_nothing_held, greedy_reference, make_scheduler
from tests.engine.test_core import PROMPTS, FakeRunner, FaultySampler

TOKENIZER = ByteTokenizer({i: chr(ord("@") + i).encode() for i in range(1, 60)})  # one letter per token id


def make_loop(**scheduler_options) -> EngineLoop:
    core = EngineCore(make_scheduler(**scheduler_options), FakeRunner(), FaultySampler(()))
    return EngineLoop(core, OutputProcessor(TOKENIZER))


def build(*names: str, **params) -> list[list[Request]]:
    """The built (single-sample, greedy) requests of these prompts, as ``LLMEngine.make_requests`` makes them."""
    sampling = SamplingParams(temperature=0.0, **params)
    return [[Request(name, name, 0, list(PROMPTS[name]), len(PROMPTS[name]), sampling)] for name in names]


def add(loop: EngineLoop, *names: str, kind: OutputKind = OutputKind.FINAL_ONLY, **params) -> None:
    loop.add(build(*names, **params), [None] * len(names), kind)


def run(loop: EngineLoop, max_steps: int = 200) -> dict[str, RequestOutput]:
    """Step until nothing is left; each group's final output."""
    final: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not loop.core.has_unfinished_requests():
            return final
        final.update((out.request_id, out) for out in loop.step() if out.finished)
    raise AssertionError("requests left unfinished")


def reference_text(name: str, max_tokens: int) -> str:
    return TOKENIZER.decode(greedy_reference(PROMPTS[name], max_tokens))


def test_the_loop_turns_each_request_into_the_text_of_the_reference():
    loop = make_loop()
    add(loop, *PROMPTS, max_tokens=12)
    final = run(loop)
    assert {name: out.outputs[0].text for name, out in final.items()} == {n: reference_text(n, 12) for n in PROMPTS}
    assert {out.outputs[0].finish_reason for out in final.values()} == {"length"}
    assert not loop.processor.groups
    assert_nothing_held(loop.core.scheduler)


def test_a_stop_string_finishes_its_request_in_the_core_in_the_same_step():
    loop = make_loop()
    text = reference_text("a", 30)
    stop = text[6:9]
    add(loop, "a", max_tokens=30, stop=[stop])
    add(loop, "b", max_tokens=30)
    for _ in range(100):
        finished = [out for out in loop.step() if out.finished]
        if finished:
            break
    assert [(o.request_id, o.outputs[0].text, o.outputs[0].stop_reason) for o in finished] == [
        ("a", text[: text.find(stop)], stop)
    ]
    assert "a" not in loop.core.scheduler.requests and "a" not in loop.core.scheduler.kv.block_tables()
    assert run(loop)["b"].outputs[0].text == reference_text("b", 30)
    assert_nothing_held(loop.core.scheduler)


def test_an_abort_takes_the_group_out_of_both_registries():
    loop = make_loop()
    add(loop, *PROMPTS, max_tokens=40)
    loop.step()
    assert loop.abort("b") and not loop.abort("b") and not loop.abort("no-such-request")
    assert "b" not in loop.processor.groups and "b" not in loop.core.scheduler.requests
    assert set(run(loop)) == {"a", "c"}
    add(loop, "a", "c", max_tokens=40)
    loop.step()
    assert sorted(loop.abort_all()) == ["a", "c"]
    assert not loop.processor.groups and not loop.core.has_unfinished_requests()
    assert_nothing_held(loop.core.scheduler)


def test_prompts_are_added_all_or_none(monkeypatch):
    loop = make_loop()
    real_add = loop.core.scheduler.add

    def refuse_b(request):
        if request.group_id == "b":
            raise RuntimeError("the scheduler refused the request")
        real_add(request)

    monkeypatch.setattr(loop.core.scheduler, "add", refuse_b)
    with pytest.raises(RuntimeError, match="refused"):
        add(loop, *PROMPTS)
    assert not loop.processor.groups and not loop.core.has_unfinished_requests()  # "a" went in first, and out again
    assert_nothing_held(loop.core.scheduler)


def test_the_server_s_engine_thread_reports_what_the_offline_loop_reports():
    offline = make_loop()
    add(offline, *PROMPTS, kind=OutputKind.DELTA, max_tokens=10)
    expected: dict[str, str] = {}
    for _ in range(100):
        for out in offline.step():
            expected[out.request_id] = expected.get(out.request_id, "") + out.outputs[0].delta_text

    async def serve() -> dict[str, str]:
        served = make_loop()
        texts: dict[str, str] = {}
        finished: set[str] = set()
        done = asyncio.Event()

        def deliver(outputs: list[RequestOutput]) -> None:  # on the event loop, as AsyncEngine._deliver
            for out in outputs:
                texts[out.request_id] = texts.get(out.request_id, "") + out.outputs[0].delta_text
                finished.update([out.request_id] if out.finished else [])
            if finished == set(PROMPTS):
                done.set()

        thread = EngineThread(served, asyncio.get_running_loop(), deliver, print, print, lambda stats: None)
        thread.start()
        added = asyncio.get_running_loop().create_future()
        requests = build(*PROMPTS, max_tokens=10)
        thread.submit(AddCommand(requests, [None] * len(requests), OutputKind.DELTA, added))
        await added
        await asyncio.wait_for(done.wait(), 30)
        assert await asyncio.to_thread(thread.stop, 5)
        assert_nothing_held(served.core.scheduler)
        return texts

    assert asyncio.run(serve()) == expected == {name: reference_text(name, 10) for name in PROMPTS}
