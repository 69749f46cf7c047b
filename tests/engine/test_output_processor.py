"""The OutputProcessor alone, fed token ids as the scheduler reports them (``CoreOutput``), with no model: stop
strings that span deltas, n > 1 samples, the three output kinds' streaming cursors, logprobs, prompt logprobs,
aborts and a sample whose detokenizing fails. Expected texts come from decoding the whole output at once and
cutting it with ``str.find`` (tests/engine/byte_tokenizer.py), never from the processor itself.
"""

from __future__ import annotations

import pytest

from pagedkv.engine.output_processor import OutputProcessor, Stop
from pagedkv.engine.request import INTERNAL_ERROR, CoreOutput, OutputKind, PromptLogprob, Request, RequestOutput
from pagedkv.sampling_params import SamplingParams
from tests.engine.byte_tokenizer import ByteTokenizer

TEXT = "Héllo wörld, the naïve café said: stop here, then more."
PROMPT = "Say it:"
TOK, (OUT_IDS, PROMPT_IDS) = ByteTokenizer.of_texts(TEXT, PROMPT)


def start(n: int = 1, kind: OutputKind = OutputKind.DELTA, **params) -> OutputProcessor:
    """A processor holding one group "g" of n samples "g-0" .. "g-{n-1}"."""
    processor = OutputProcessor(TOK)
    sampling = SamplingParams(n=n, temperature=0, **params)
    requests = [Request(f"g-{i}", "g", i, list(PROMPT_IDS), len(PROMPT_IDS), sampling) for i in range(n)]
    processor.add(processor.make_group(requests, PROMPT, kind))
    return processor


def feed(processor: OutputProcessor, ids: list[int], chunk: int, request_id: str = "g-0", finish: str = "length"):
    """Report ``ids`` in steps of ``chunk`` tokens, the last step finishing; every output and stop."""
    outputs: list[RequestOutput] = []
    stops: list[Stop] = []
    for at in range(0, len(ids), chunk):
        last = at + chunk >= len(ids)
        core = CoreOutput(request_id, ids[at : at + chunk], finish if last else None)
        out, stop = processor.process([core])
        outputs += out
        stops += stop
    return outputs, stops


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 100])
@pytest.mark.parametrize("stop", ["ö", "the naïve", "é said: st", "here, then more."])
def test_a_stop_string_ends_the_text_before_it_however_the_tokens_arrive(stop, chunk):
    processor = start(stop=[stop])
    outputs, stops = feed(processor, OUT_IDS, chunk)
    expected = TEXT[: TEXT.find(stop)]
    assert "".join(o.outputs[0].delta_text for o in outputs) == expected
    final = outputs[-1].outputs[0]
    assert (final.finish_reason, final.stop_reason, outputs[-1].finished) == ("stop", stop, True)
    # the scheduler is asked to stop the request, unless its last token, which ended it anyway, completed the stop
    completes_on_last_token = stop not in TOK.decode(OUT_IDS[:-1])
    assert stops == ([] if completes_on_last_token else [Stop("g-0", "stop", stop)])


@pytest.mark.parametrize("chunk", [1, 4])
def test_text_that_may_start_a_stop_string_is_held_back_and_released_at_the_end(chunk):
    processor = start(stop=["said: go"])  # TEXT contains "said: " but not "said: go"
    ids = OUT_IDS[: len(TOK.of_texts(TEXT[: TEXT.find("said: ") + 6])[1][0])]  # up to "said: "
    outputs, _ = feed(processor, ids, chunk, finish=None)
    streamed = "".join(o.outputs[0].delta_text for o in outputs)
    assert streamed == TEXT[: TEXT.find("said: ")]  # "said: " could still become the stop string
    last, _ = processor.process([CoreOutput("g-0", [], "length")])
    assert streamed + last[0].outputs[0].delta_text == TEXT[: TEXT.find("said: ") + 6]


def test_stop_strings_wait_for_min_tokens():
    processor = start(stop=["l"], min_tokens=4)  # "Hél" is 4 tokens (é is two): its "l" is too early
    outputs, _ = feed(processor, OUT_IDS, 1)
    assert outputs[-1].outputs[0].text == "" and outputs[-1].outputs[0].delta_text == ""
    assert "".join(o.outputs[0].delta_text for o in outputs) == "Hél"


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_no_broken_character_is_ever_streamed(chunk):
    processor = start()
    outputs, _ = feed(processor, OUT_IDS, chunk)
    deltas = [o.outputs[0].delta_text for o in outputs]
    assert "\ufffd" not in "".join(deltas) and "".join(deltas) == TEXT


