"""Faults beyond a killed process: a worker frozen and resumed, a link that drops every packet for
a while, a full disk under a worker's weight cache, a coordinator restarted over running
workers, and wall clocks that jump. Each ends with the stream going on (with the tokens of an
uninterrupted run) or a clear error, nothing corrupted in a cache, and no process or slot left
behind."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

from shardwire.coordinator import Cluster
from shardwire.engine import Engine, Request
from shardwire.formats import open_model
from shardwire.pipeline import PipelineError
from shardwire.sampling import SamplingParams

from freezable_relay import FreezableRelay
from models import model_path
from paths import SUPPORT
from recovery import budget_for_a_third
from small_disk import SmallDisk
from workers import WorkerProcess

pytestmark = pytest.mark.slow  # worker processes

PROMPT = [5, 17, 300, 42, 7, 100, 3, 99, 123, 456, 8, 250, 11, 19, 204, 77]
CHUNK = 16
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=7)
QUICK = {"interval": 0.25, "dead_after": 1.5, "stall_timeout": 3.0}  # faults found in seconds
PATIENT = {"interval": 0.25, "dead_after": 4.0, "stall_timeout": 8.0}  # a short fault goes unnoticed
WALLCLOCK = SUPPORT / "wallclock"


class Setup:
    """Three workers (one optionally behind a relay), a coordinator cluster and its engine."""

    def __init__(self, tmp_path, path, timeouts, *, mem=None, relay_index=None, recovery_timeout=20.0, env=None):
        extra = ("--mem", mem) if mem else ()
        self.workers = [WorkerProcess(tmp_path / f"cache{i}", extra=extra, env=env) for i in range(3)]
        self.relay = self.cluster = self.engine = None
        try:
            for w in self.workers:
                w.start()
            self.relay = FreezableRelay(self.workers[relay_index].port) if relay_index is not None else None
            addresses = [w.address for w in self.workers]
            if self.relay is not None:
                addresses[relay_index] = self.relay.address
            self.cluster = Cluster(addresses, cache_dir=tmp_path / "coord", show_progress=False)
            beat = self.cluster.heartbeat
            beat.interval, beat.dead_after, beat.stall_timeout = (
                timeouts["interval"],
                timeouts["dead_after"],
                timeouts["stall_timeout"],
            )
            self.cluster.recovery_timeout = recovery_timeout
            self.cluster.connect(open_model(path))
            pipeline = self.cluster.load(
                self.cluster.make_plan(ctx=256, n_slots=4, prefill_chunk=CHUNK, dtype="float32")
            )
            assert len(self.cluster.plan.stages) == 3
            self.engine = Engine(pipeline, prefill_chunk=CHUNK)
        except BaseException:
            self.close()
            raise

    def signal(self, i: int, sig: int) -> None:
        os.kill(self.workers[i].proc.pid, sig)

    def stages(self) -> int:
        return len(self.cluster.plan.stages)

    def wait_for_stages(self, n: int, timeout: float = 30.0) -> None:
        """Stages move onto a worker that answers again between steps: keep the engine stepping."""
        deadline = time.monotonic() + timeout
        while self.stages() != n:
            assert time.monotonic() < deadline, f"still {self.stages()} stages: {self.cluster.events}"
            self.engine.submit(Request(PROMPT, GREEDY, max_tokens=2)).result()
            time.sleep(0.3)

    def assert_idle(self) -> None:
        """Every slot and KV page back and nothing waiting."""
        deadline = time.monotonic() + 5
        while (slots := self.engine.slots())["busy"] or slots["waiting"] or slots["kv"]["in_use"]:
            assert time.monotonic() < deadline, self.engine.slots()
            time.sleep(0.05)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.cluster is not None:
            self.cluster.close()
        if self.relay is not None:
            self.relay.close()
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.send_signal(signal.SIGCONT)  # a frozen process cannot act on SIGTERM
            w.stop()


@pytest.fixture
def setup(tmp_path, model_file):
    made = []

    def make(timeouts, **kw):
        made.append(Setup(tmp_path, model_file, timeouts, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()
        assert all(w.proc is None or w.proc.poll() is not None for w in s.workers), "a worker process is left"


def wait_for_tokens(handle, n, timeout=30):
    deadline = time.monotonic() + timeout
    while len(handle.tokens) < n:
        assert time.monotonic() < deadline, "no progress"
        assert handle.finish_reason is None, handle.error
        time.sleep(0.01)


def wait_until(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def collect(handle):
    list(handle)
    assert handle.error is None, handle.error
    return handle.tokens


# -- a worker frozen (SIGSTOP) and resumed (SIGCONT) -----------------------------------------------


def test_a_short_freeze_is_only_a_pause(setup, reference):
    s = setup(PATIENT)
    greedy = s.engine.submit(Request(PROMPT, GREEDY, max_tokens=40))
    seeded = s.engine.submit(Request(PROMPT[:9], SEEDED, max_tokens=40))
    wait_for_tokens(greedy, 8)
    s.signal(1, signal.SIGSTOP)
    time.sleep(1.5)  # well under dead_after and stall_timeout
    paused_at = len(greedy.tokens)
    s.signal(1, signal.SIGCONT)
    assert paused_at < 40 and greedy.finish_reason is None
    assert collect(greedy) == reference()
    assert collect(seeded) == reference(PROMPT[:9], 40, SEEDED)
    assert s.cluster.events == [] and s.stages() == 3
    s.assert_idle()


def test_a_long_freeze_is_recovered_and_the_worker_rejoins_when_it_resumes(setup, reference):
    s = setup(QUICK)
    handle = s.engine.submit(Request(PROMPT, GREEDY, max_tokens=40))
    wait_for_tokens(handle, 8)
    s.signal(1, signal.SIGSTOP)
    try:
        assert collect(handle) == reference()
        event = s.cluster.events[-1]
        assert event["recovered"] and event["replayed_tokens"] > 0
        assert event["lost"] == [s.workers[1].address] and s.stages() == 2
    finally:
        s.signal(1, signal.SIGCONT)
    s.wait_for_stages(3)
    assert collect(s.engine.submit(Request(PROMPT, GREEDY, max_tokens=40))) == reference()
    s.assert_idle()


def test_a_freeze_longer_than_the_recovery_timeout_fails_clearly_and_then_serves(setup, reference, model_file):
    """The other workers cannot hold the model: the request ends with an error naming the frozen
    worker within recovery_timeout (the HTTP API answers it with 503); once it resumes, new
    requests are served."""
    s = setup(QUICK, mem=budget_for_a_third(model_file), recovery_timeout=4.0)
    handle = s.engine.submit(Request(PROMPT, GREEDY, max_tokens=200, ignore_eos=True))
    wait_for_tokens(handle, 5)
    frozen = s.workers[2]
    s.signal(2, signal.SIGSTOP)
    started = time.monotonic()
    try:
        events = list(handle)
        assert time.monotonic() - started < QUICK["dead_after"] + 4.0 + 8.0
        assert events[-1].finish_reason == "error"
        assert frozen.address in events[-1].error and "does not fit" in events[-1].error
        s.assert_idle()
    finally:
        s.signal(2, signal.SIGCONT)
    assert collect(s.engine.submit(Request(PROMPT, GREEDY, max_tokens=40))) == reference()
    assert s.stages() == 3
    s.assert_idle()


# -- a link that drops every packet for a while -----------------------------------------------------

# SHARDWIRE_DROP_SECONDS=20 runs the long drop for 20 s under the default timeouts (slow).
DROP_SECONDS = float(os.environ.get("SHARDWIRE_DROP_SECONDS", "6"))
DEFAULTS = {"interval": 1.0, "dead_after": 5.0, "stall_timeout": 30.0}


def test_a_brief_packet_drop_only_delays_the_stream(setup, reference):
    s = setup(PATIENT, relay_index=1)
    handle = s.engine.submit(Request(PROMPT, GREEDY, max_tokens=40))
    wait_for_tokens(handle, 8)
    s.relay.drop(True)
    time.sleep(1.5)
    dropped_at = len(handle.tokens)
    s.relay.drop(False)
    assert dropped_at < 40 and handle.finish_reason is None
    assert collect(handle) == reference()
    assert s.cluster.events == [] and s.stages() == 3
    s.assert_idle()


def test_a_long_packet_drop_is_recovered_and_the_worker_rejoins_after_it(setup, reference):
    """Both directions stop at once, coordinator to worker and worker to worker, and nothing is
    closed; when the route comes back the held bytes arrive late."""
    s = setup(DEFAULTS if DROP_SECONDS >= 20 else QUICK, relay_index=1)
    handles = [
        s.engine.submit(Request(PROMPT, GREEDY, max_tokens=40)),
        s.engine.submit(Request(PROMPT[:9], SEEDED, max_tokens=40)),
    ]
    wait_for_tokens(handles[0], 8)
    s.relay.drop(True)
    dropped = time.monotonic()
    try:
        assert collect(handles[0]) == reference()
        assert collect(handles[1]) == reference(PROMPT[:9], 40, SEEDED)
        event = s.cluster.events[-1]
        assert event["recovered"] and event["replayed_tokens"] > 0
        assert event["lost"] == [s.relay.address] and s.stages() == 2
        assert time.monotonic() - dropped < DROP_SECONDS, "the drop lasted less than the recovery"
        # requests go on being served on what is left while the route is still dead
        assert collect(s.engine.submit(Request(PROMPT, GREEDY, max_tokens=20))) == reference(n=20)
        time.sleep(max(0.0, DROP_SECONDS - (time.monotonic() - dropped)))
    finally:
        s.relay.drop(False)
    s.wait_for_stages(3, timeout=30 + DROP_SECONDS)
    assert collect(s.engine.submit(Request(PROMPT, GREEDY, max_tokens=40))) == reference()
    s.assert_idle()


# -- a full disk under the weight cache ---------------------------------------------------------------


def cache_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def assert_cache_sound(root: Path) -> None:
    """Every weight file holds the bytes its name hashes to; no partial file, no broken index."""
    for p in cache_files(root):
        assert ".part" not in p.name and ".tmp" not in p.name, f"left behind: {p}"
        if p.parent.parent.name == "weights":
            assert hashlib.sha256(p.read_bytes()).hexdigest() == p.name, f"corrupted: {p}"
        elif p.suffix == ".json":
            json.loads(p.read_text())


def test_a_full_disk_while_caching_weights_is_reported_and_corrupts_nothing(tmp_path, model_file, reference):
    model = open_model(model_file)
    total = sum(t.nbytes for t in model.tensors.values())
    with SmallDisk(tmp_path / "disk", f"{total // 3 // 1024}k") as disk:
        cache = disk.mountpoint / "cache"
        worker = WorkerProcess(cache, launcher=disk.launcher).start()
        try:
            cluster = Cluster([worker.address], cache_dir=tmp_path / "coord", show_progress=False)
            try:
                cluster.connect(model)
                with pytest.raises(PipelineError, match="No space left on device") as failed:
                    cluster.load(cluster.make_plan(ctx=256, n_slots=2, prefill_chunk=CHUNK, dtype="float32"))
                assert failed.value.worker == worker.address and "cache" in str(failed.value)
            finally:
                cluster.close()
            seen = disk.outside(cache)
            assert cache_files(seen / "weights"), "nothing was cached before the disk filled"
            assert_cache_sound(seen)
            assert worker.proc.poll() is None, "the worker went down with the disk"
        finally:
            worker.stop()

        disk.resize("64m")  # room again: the next start uses what was cached and fetches the rest
        kept = sum(p.stat().st_size for p in cache_files(disk.outside(cache) / "weights"))
        worker = WorkerProcess(cache, launcher=disk.launcher).start()
        try:
            cluster = Cluster([worker.address], cache_dir=tmp_path / "coord", show_progress=False)
            try:
                cluster.connect(model)
                pipeline = cluster.load(cluster.make_plan(ctx=256, n_slots=2, prefill_chunk=CHUNK, dtype="float32"))
                assert cluster.load_stats == {"file": 0, "cache": kept, "streamed": total - kept}
                engine = Engine(pipeline, prefill_chunk=CHUNK)
                try:
                    assert collect(engine.submit(Request(PROMPT, GREEDY, max_tokens=40))) == reference()
                finally:
                    engine.close()
            finally:
                cluster.close()
            assert_cache_sound(disk.outside(cache))
        finally:
            worker.stop()
        assert worker.proc.poll() is not None


# -- a coordinator restarted over the same running workers ------------------------------------------


@pytest.mark.parametrize("end", ["killed", "frozen"])
def test_a_restarted_coordinator_ships_no_weights_to_the_workers_that_kept_running(tmp_path, end):
    """`shardwire serve` killed outright (its connections close), or frozen (they stay open and
    silent, as when its machine dies), and started again against the same worker processes:
    they kept their caches, so the second start sends zero weight bytes and answers alike."""
    from shardwire.worker.server import COORDINATOR_SILENT

    from serve_process import ServeProcess, call

    path = model_path("qwen2", "F32")
    workers = [WorkerProcess(tmp_path / f"cache{i}").start() for i in range(2)]
    body = {"model": path.name, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    try:
        first = ServeProcess(path, workers, tmp_path / "coord")
        try:
            shipped = call(first.url, "/v1/cluster")[1]["cluster"]["load"]
            assert shipped["streamed"] > 0 and shipped["cache"] == 0
            code, answer = call(first.url, "/v1/completions", body)
            assert code == 200, answer
        finally:
            if end == "frozen":
                first.proc.send_signal(signal.SIGSTOP)
            else:
                first.proc.kill()
                first.proc.wait(10)
        if end == "frozen":
            time.sleep(COORDINATOR_SILENT + 1)  # the workers count a coordinator silent this long as gone

        second = ServeProcess(path, workers, tmp_path / "coord")
        try:
            status = call(second.url, "/v1/cluster")[1]
            assert status["cluster"]["load"] == {"file": 0, "cache": shipped["streamed"], "streamed": 0}
            code, again = call(second.url, "/v1/completions", body)
            assert code == 200 and again["choices"][0]["text"] == answer["choices"][0]["text"]
            # the slot comes back once the steps still in flight for it return
            wait_until(lambda: call(second.url, "/v1/cluster")[1]["slots"]["busy"] == 0, 10, "the slot given back")
        finally:
            rc = second.stop()
            assert rc == 0, "".join(second.log[-40:])
        assert all(w.proc.poll() is None for w in workers), "a worker went down with its coordinator"
    finally:
        first.proc.kill()
        first.proc.wait(10)
        for w in workers:
            w.stop()
    assert all(w.proc.poll() is not None for w in workers)


# -- wall clocks that jump ------------------------------------------------------------------------------


def test_wall_clocks_jumping_mid_generation_misfire_nothing(setup, reference, monkeypatch):
    """Each worker's wall clock jumps an hour ahead, then two hours back (SIGUSR1 through
    tests/support/wallclock/sitecustomize.py), and the coordinator's with them: no heartbeat, stall or
    idle deadline fires."""
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(WALLCLOCK), os.environ.get("PYTHONPATH")])),
        "SHARDWIRE_TEST_CLOCK_JUMPS": "3600,-7200",
    }
    s = setup(QUICK, env=env)
    greedy = s.engine.submit(Request(PROMPT, GREEDY, max_tokens=40))
    seeded = s.engine.submit(Request(PROMPT[:9], SEEDED, max_tokens=40))
    real_time = time.time
    for at, jump in ((8, 3600), (20, -3600)):
        wait_for_tokens(greedy, at)
        assert greedy.finish_reason is None
        for i in range(3):
            s.signal(i, signal.SIGUSR1)
        monkeypatch.setattr(time, "time", lambda jump=jump: real_time() + jump)
    assert collect(greedy) == reference()
    assert collect(seeded) == reference(PROMPT[:9], 40, SEEDED)
    time.sleep(QUICK["dead_after"] * 2)  # heartbeats after the jumps
    assert collect(s.engine.submit(Request(PROMPT, GREEDY, max_tokens=40))) == reference()
    assert s.cluster.events == [] and s.stages() == 3
    for w in s.workers:
        wait_until(lambda w=w: sum("wall clock jumped" in line for line in w.log) == 2, 5, "no jump seen")
    s.assert_idle()
