"""Runs of one model in one process and across worker processes on loopback, to compare token for token."""

from __future__ import annotations

import pytest

from shardwire.coordinator import Cluster
from shardwire.engine import Engine, Request
from shardwire.formats import open_model
from shardwire.pipeline import LocalPipeline
from shardwire.pipeline.loading import load_stage
from shardwire.sampling import SamplingParams
from shardwire.wire.tls import TRUST_ON_FIRST_USE

from models import PROMPT
from workers import WorkerProcess

GREEDY_LOGPROBS = SamplingParams(temperature=0.0, logprobs=10)


def generate(pipeline, n=24, sampling=GREEDY_LOGPROBS, prompt=PROMPT, prefill_chunk=7, steps=None):
    """The tokens and top logprobs of a request; `steps`: a list to add the engine's prefill
    steps' count to."""
    engine = Engine(pipeline, prefill_chunk=prefill_chunk)
    try:
        handle = engine.submit(Request(prompt, sampling, max_tokens=n))
        events = [e for e in handle if e.token is not None]
        assert handle.error is None, handle.error
        if steps is not None:
            steps.append(engine.counters.steps - engine.counters.decode_steps)
        return [e.token for e in events], [e.top_logprobs for e in events]
    finally:
        engine.close()


def single_process(path, **kw):
    model = open_model(path)
    return generate(LocalPipeline([load_stage(model, 0, model.config.n_layers)], n_slots=1, ctx=256), **kw)


def distributed(
    path,
    addresses,
    cache_dir,
    *,
    tensor_split=None,
    n_gpu_layers=None,
    local_devices=(),
    token=None,
    tls=TRUST_ON_FIRST_USE,
    plan_options=None,
    loaded=None,
    **kw,
):
    """generate() on a cluster of the workers at `addresses`; `plan_options`: make_plan's, beside these;
    `loaded`: called with the cluster once its workers are ready."""
    model = open_model(path)
    cluster = Cluster(
        addresses,
        local_devices=local_devices,
        cache_dir=cache_dir,
        show_progress=False,
        local_cpu=n_gpu_layers is not None and n_gpu_layers < model.config.n_layers,
        token=token,
        tls=tls,
    )
    try:
        cluster.connect(model)
        plan = cluster.make_plan(
            tensor_split=tensor_split, n_gpu_layers=n_gpu_layers, ctx=256, dtype="float32", **(plan_options or {})
        )
        pipeline = cluster.load(plan)
        if loaded is not None:
            loaded(cluster)
        return generate(pipeline, **kw), plan, cluster.load_stats
    finally:
        cluster.close()


def assert_same(reference, got):
    tokens, logprobs = got
    assert tokens == reference[0]
    for ours, theirs in zip(logprobs, reference[1]):
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        assert max(abs(a - b) for (_, a), (_, b) in zip(ours, theirs)) <= 1e-5


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """Two workers for a module's tests; one a test replaced (killed, then restarted()) in the list
    is stopped with the other."""
    started = [WorkerProcess(tmp_path_factory.mktemp("worker")).start() for _ in range(2)]
    yield started
    for w in started:
        w.stop()


@pytest.fixture
def worker_pool(tmp_path):
    started = []

    def start(count, **kw):
        for i in range(count):
            started.append(WorkerProcess(tmp_path / f"cache{len(started)}", **kw).start())
        return started[-count:]

    yield start
    for w in started:
        w.stop()
