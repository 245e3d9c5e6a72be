"""KV pages handed out by the coordinator and prefixes reused across requests: the page book on
its own, then real models in one process and over two workers, with the output compared to the
same requests without the cache."""

from __future__ import annotations

import threading

from shardwire.coordinator import Cluster
from shardwire.engine import Engine, Request
from shardwire.engine.pages import PagePool, prefix_hashes
from shardwire.enums import PAGE
from shardwire.formats import open_model
from shardwire.pipeline import LocalPipeline
from shardwire.pipeline.loading import load_stage
from shardwire.sampling import GREEDY

from models import PROMPT, model_path

LONG = (PROMPT * 8)[:40]  # two full pages and a part


def local(name="llama", n_slots=2, ctx=128, kv_pages=None):
    model = open_model(model_path(name, "F32"))
    return LocalPipeline([load_stage(model, 0, model.config.n_layers)], n_slots=n_slots, ctx=ctx, kv_pages=kv_pages)


def run(engine, *prompts, cache=True, max_tokens=8, together=False):
    """Each prompt's generated tokens and cached prompt tokens, one request after another (or all
    submitted at once)."""
    requests = [Request(list(p), GREEDY, max_tokens=max_tokens, ignore_eos=True, cache_prompt=cache) for p in prompts]
    if together:
        handles = [engine.submit(r) for r in requests]
        for h in handles:
            h.result()
    else:
        handles = []
        for r in requests:
            handles.append(engine.submit(r))
            handles[-1].result()
    assert all(h.finish_reason == "length" for h in handles), [h.error for h in handles]
    return [h.tokens for h in handles], [h.stats.cached_tokens for h in handles]


# -- the page book -------------------------------------------------------------------------------


def test_a_prefix_is_found_by_its_chained_hashes_and_its_pages_are_shared():
    pool = PagePool(8)
    tokens = list(range(50))
    hashes = prefix_hashes(tokens, 3)
    assert prefix_hashes(tokens, 3, hashes[:1]) == hashes
    assert prefix_hashes([99] + tokens[1:], 3)[1] != hashes[1]  # a page is known with all before it
    pages = pool.allocate(4)
    assert pages == [0, 1, 2, 3]
    pool.computing(hashes, pages[:3])
    assert pool.match(hashes) == ([], True)  # being computed: a request with this prefix waits
    pool.computed(hashes, ok=True)
    assert pool.match(hashes) == ([0, 1, 2], False)
    pool.take([0, 1])
    pool.release(pages)
    assert pool.available == 6 and pool.stats()["cached"] == 3  # 0 and 1 are still used; 2 idles cached
    pool.release([0, 1])
    assert pool.available == 8


def test_the_least_recently_used_cached_page_goes_first_and_a_failed_step_caches_nothing():
    pool = PagePool(3)
    a, b = prefix_hashes(list(range(16)), 1), prefix_hashes(list(range(1, 17)), 1)
    for hashes in (a, b):
        page = pool.allocate(1)
        pool.computing(hashes, page)
        pool.computed(hashes, ok=True)
        pool.release(page)
    pool.take(pool.match(a)[0])
    pool.release(pool.match(a)[0])  # a used again: b is now the oldest
    assert pool.allocate(2) is not None
    assert pool.match(a)[0] == [0] and pool.match(b)[0] == []
    assert pool.allocate(2) is None  # one page left, nothing taken
    c = prefix_hashes(list(range(2, 18)), 1)
    page = pool.allocate(1)
    pool.computing(c, page)
    pool.computed(c, ok=False)
    assert pool.match(c) == ([], False)


# -- one process ---------------------------------------------------------------------------------


def test_a_chat_turn_reuses_the_conversation_so_far_and_writes_the_same_tokens():
    pipeline = local()
    engine = Engine(pipeline, prefill_chunk=PAGE)
    try:
        (first,), _ = run(engine, LONG)
        turn = LONG + first + PROMPT[:9]  # the conversation so far, and something new
        (cold,), (cold_cached,) = run(engine, turn, cache=False)
        (warm,), (warm_cached,) = run(engine, turn)
        stats = engine.slots()["kv"]
    finally:
        engine.close()
    assert cold_cached == 0 and warm_cached == (len(LONG) + len(first) - 1) // PAGE * PAGE == 32
    assert warm == cold
    assert stats["hit_tokens"] == 32 and stats["in_use"] == 0 and stats["cached"] >= 3


def test_requests_sent_together_with_one_prompt_compute_it_once():
    pipeline = local()
    engine = Engine(pipeline, prefill_chunk=PAGE)
    try:
        outputs, cached = run(engine, LONG, LONG, together=True)
    finally:
        engine.close()
    assert outputs[0] == outputs[1] and sorted(cached) == [0, 32]


def test_a_full_pool_restarts_the_newest_sequence_and_every_output_stays_the_same():
    prompts = [PROMPT[:10], PROMPT[3:13]]
    alone = Engine(local(ctx=64))
    try:
        expected, _ = run(alone, *prompts, max_tokens=40)
    finally:
        alone.close()
    engine = Engine(local(ctx=64, kv_pages=4))  # one whole context: two sequences of 50 do not fit
    try:
        got, _ = run(engine, *prompts, max_tokens=40, together=True)
    finally:
        engine.close()
    assert got == expected


def test_a_model_with_recurrent_state_reuses_no_prefix():
    pipeline = local("qwen35")
    engine = Engine(pipeline, prefill_chunk=PAGE)
    try:
        outputs, cached = run(engine, LONG, LONG)
    finally:
        engine.close()
    assert cached == [0, 0] and outputs[0] == outputs[1]


# -- two workers ---------------------------------------------------------------------------------


def test_two_workers_share_pages_of_a_prefix_as_the_coordinator_hands_them_out(worker_pool, tmp_path):
    model = open_model(model_path("llama", "F32"))
    cluster = Cluster([w.address for w in worker_pool(2)], cache_dir=tmp_path, show_progress=False)
    try:
        cluster.connect(model)
        engine = Engine(cluster.load(cluster.make_plan(ctx=128, n_slots=2, dtype="float32")), prefill_chunk=PAGE)
        try:
            (first,), _ = run(engine, LONG)
            turn = LONG + first + PROMPT[:9]
            cold, _ = run(engine, turn, cache=False)
            warm, cached = run(engine, turn)
            both, both_cached = run(engine, turn + [7], turn + [8], together=True)
        finally:
            engine.close()
    finally:
        cluster.close()
    assert warm == cold and cached == [32]
    assert both_cached == [48, 48] and all(len(t) == 8 for t in both)
    assert threading.active_count() < 50


def test_a_kv_budget_bounds_the_workers_pools_and_a_full_pool_loses_no_token(worker_pool, tmp_path):
    model = open_model(model_path("llama", "F32"))
    cluster = Cluster([w.address for w in worker_pool(2)], cache_dir=tmp_path, show_progress=False)
    prompts = [PROMPT[:10], PROMPT[3:13]]
    try:
        cluster.connect(model)
        plan = cluster.make_plan(ctx=64, n_slots=2, dtype="float32", kv_tokens=64)
        assert plan.kv_pages == 4 and "KV pages for 64 positions" in plan.table()
        engine = Engine(cluster.load(plan))
        try:
            alone, _ = run(engine, *prompts, max_tokens=40)
            together, _ = run(engine, *prompts, max_tokens=40, together=True)  # 2 x 50 positions in 64
        finally:
            engine.close()
    finally:
        cluster.close()
    assert together == alone
