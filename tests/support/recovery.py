"""Three workers, a cluster and its engine, and the tokens an uninterrupted run gives: for the
recovery and fault tests."""

from __future__ import annotations

import threading
import time

import pytest

from shardwire.coordinator import Cluster
from shardwire.engine import Engine
from shardwire.formats import open_model
from shardwire.pipeline import LocalPipeline, PipelineError, StepResult
from shardwire.pipeline.plan import PlanDevice, make_plan
from shardwire.sampling import SamplingParams
from shardwire_kit.synthetic import SIX_BLOCKS, write_random_llama

from freezable_relay import FreezableRelay
from runs import single_process
from workers import WorkerProcess

PROMPT = [5, 17, 300, 42, 7, 100, 3, 99, 123, 456, 8, 250, 11, 19, 204, 77]


CHUNK = 16


GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return write_random_llama(tmp_path_factory.mktemp("recovery") / "six.gguf", **SIX_BLOCKS)


def budget_for_a_third(path) -> str:
    """A --mem that holds the largest stage of the model split in three, not of it split in two."""
    model = open_model(path)

    def largest(n: int) -> int:
        roomy = [PlanDevice(f"w{i}", "cpu", 1 << 40) for i in range(n)]
        return max(st.total_bytes for st in make_plan(model, roomy, n_slots=4, ctx=256, prefill_chunk=CHUNK).stages)

    return str((largest(3) + largest(2)) // 2)


class Setup:
    """Three workers (optionally behind relays), a coordinator cluster and its engine."""

    def __init__(self, tmp_path, path, *, mem=None, relay_index=None, recovery_timeout=20.0):
        self.tmp_path = tmp_path
        extra = ("--mem", mem) if mem else ()
        self.workers = [WorkerProcess(tmp_path / f"cache{i}", extra=extra).start() for i in range(3)]
        self.relay = FreezableRelay(self.workers[relay_index].port) if relay_index is not None else None
        addresses = [w.address for w in self.workers]
        if self.relay is not None:
            addresses[relay_index] = self.relay.address
        self.model = open_model(path)
        self.cluster = Cluster(addresses, cache_dir=tmp_path / "coord", show_progress=False)
        self.cluster.heartbeat.interval, self.cluster.heartbeat.dead_after = 0.25, 1.5
        self.cluster.heartbeat.stall_timeout, self.cluster.recovery_timeout = 3.0, recovery_timeout
        self.cluster.connect(self.model)
        self.pipeline = self.cluster.load(
            self.cluster.make_plan(ctx=256, n_slots=4, prefill_chunk=CHUNK, dtype="float32")
        )
        assert len(self.cluster.plan.stages) == 3
        self.engine = Engine(self.pipeline, prefill_chunk=CHUNK)

    def restart(self, i):
        self.workers[i] = self.workers[i].restarted()

    def close(self):
        self.engine.close()
        self.cluster.close()
        if self.relay is not None:
            self.relay.close()
        for w in self.workers:
            w.stop()


@pytest.fixture(scope="module")
def reference(model_file):
    path = model_file
    cache = {}

    def tokens(prompt=tuple(PROMPT), n=40, sampling=GREEDY):
        key = (tuple(prompt), n, sampling)
        if key not in cache:
            cache[key] = single_process(path, n=n, sampling=sampling, prompt=list(prompt))[0]
        return cache[key]

    return tokens


def wait_for_tokens(handle, n, timeout=30):
    deadline = time.monotonic() + timeout
    while len(handle.tokens) < n:
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.01)


def collect(handle):
    events = list(handle)
    assert handle.error is None, handle.error
    return handle.tokens, events


class BreakingPipeline(LocalPipeline):
    """Stages in this process whose step number `break_at` fails as a lost worker's would; recovery
    clears their caches. Steps wait for `go` once the first has come, so the test can queue its
    other requests first and the decode steps are grouped alike on every run."""

    def __init__(self, stages, break_at=0):
        super().__init__(stages, n_slots=3, ctx=256)
        self.broken, self.rebalance_due, self.break_at, self.n_steps = None, False, break_at, 0
        self.entered, self.go = threading.Event(), threading.Event()

    def submit(self, step):
        self.entered.set()
        self.go.wait()
        self.n_steps += 1
        if self.n_steps != self.break_at:
            return super().submit(step)
        self.broken = "a worker is gone"
        self.on_result(StepResult(step.id, error=PipelineError(self.broken)))
        self.on_wake()

    def recover(self):
        for stage in self.stages:
            stage.allocate_cache(self.n_slots, self.ctx)
        self.broken = None
        return {"reason": "a worker is gone"}
