"""Kernel measurements that hold whatever else the machine does: one taken while other processes
keep the CPUs busy is kept as provisional, said so at start, and taken again at the next start on
a quiet machine, which then chooses what a start on a quiet machine chooses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwire.weights import load, measure

from workers import WorkerProcess

pytestmark = pytest.mark.slow  # worker processes measuring their kernels

CLOSE = 1.1  # candidates within this factor of each other may be chosen either way


class Spinners:
    """A busy loop on every CPU of the machine, in processes of their own."""

    def __enter__(self):
        spin = "import time\nend = time.monotonic() + 300\nwhile time.monotonic() < end: pass"
        self.procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]
        time.sleep(0.3)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


def test_a_busy_machine_is_seen_as_busy():
    with Spinners():
        busy = load.now(0.5)
    assert busy.busy and busy.others > 0.5 and "under load" in busy.words()


def _kept(folder: Path) -> dict:
    """The kernel measurements a worker kept in `folder`, by key."""
    return json.loads((folder / "kernels.json").read_text())


def _start_lines(cache: Path, tmp: Path) -> list[str]:
    with WorkerProcess(tmp / "weights", env={"SHARDWIRE_CACHE": str(cache)}) as worker:
        deadline = time.monotonic() + 10
        while not any("kernel choices" in line for line in worker.log) and time.monotonic() < deadline:
            time.sleep(0.05)
    return [line.strip() for line in worker.log]


def _costs(entry: dict, x: str, y: str) -> tuple[float, float]:
    """Two formats' costs in one measurement: per request where both were timed on a prompt chunk
    too, else per row."""
    chunk = entry.get("prompt_seconds", {})
    if x in chunk and y in chunk:
        return tuple(measure.request_seconds(entry["seconds"][f], chunk[f]) for f in (x, y))
    return entry["seconds"][x], entry["seconds"][y]


def _apart(x: float, y: float) -> bool:
    return max(x, y) > CLOSE * min(x, y)


def _disagreements(a: dict, b: dict) -> list[str]:
    """Where two measurements of one kind chose differently while each found the two choices more
    than CLOSE apart: per stored type for a choice of format or product, per row count for the
    rows from which a chunk is dequantized into a GEMM. Where one of them found the two within
    CLOSE, either choice is right."""
    if "rows" in a:
        out = []
        for n, times in a["seconds"].items():
            x, y = ("gemm" if m["rows"] is not None and int(n) >= m["rows"] else "ggml" for m in (a, b))
            if x != y and all(_apart(m["seconds"][n][x], m["seconds"][n][y]) for m in (a, b)):
                out.append(f"{n} rows: {x} against {y}")
        return out
    out = []
    for stored in a.keys() & b.keys():
        x, y = a[stored]["fastest"], b[stored]["fastest"]
        if x != y and all(_apart(*_costs(e, x, y)) for e in (a[stored], b[stored])):
            out.append(f"{stored}: {x} against {y}")
    return out


def test_a_worker_started_under_load_then_quiet_chooses_what_a_quiet_start_chooses(tmp_path):
    loaded = tmp_path / "loaded"
    with Spinners():
        first = _start_lines(loaded, tmp_path)
    assert any("kernel choices" in line and "provisional" in line for line in first), first
    assert all(entry["provisional"] for entry in _kept(loaded).values())

    if load.now(1.0).busy:  # other work keeps the machine busy: the provisional choices stay
        again = _start_lines(loaded, tmp_path)
        assert any("kernel choices" in line and "provisional" in line for line in again), again
        pytest.skip("other work keeps this machine busy: a quiet measurement cannot be taken now")
    again = _start_lines(loaded, tmp_path)  # measured again, the machine quiet now
    assert any("kernel choices" in line and "quiet" in line for line in again), again
    remeasured = _kept(loaded)
    assert not any(entry["provisional"] for entry in remeasured.values())

    _start_lines(loaded, tmp_path)  # what was kept quiet stays kept
    assert _kept(loaded) == remeasured

    # --remeasure drops it: the start measures afresh on the quiet machine, as a first start would
    with WorkerProcess(tmp_path / "w", env={"SHARDWIRE_CACHE": str(loaded)}, extra=("--remeasure",)) as worker:
        pass
    assert any("kept kernel measurement(s) of this CPU dropped" in line for line in worker.log)
    reference = _kept(loaded)
    assert reference.keys() == remeasured.keys()
    for key in reference:
        assert reference[key]["when"] >= remeasured[key]["when"]
        differ = _disagreements(remeasured[key]["result"], reference[key]["result"])
        assert not differ, (key, differ, remeasured[key], reference[key])


def test_workers_started_at_once_measure_once_and_both_take_it(tmp_path):
    """The workers a machine starts together (the demo's two, a box's one per device) share the
    cache file: one measures while the other waits idle, so the measurement is not taken under the
    other's and is kept quiet, not provisional; the other takes it, and the next start measures
    nothing. (Timed under each other's measurement, each start measured again, for good.)"""
    import threading

    if load.now(1.0).busy:
        pytest.skip("other work keeps this machine busy: a quiet measurement cannot be taken now")
    cache = tmp_path / "cache"
    workers = [WorkerProcess(tmp_path / f"w{i}", env={"SHARDWIRE_CACHE": str(cache)}) for i in range(2)]
    starts = [threading.Thread(target=w.start) for w in workers]
    for t in starts:
        t.start()
    for t in starts:
        t.join()
    try:
        kept = _kept(cache)
        assert kept and not any(entry["provisional"] for entry in kept.values()), kept
        deadline = time.monotonic() + 10
        while not all(any("kernel choices" in line for line in w.log) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        lines = [[line for line in w.log if "kernel choices" in line] for w in workers]
        assert all(lines) and lines[0][0].split("kernel choices", 1)[1] == lines[1][0].split("kernel choices", 1)[1]
    finally:
        for w in workers:
            w.stop()
    again = _start_lines(cache, tmp_path)
    assert _kept(cache) == kept, again
