"""Strangers holding hundreds of unfinished connections to a worker cannot keep its coordinator
out: a coordinator with the token connects, loads and generates within 2x its usual time, and the
worker's memory and threads stay bounded."""

import subprocess
import sys
import time
from contextlib import contextmanager

import psutil
import pytest

from models import model_path
from paths import SUPPORT
from runs import distributed
from workers import WorkerProcess

pytestmark = pytest.mark.slow

TOKEN = "correct horse battery staple"
FLOOD = SUPPORT / "flood.py"


def first_token_seconds(worker, tmp_path) -> float:
    """A coordinator's whole start: connect, plan, load (from the worker's cache), one token."""
    start = time.monotonic()
    tokens, _ = distributed(model_path("llama", "Q8_0"), [worker.address], tmp_path / "coord", token=TOKEN, n=1)[0]
    assert len(tokens) == 1
    return time.monotonic() - start


@contextmanager
def flooding(worker, n: int, mode: str):
    flood = subprocess.Popen(
        [sys.executable, str(FLOOD), "127.0.0.1", str(worker.port), str(n), mode, "120"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert flood.stdout.readline().strip() == "flooding"
        time.sleep(2.0)  # at full strength: every unfinished-handshake slot its address may hold is taken
        yield
        assert flood.poll() is None, "the flood stopped early"
    finally:
        flood.kill()
        flood.wait()


@pytest.mark.parametrize("n, mode", [(300, "silent"), (300, "slow"), (3000, "silent")])
def test_a_flood_of_unfinished_handshakes_does_not_lock_the_coordinator_out(tmp_path, n, mode):
    worker = WorkerProcess(tmp_path / "cache", token=TOKEN).start()
    try:
        first_token_seconds(worker, tmp_path)  # ships the weights to the worker's cache
        process = psutil.Process(worker.proc.pid)
        usual, flooded, grown, threads = [], [], [], []
        for _ in range(3):  # side by side, so both feel the same background load
            usual.append(first_token_seconds(worker, tmp_path))
            rss_before = process.memory_info().rss
            with flooding(worker, n, mode):
                grown.append(process.memory_info().rss - rss_before)
                threads.append(process.num_threads())
                flooded.append(first_token_seconds(worker, tmp_path))
    finally:
        worker.stop()
    print(f"{n} {mode}: first token {min(flooded):.2f} s flooded, {min(usual):.2f} s usual; threads {max(threads)}")
    assert min(flooded) < 2 * min(usual)
    assert max(threads) < 64 + 40  # the unfinished-handshake budget, plus the worker's own
    assert max(grown) < 16 << 20
