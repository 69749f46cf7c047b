"""The KV map's data (``LLM.kv_map``, the body of ``GET /kv.json``), its prefix tree and its PNG.

Scenario: three requests share a 3-block prefix and each has 2 blocks of its own plus a partial one (block
size 4, a tiny random Llama). The expected states, hit counts and tree follow from that construction, not
from the code under test; the PNG is read back from its pixels. A tiny Gemma 3 adds the sliding-window layers'
block group (``window_group``), checked against the KV manager's own tables after every step.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from pagedkv import LLM, SamplingParams
from pagedkv.kv.prefix_tree import build_prefix_tree
from pagedkv.kv.snapshot import CounterHistory
from pagedkv.kv_map import render_kv_map, save_kv_map
from tests.kv_map_pixels import states_in
from tests.model.test_gemma3 import WINDOW, checkpoint, pair  # noqa: F401 - fixtures
from tests.tiny_model import save_tiny_llama

BS, NUM_BLOCKS = 4, 40
SHARED = list(range(10, 10 + 3 * BS))
PROMPTS = [SHARED + list(range(start, start + 2 * BS + 1)) for start in (100, 200, 300)]  # 5 full blocks + 1
PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    tiny = str(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))
    return LLM(model=tiny, num_kv_blocks=NUM_BLOCKS, block_size=BS, max_model_len=64)


@pytest.fixture(scope="module")
def snapshots(llm: LLM) -> dict:
    """The map after the step where all three requests run, and after they all finished."""
    engine = llm.engine
    ids = [engine.add_request(prompt_token_ids=p, params=PARAMS) for p in PROMPTS]
    engine.step()  # the first request computes the shared prefix; the others wait for it
    engine.step()  # they hit it; the first decodes
    running = llm.kv_map()
    while engine.has_unfinished_requests():
        engine.step()
    return {"running": running, "finished": llm.kv_map(), "ids": ids}


def test_every_block_is_listed_with_its_state(snapshots):
    data = snapshots["running"]
    assert data["num_blocks"] == len(data["blocks"]) == NUM_BLOCKS
    assert [b["id"] for b in data["blocks"]] == list(range(NUM_BLOCKS))
    shared = [b for b in data["blocks"] if b["state"] == "shared"]
    held = [b for b in data["blocks"] if b["state"] == "held"]
    assert len(shared) == 3 and all(b["ref_count"] == 3 for b in shared), "the common prefix, held by all three"
    assert all(sorted(b["requests"]) == sorted(snapshots["ids"]) for b in shared)
    assert len(held) == 3 * 3 and all(b["ref_count"] == 1 and len(b["requests"]) == 1 for b in held)
    assert data["counts"] == {"held": 9, "shared": 3, "cached": 0, "empty": NUM_BLOCKS - 12}
    assert data["counters"]["kv_blocks_used"] == 12
    chain = sorted(shared, key=lambda b: b["parent"] is not None)
    assert chain[0]["parent"] is None, "the prompt's first block has no parent"
    keys = {b["key"] for b in shared}
    assert all(b["parent"] in keys for b in chain[1:]), "the prefix's blocks chain to each other"


def test_finished_blocks_stay_cached_in_eviction_order(snapshots):
    data = snapshots["finished"]
    cached = [b for b in data["blocks"] if b["state"] == "cached"]
    assert data["counts"]["held"] == data["counts"]["shared"] == 0
    # 21 prompt + 3 output tokens, of which 23 computed (the last sampled token never is): 5 full blocks
    # each, the shared 3 and 2 of its own
    assert len(cached) == data["num_cached_free"] == 3 + 3 * 2
    assert sorted(b["eviction_rank"] for b in cached) == list(range(len(cached)))
    assert all(b["eviction_rank"] is None for b in data["blocks"] if b["state"] != "cached")
    by_rank = sorted(cached, key=lambda b: b["eviction_rank"])
    last_three = by_rank[-3:]
    assert all(b["hits"] == 2 for b in last_three), "the shared prefix is evicted last"
    assert last_three[-1]["parent"] is None, "its first block last of all: freed tail first"


def test_the_prefix_tree_shows_the_shared_prefix_and_its_branches(snapshots):
    tree = snapshots["finished"]["prefix_tree"]
    assert tree["more_roots"] == 0 and len(tree["roots"]) == 1
    root = tree["roots"][0]
    assert (root["blocks"], root["hits"], root["subtree_blocks"], root["num_requests"]) == (3, 2, 9, 0)
    assert [(c["blocks"], c["hits"], c["subtree_blocks"]) for c in root["children"]] == [(2, 0, 2)] * 3
    running_root = snapshots["running"]["prefix_tree"]["roots"][0]
    assert sorted(running_root["requests"]) == sorted(snapshots["ids"])


def test_the_tree_is_cut_to_the_hottest_and_survives_long_chains():
    blocks = [
        {"id": i, "key": f"k{i}", "parent": f"k{i - 1}" if i else None, "hits": 0, "ref_count": 0, "requests": []}
        for i in range(5000)
    ]  # one prompt of 5,000 blocks: one segment, no recursion
    tree = build_prefix_tree(blocks)
    assert tree["roots"][0]["blocks"] == 5000 and tree["roots"][0]["children"] == []
    roots = [{"id": i, "key": f"r{i}", "parent": None, "hits": i, "ref_count": 0, "requests": []} for i in range(20)]
    tree = build_prefix_tree(roots, max_roots=8)
    assert [r["hits"] for r in tree["roots"]] == list(range(19, 11, -1)) and tree["more_roots"] == 12
    fan = [{"id": 0, "key": "root", "parent": None, "hits": 9, "ref_count": 0, "requests": []}] + [
        {"id": i, "key": f"c{i}", "parent": "root", "hits": i, "ref_count": 0, "requests": []} for i in range(1, 11)
    ]
    root = build_prefix_tree(fan, max_children=4)["roots"][0]
    assert [c["hits"] for c in root["children"]] == [10, 9, 8, 7] and root["more_children"] == 6
    crowded = [{"id": 0, "key": "k", "parent": None, "hits": 0, "ref_count": 40, "requests": ["r"] * 16}]
    node = build_prefix_tree(crowded)["roots"][0]
    assert node["num_requests"] == 40 and len(node["requests"]) == 8, "the count is every holder, the list is cut"


def png_states(data: dict) -> tuple[list, tuple[int, int]]:
    fig = render_kv_map(data)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=fig.dpi, facecolor="white")
    image = np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"))
    left, top, width, height = fig.kv_grid_box
    return states_in(image[top : top + height, left : left + width], data["palette"]), image.shape[:2]


@pytest.mark.parametrize("moment", ["running", "finished"])
def test_the_png_draws_one_square_per_block_in_its_state(snapshots, moment):
    data = snapshots[moment]
    states, _ = png_states(data)
    assert states == [b["state"] for b in data["blocks"]]


def test_a_big_pool_still_draws_every_block(snapshots):
    data = dict(snapshots["finished"])
    extra = [{**data["blocks"][-1], "id": i} for i in range(NUM_BLOCKS, 3000)]  # empty blocks
    data["blocks"] = data["blocks"] + extra
    data["num_blocks"] = len(data["blocks"])
    states, (height, width) = png_states(data)
    assert len(states) == 3000 and states[-1] == "empty" and width == 1200


def test_save_kv_map_writes_a_png(llm, tmp_path):
    path = llm.save_kv_map(tmp_path / "kv.png")
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width == 1200 and image.height > 400
    assert save_kv_map(llm.kv_map(), tmp_path / "again.png").stat().st_size > 10_000


def test_the_counter_history_keeps_one_sample_per_interval_in_a_bounded_ring():
    now = [100.0]
    calls = []

    def stats():
        calls.append(now[0])
        return {"prefix_cache_queries": now[0], "evictions": 1}

    history = CounterHistory(interval_s=0.5, capacity=3, clock=lambda: now[0])
    for _ in range(10):  # 10 steps, 0.2 s apart: a sample at 100.0, 100.6, 101.2, 101.8
        history.offer(stats)
        now[0] = round(now[0] + 0.2, 1)
    assert calls == [100.0, 100.6, 101.2, 101.8], "stats() is only built when a sample is kept"
    samples = history.samples()
    assert [s["t"] for s in samples] == [100.6, 101.2, 101.8] and samples[-1]["queries"] == 101.8
    assert samples[0]["evictions"] == 1 and samples[0]["preemptions"] == 0
    assert history.samples(current={"prefix_cache_queries": 7})[-1] == {
        **samples[0],
        "t": 102.0,
        "queries": 7,
        "evictions": 0,
    }
    assert len(history.samples()) == 3, "the present is appended, not kept"


# -- a model with sliding-window layers: their own block group, drawn under the main grid ----------------------


@pytest.fixture(scope="module")
def window_maps(checkpoint) -> dict:  # noqa: F811
    """A tiny Gemma 3 (window 8 tokens, blocks of 4): one 40-token prompt, 3 new tokens, 16 tokens a step; the
    map and the manager's windowed tables after every step, and the map once it finished."""
    llm = LLM(model=checkpoint, block_size=BS, num_kv_blocks=NUM_BLOCKS, max_num_batched_tokens=16)
    engine, kv = llm.engine, llm.engine.kv
    rid = engine.add_request(prompt_token_ids=list(range(20, 60)), params=PARAMS)
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        if engine.has_unfinished_requests():
            steps.append((llm.kv_map(), [b for b in kv.window_block_table(rid) if b != kv.windowed.null_block]))
    return {"steps": steps, "finished": llm.kv_map(), "rid": rid, "window_pool_blocks": kv.windowed.pool.num_blocks}


