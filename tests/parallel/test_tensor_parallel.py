"""Tensor parallelism on torch.distributed (gloo): collectives and the step broadcast on 3 real ranks, sharded
tiny models at TP=2 and TP=3 against TP=1, the default model at TP=3, a killed worker, and sizes refused.

Each distributed configuration runs in fresh processes (spawned ranks), never in the pytest process's own
process group. Tolerances: TP splits the sums of o_proj, down_proj (row-parallel) over ranks, so logits
differ from TP=1 in the last bits; greedy tokens and everything within one TP size are compared exactly.
"""

from __future__ import annotations

import pickle
import threading
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pagedkv import LLM, SamplingParams, kernels
from pagedkv.attention.paged import TorchAttention
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.step_inputs import ScoredRange, StepInputs
from pagedkv.kv.manager import KVCacheManager
from pagedkv.model.loader import load_model
from pagedkv.parallel import wire
from pagedkv.parallel.group import join_group, leave_group
from pagedkv.parallel.workers import TensorParallelFailure, _free_port
from tests.tiny_model import save_tiny_llama

pytestmark = pytest.mark.slow

# 6 query / 3 KV heads of 64, MLP 384, vocabulary 512: splits 3 ways (the vocabulary with padding); the
# default tiny model (4 query / 2 KV heads) splits 2 ways
SPLITS_3 = {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 384, "intermediate_size": 384}
LOGPROB_TOLERANCE = 2e-4  # measured max |TP - TP1| on these models: ~1e-5; fp32 sums in another order
HIDDEN_TOLERANCE = 1e-5  # relative to the layer's largest value; measured: ~1e-6 (fp32 epsilon is 1.2e-7)
BLOCK = 16
STEP = StepInputs(
    input_ids=[5, 17, 300, 42, 7, 9, 511, 200, 3, 64, 77],
    positions=[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3],
    block_tables=[[2], [5]],
    query_lens=[7, 4],
    seq_lens=[7, 4],
    sampled_rows=[6, 10],
    shared_rows=[],
    scored=[ScoredRange(index=1, first_row=7, first_position=1, top=3, targets=[3, 64, 77])],
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tp") / "tiny", **SPLITS_3)


@pytest.fixture(scope="module")
def tiny_models(tiny, tmp_path_factory) -> dict[int, Path]:
    return {2: save_tiny_llama(tmp_path_factory.mktemp("tp") / "tiny2"), 3: tiny}


def _rank_checks(rank: int, world: int, init_method: str, model_dir: str, results) -> None:
    """One rank: an all-reduce, the step broadcast, and a sharded model's hidden states after every layer."""
    torch.set_num_threads(1)
    tp = join_group(rank, world, init_method)
    try:
        x = torch.randn(7, 33, generator=torch.Generator().manual_seed(rank))
        expected_sum = sum(torch.randn(7, 33, generator=torch.Generator().manual_seed(r)) for r in range(world))
        tp.all_reduce(x)
        if tp.is_driver:
            wire.send_lists(tp, STEP.to_wire())
            received = STEP
        else:
            received = StepInputs.from_wire(wire.receive_lists(tp))
        model = load_model(model_dir, "float32", TorchAttention(), False, tp).model
        layers: list[torch.Tensor] = []
        for layer in model.layers:
            layer.register_forward_hook(lambda _m, _i, out: layers.append(out.clone()))
        logits, scores, _ = ModelRunner(model, KVCacheManager(8, BLOCK, False), tp).run(received)
        # By value: a queue would pass the tensors as shared-memory handles that the parent fetches from this
        # process, which may have exited by then (FileNotFoundError under load)
        results.put(pickle.dumps((rank, x, expected_sum, received, layers, logits, scores)))
        if tp.is_driver:
            wire.send_stop(tp)
        else:
            assert wire.receive_lists(tp) is None
    finally:
        leave_group()


def _spawn_ranks(target, world: int, *args) -> list[tuple]:
    context = mp.get_context("spawn")
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    processes = [context.Process(target=target, args=(r, world, init_method, *args, results)) for r in range(world)]
    for process in processes:
        process.start()
    try:
        out = sorted((pickle.loads(results.get(timeout=180)) for _ in range(world)), key=lambda r: r[0])
    finally:
        for process in processes:
            process.join(30)
            if process.exitcode is None:
                process.kill()
    assert [p.exitcode for p in processes] == [0] * world
    return out


def test_collectives_step_broadcast_and_identical_hidden_states_on_3_ranks(tiny):
    ranks = _spawn_ranks(_rank_checks, 3, str(tiny))
    whole = load_model(str(tiny), "float32", TorchAttention(), False).model
    reference_layers: list[torch.Tensor] = []
    for layer in whole.layers:
        layer.register_forward_hook(lambda _m, _i, out: reference_layers.append(out.clone()))
    reference_logits, reference_scores, _ = ModelRunner(whole, KVCacheManager(8, BLOCK, False)).run(STEP)
    _, x0, expected_sum, _, layers0, logits0, scores0 = ranks[0]
    torch.testing.assert_close(x0, expected_sum)
    for rank, x, _, received, layers, _, scores in ranks:
        assert torch.equal(x, x0), f"rank {rank}'s all-reduce differs from rank 0's"
        assert received == STEP, f"rank {rank} received another step"
        assert all(torch.equal(a, b) for a, b in zip(layers, layers0, strict=True)), f"rank {rank} hidden differs"
        assert scores == {} or rank == 0  # only rank 0 scores prompts
    for ours, theirs in zip(layers0, reference_layers, strict=True):  # within fp32 rounding of the largest value
        assert (ours - theirs).abs().max() <= HIDDEN_TOLERANCE * theirs.abs().max()
    assert logits0.shape == reference_logits.shape == (2, 512)
    torch.testing.assert_close(logits0, reference_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(logits0.argmax(-1), reference_logits.argmax(-1))
    (first, entries), (ref_first, ref_entries) = scores0[1], reference_scores[1]
    assert first == ref_first == 1 and [e.token_id for e in entries] == [3, 64, 77]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(entries, ref_entries, strict=True)) < LOGPROB_TOLERANCE


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list:
    ids = [llm.engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
    done = {}
    while llm.engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in llm.engine.step() if o.finished)
    return [done[i].outputs[0] for i in ids]


DEAD_WORKER_WAIT_S = 30  # only ends a wait that hung (the fixed engine raises within milliseconds)
PROMPTS = [[(7 * i + k) % 500 + 5 for i in range(12 + 9 * k)] for k in range(6)]
GREEDY = SamplingParams(max_tokens=10, temperature=0, logprobs=2)


@pytest.mark.parametrize("size", [2, 3])
def test_tiny_model_sharded_2_and_3_ways_matches_one_process(tiny_models, size):
    options = {"model": str(tiny_models[size]), "num_kv_blocks": 64, "num_threads": 1, "max_num_batched_tokens": 64}
    whole = _generate(LLM(**options), PROMPTS, GREEDY)
    runs = []
    for _ in range(2):
        llm = LLM(tensor_parallel_size=size, **options)
        runs.append(_generate(llm, PROMPTS, GREEDY))
        llm.engine.close()
    for one, split, again in zip(whole, *runs, strict=True):
        assert split.token_ids == one.token_ids
        assert max(abs(a - b) for a, b in zip(split.logprobs, one.logprobs, strict=True)) < LOGPROB_TOLERANCE
        assert (again.token_ids, again.logprobs, again.top_logprobs) == (
            split.token_ids,
            split.logprobs,
            split.top_logprobs,
        )  # two TP runs: bitwise


def test_default_model_at_tp3_gives_the_same_greedy_chat_answers_and_exact_mode_the_same_bits():
    questions = ["What is the capital of France?", "Name three fruits.", "Write a haiku about the sea."]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=1)
    one = LLM(num_kv_blocks=128, num_threads=1).chat(conversations, params, use_tqdm=False)
    for exact in (False, True):
        split = LLM(tensor_parallel_size=3, tensor_parallel_exact=exact, num_kv_blocks=128, num_threads=1)
        try:
            three = split.chat(conversations, params, use_tqdm=False)
        finally:
            split.engine.close()
        assert [o.token_ids for o in three] == [o.token_ids for o in one]
        if exact:
            assert [o.outputs[0].logprobs for o in three] == [o.outputs[0].logprobs for o in one]


