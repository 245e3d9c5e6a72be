"""Does a generation that lost a worker give exactly the tokens it would have without the loss?

Three worker processes on loopback serve a model: by default six random llama blocks whose
output rows come in near-identical pairs, so that every greedy step is a near-tie float32
rounding decides (any other arithmetic in the replay shows in the text within a few tokens).
One uninterrupted run gives the reference. Then, on a fresh cluster each time, the same request
runs and one worker is killed with SIGKILL after a number of tokens that changes from run to run
(and so does the worker); the two left take its blocks, the request is replayed and finishes.
Prints how many runs gave exactly the reference tokens.

    python -m benchmarks.recovery_exact [--runs 20] [--tokens 200] [--model FILE.gguf]
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from shardwire.coordinator import Cluster
from shardwire.engine import Engine, Request
from shardwire.formats import open_model
from shardwire.sampling import SamplingParams
from shardwire_kit.synthetic import SIX_BLOCKS, write_random_llama
from tests.support.workers import WorkerProcess

PROMPT = [5, 17, 300, 42, 7, 100, 3, 99, 123, 456, 8, 250, 11, 19, 204, 77]
CHUNK = 16


@dataclass
class Run:
    tokens: list[int]
    error: str | None
    killed_after: int | None = None  # tokens
    resumed: float | None = None  # seconds from the kill to the next token
    recovery: dict | None = None  # the cluster's event


class Stamped(queue.Queue):
    """A handle's events, with the time each token came (put() runs on the engine thread)."""

    def __init__(self, signal_at: int | None):
        super().__init__()
        self.stamps: list[float] = []
        self.signal_at, self.reached = signal_at, threading.Event()

    def put(self, event, *args, **kw) -> None:
        if event.token is not None:
            self.stamps.append(time.monotonic())
            if len(self.stamps) == self.signal_at:
                self.reached.set()
        super().put(event, *args, **kw)


def generate(path: Path, tmp: Path, tokens: int, kill_after: int | None = None, victim: int = 0) -> Run:
    """One greedy request on a fresh 3-worker cluster; worker `victim` killed with SIGKILL once
    `kill_after` tokens have come."""
    workers = [WorkerProcess(tmp / f"w{i}").start() for i in range(3)]
    cluster = Cluster([w.address for w in workers], cache_dir=tmp / "coord", show_progress=False)
    cluster.heartbeat.interval, cluster.heartbeat.dead_after = 0.25, 1.5
    engine = None
    try:
        cluster.connect(open_model(path))
        ctx = len(PROMPT) + tokens + CHUNK
        engine = Engine(cluster.load(cluster.make_plan(ctx=ctx, n_slots=1, dtype="float32")), prefill_chunk=CHUNK)
        events = Stamped(kill_after)
        request = Request(PROMPT, SamplingParams(temperature=0.0), max_tokens=tokens, ignore_eos=True)
        handle = engine.submit(request, events)
        run = Run(handle.tokens, None)
        if kill_after is not None and events.reached.wait(120):
            workers[victim].kill()
            killed_at, run.killed_after = time.monotonic(), len(events.stamps)
        handle.result()
        if run.killed_after is not None:
            run.resumed = next((t - killed_at for t in events.stamps[run.killed_after :] if t > killed_at), None)
        run.error, run.recovery = handle.error, cluster.events[-1] if cluster.events else None
        return run
    finally:
        if engine is not None:
            engine.close()
        cluster.close()
        for w in workers:
            w.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--model", type=Path, help="a GGUF file (default: the near-tie model, written to a temp folder)")
    args = ap.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shardwire-recovery-exact-") as folder:
        tmp = Path(folder)
        os.environ["SHARDWIRE_STATE_DIR"] = str(tmp / "state")  # workers' certificate, known hosts: not the user's
        path = args.model or write_random_llama(tmp / "six-near-ties.gguf", near_ties=1e-6, **SIX_BLOCKS)
        reference = generate(path, tmp / "reference", args.tokens)
        if reference.error is not None:
            sys.exit(f"the uninterrupted run failed: {reference.error}")
        print(f"model {path.name}: {len(reference.tokens)} tokens uninterrupted", flush=True)
        identical = 0
        for i in range(args.runs):
            victim, t = i % 3, time.monotonic()
            run = generate(path, tmp / f"run{i}", args.tokens, 10 + (i * 37) % max(1, args.tokens - 50), victim)
            same = run.error is None and run.tokens == reference.tokens
            identical += same
            if run.error is not None:
                outcome = f"failed: {run.error}"
            elif same:
                outcome = "identical"
            else:
                pairs = zip(run.tokens, reference.tokens)
                outcome = f"differs from token {next(j for j, (a, b) in enumerate(pairs) if a != b)}"
            print(
                f"run {i + 1}: worker {victim} killed after {run.killed_after} tokens; next token "
                f"{run.resumed or float('nan'):.2f} s later (re-plan and load {run.recovery['seconds']:.2f} s, "
                f"{run.recovery['replayed_tokens']} tokens replayed); run {time.monotonic() - t:.1f} s: {outcome}",
                flush=True,
            )
    print(f"identical to the uninterrupted run: {identical} of {args.runs} ({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