def test_the_window_group_lists_what_each_request_holds_there(window_maps):
    rid, bound = window_maps["rid"], -(-WINDOW // BS) + 1
    assert len(window_maps["steps"]) >= 3  # prefill chunks, then decodes
    for data, held in window_maps["steps"]:
        group = data["window_group"]
        assert group["window"] == WINDOW and group["num_blocks"] == window_maps["window_pool_blocks"] == NUM_BLOCKS
        assert [b["id"] for b in group["blocks"] if b["state"] == "held"] == sorted(held)
        assert all(b["requests"] == [rid] for b in group["blocks"] if b["state"] == "held")
        assert 1 <= len(held) <= bound  # the window only, while the full group holds the whole context
    assert window_maps["steps"][-1][0]["counts"]["held"] == 11  # 42 computed tokens: 11 blocks in the full group


def test_finished_window_blocks_stay_cached_under_their_keys(window_maps):
    """42 tokens computed: 10 full blocks keyed in both groups before release; the partial 11th goes keyless."""
    data = window_maps["finished"]
    group = data["window_group"]
    assert group["counts"] == {"held": 0, "shared": 0, "cached": 10, "empty": NUM_BLOCKS - 10}
    keys = {b["key"] for b in group["blocks"] if b["state"] == "cached"}
    assert keys == {b["key"] for b in data["blocks"] if b["state"] == "cached"}  # the same block keys


def test_a_model_without_windows_has_no_window_group(snapshots):
    assert snapshots["finished"]["window_group"] is None


def test_the_png_draws_the_window_group_under_the_main_grid(window_maps):
    data, _ = window_maps["steps"][1]
    fig = render_kv_map(data)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=fig.dpi, facecolor="white")
    image = np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"))
    for box, blocks in ((fig.kv_grid_box, data["blocks"]), (fig.kv_window_grid_box, data["window_group"]["blocks"])):
        left, top, width, height = box
        states = states_in(image[top : top + height, left : left + width], data["palette"])
        assert states == [b["state"] for b in blocks]
    assert fig.kv_window_grid_box[1] > fig.kv_grid_box[1] + fig.kv_grid_box[3]