def test_a_killed_worker_is_an_error_not_a_hang(tiny):
    """The engine raises before its first step (milliseconds). The wait is bounded on its own, not by a
    timeout over the whole test: starting three ranks took 68 s of a 120 s one on 2 busy cores, and a
    wait on the dead worker was only ended by that timeout."""
    llm = LLM(model=str(tiny), tensor_parallel_size=3, num_kv_blocks=64, num_threads=1)
    worker = llm.engine.workers.processes[0]
    worker.kill()
    worker.join(10)
    raised: list[BaseException] = []

    def generate() -> None:
        try:
            _generate(llm, PROMPTS[:2], GREEDY)
        except BaseException as exc:  # noqa: BLE001 - checked below
            raised.append(exc)

    thread = threading.Thread(target=generate, daemon=True)  # a hung one is left behind, the test failed
    thread.start()
    thread.join(DEAD_WORKER_WAIT_S)
    assert not thread.is_alive(), f"the engine still waits on the dead worker after {DEAD_WORKER_WAIT_S} s"
    assert len(raised) == 1 and isinstance(raised[0], TensorParallelFailure), raised
    assert "exited" in str(raised[0])
    llm.engine.close()


def test_a_size_that_does_not_divide_the_heads_is_refused(tiny_models):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide"):
        LLM(model=str(tiny_models[2]), tensor_parallel_size=3, num_kv_blocks=16)  # 4 query / 2 KV heads