@pytest.mark.parametrize("kind", list(OutputKind))
def test_streaming_cursors_of_each_output_kind(kind):
    processor = start(kind=kind)
    outputs, _ = feed(processor, OUT_IDS, 3)
    if kind is OutputKind.FINAL_ONLY:
        assert len(outputs) == 1 and outputs[0].text == TEXT and outputs[0].token_ids == OUT_IDS
        return
    assert len(outputs) == -(-len(OUT_IDS) // 3)
    assert "".join(o.outputs[0].delta_text for o in outputs) == TEXT
    assert sum((o.outputs[0].delta_token_ids for o in outputs), []) == OUT_IDS
    for seen, output in enumerate(outputs, start=1):
        sample = output.outputs[0]
        if kind is OutputKind.DELTA:  # only the new part, so a stream's outputs add up to O(output)
            assert (sample.text, sample.token_ids) == (sample.delta_text, sample.delta_token_ids)
        else:
            assert sample.token_ids == OUT_IDS[: seen * 3] and TEXT.startswith(sample.text)
            assert sample.text.endswith(sample.delta_text)


def test_n_samples_finish_on_their_own_and_the_request_when_all_have():
    processor = start(n=2, kind=OutputKind.CUMULATIVE, stop=["wörld"])
    out, stops = processor.process([CoreOutput("g-0", OUT_IDS[:3], None), CoreOutput("g-1", OUT_IDS[:2], None)])
    assert [s.index for s in out[0].outputs] == [0, 1] and not out[0].finished
    out, stops = processor.process([CoreOutput("g-0", OUT_IDS[3:5], "length"), CoreOutput("g-1", OUT_IDS[2:], None)])
    assert stops == [Stop("g-1", "stop", "wörld")]  # the processor found it: the scheduler must stop g-1
    first, second = out[0].outputs
    assert (first.text, first.finish_reason) == (TOK.decode(OUT_IDS[:5]), "length")
    assert (second.text, second.finish_reason, second.stop_reason) == (TEXT[: TEXT.find("wörld")], "stop", "wörld")
    assert out[0].finished and "g" not in processor.groups  # finished groups are forgotten


def test_the_final_only_output_of_n_samples_comes_once_with_both():
    processor = start(n=2, kind=OutputKind.FINAL_ONLY)
    out, _ = processor.process([CoreOutput("g-0", OUT_IDS[:4], "length"), CoreOutput("g-1", OUT_IDS[:2], None)])
    assert out == []
    out, _ = processor.process([CoreOutput("g-1", OUT_IDS[2:6], "length")])
    assert [s.token_ids for s in out[0].outputs] == [OUT_IDS[:4], OUT_IDS[:6]]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_s_text_is_left_out_unless_asked(include):
    bang = OUT_IDS[TEXT.find(",")]  # "," as a stop token id
    processor = start(stop_token_ids=[bang], include_stop_str_in_output=include)
    upto = TEXT.find(",") + 1
    ids = OUT_IDS[: len(TOK.of_texts(TEXT[:upto])[1][0])]
    out, _ = processor.process([CoreOutput("g-0", ids, "stop", bang, stop_token=True)])
    assert out[0].outputs[0].text == (TEXT[:upto] if include else TEXT[: upto - 1])
    assert out[0].outputs[0].token_ids == ids  # the token itself is reported either way


@pytest.mark.parametrize("kind", [OutputKind.DELTA, OutputKind.CUMULATIVE])
def test_logprobs_follow_their_tokens(kind):
    processor = start(kind=kind, logprobs=1)
    logprob = {t: -t / 100 for t in OUT_IDS}
    outputs = []
    for at in range(0, 9, 3):
        ids = OUT_IDS[at : at + 3]
        core = CoreOutput(
            "g-0", ids, None, logprobs=[logprob[t] for t in ids], top_logprobs=[[(t, logprob[t])] for t in ids]
        )
        outputs += processor.process([core])[0]
    for seen, output in enumerate(outputs, start=1):
        sample = output.outputs[0]
        assert sample.logprobs == [logprob[t] for t in sample.token_ids]
        assert sample.top_logprobs == [[(t, logprob[t])] for t in sample.token_ids]
        assert len(sample.token_ids) == (3 if kind is OutputKind.DELTA else 3 * seen)


def test_prompt_logprobs_are_reported_once_every_position_is_scored():
    processor = start(prompt_logprobs=0, max_tokens=1)
    entries = [PromptLogprob(t, -1.0, 1, []) for t in PROMPT_IDS[1:]]
    out, _ = processor.process([CoreOutput("g-0", [], None, prompt_logprobs=(1, entries[:3]))])
    assert out[0].prompt_logprobs is None  # positions 4.. not scored yet
    out, _ = processor.process([CoreOutput("g-0", OUT_IDS[:1], "length", prompt_logprobs=(4, entries[3:]))])
    assert out[0].prompt_logprobs == [None, *entries]


def test_an_aborted_group_is_forgotten_and_its_later_outputs_ignored():
    processor = start(n=2)
    processor.process([CoreOutput("g-0", OUT_IDS[:2], "length")])
    assert processor.abort("g") == ["g-1"]  # the unfinished sample, for the scheduler to stop
    assert processor.process([CoreOutput("g-1", OUT_IDS[:2], None)]) == ([], [])
    assert processor.abort("g") == []


def test_a_sample_whose_text_fails_stops_alone_with_error():
    processor = start(n=2, kind=OutputKind.CUMULATIVE)
    unknown = max(TOK.pieces) + 1  # no piece: decoding it raises
    out, stops = processor.process([CoreOutput("g-0", OUT_IDS[:4], None), CoreOutput("g-1", [unknown], None)])
    assert stops == [Stop("g-1", "error")]
    good, bad = out[0].outputs
    assert (good.text, good.finish_reason, bad.finish_reason) == (TOK.decode(OUT_IDS[:4]), None, "error")
    assert out[0].error == INTERNAL_ERROR
    out, _ = processor.process([CoreOutput("g-0", OUT_IDS[4:8], "length")])
    assert out[0].outputs[0].text == TOK.decode(OUT_IDS[:8]) and out[0].finished