def test_kernel_attention_shards_too(tiny):
    """The compiled paged-attention kernel takes each rank's heads (the GQA ratio stays the same)."""
    if not kernels.portable.available():
        pytest.skip("the attention kernel does not build here")
    options = {"model": str(tiny), "num_kv_blocks": 64, "num_threads": 1, "attention_backend": "kernel"}
    whole = _generate(LLM(**options), PROMPTS[:3], GREEDY)
    llm = LLM(tensor_parallel_size=3, **options)
    split = _generate(llm, PROMPTS[:3], GREEDY)
    llm.engine.close()
    assert [o.token_ids for o in split] == [o.token_ids for o in whole]


@pytest.mark.parametrize("size", [2, 3])
def test_exact_mode_gives_one_process_bits(tiny_models, size):
    """tensor_parallel_exact: every output keeps its full sum, so TP=N is TP=1 to the bit (kernels on)."""
    options = {"model": str(tiny_models[size]), "num_kv_blocks": 64, "num_threads": 1}
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=3)
    whole = _generate(LLM(**options), PROMPTS, params)
    llm = LLM(tensor_parallel_size=size, tensor_parallel_exact=True, **options)
    split = _generate(llm, PROMPTS, params)
    llm.engine.close()
    for one, other in zip(whole, split, strict=True):
        assert (other.token_ids, other.logprobs, other.top_logprobs) == (one.token_ids, one.logprobs, one.top_logprobs)


def test_exact_mode_with_an_fp16_pool_gives_one_process_bits(tiny_models):
    """kv_cache_dtype reaches the workers: each rank's shard of the pool is fp16 too, so exact TP=2 gives the
    bits of one process with an fp16 pool (ranks on fp32 pools would round nothing, and differ)."""
    options = {"model": str(tiny_models[2]), "num_kv_blocks": 64, "num_threads": 1, "kv_cache_dtype": "float16"}
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=3)
    whole = _generate(LLM(**options), PROMPTS, params)
    llm = LLM(tensor_parallel_size=2, tensor_parallel_exact=True, **options)
    split = _generate(llm, PROMPTS, params)
    llm.engine.close()
    for one, other in zip(whole, split, strict=True):
        assert (other.token_ids, other.logprobs, other.top_logprobs) == (one.token_ids, one.logprobs, one.top_logprobs)
