"""Soak: four concurrent streams through three workers while faults come one after another, each
on the next worker in turn. Bounded by --minutes. Every request must complete with the tokens an
uninterrupted single-process run gives; memory must not creep.

Faults (--faults, taken in turn, one every --every seconds):
  kill    the worker is killed (SIGKILL) and restarted on its port --down-seconds later
  freeze  the worker is stopped (SIGSTOP) and resumed (SIGCONT) after the next of --freeze-seconds
  drop    the route to the worker drops every packet, both directions and for coordinator and
          worker alike, nothing closed, for the next of --drop-seconds (a relay in front of
          each worker holds the bytes; TCP delivers them late once the route is back)

    python -m benchmarks.soak [--minutes 10]                        # a kill every minute
    python -m benchmarks.soak --faults kill,freeze,drop --every 40  # all three, mixed
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

from shardwire.coordinator import Cluster
from shardwire.engine import Engine, Request
from shardwire.formats import open_model
from shardwire.pipeline import LocalPipeline
from shardwire.pipeline.loading import load_stage
from shardwire.sampling import SamplingParams
from shardwire.state import STATE_ENV
from shardwire_kit.synthetic import write_random_llama
from tests.support.freezable_relay import FreezableRelay
from tests.support.workers import WorkerProcess

STREAMS = 4
FAULTS = ("kill", "freeze", "drop")


def reference_tokens(path: Path, prompts, n: int, sampling) -> list[list[int]]:
    model = open_model(path)
    engine = Engine(LocalPipeline([load_stage(model, 0, model.config.n_layers)], n_slots=1, ctx=512), prefill_chunk=32)
    out = []
    for p in prompts:
        h = engine.submit(Request(p, sampling, max_tokens=n, ignore_eos=True))
        h.result()
        out.append(h.tokens)
    engine.close()
    return out


def rss(pids) -> float:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def seconds_list(text: str) -> list[float]:
    return [float(s) for s in text.split(",") if s.strip()]


class Faults:
    """The workers, a relay in front of each when drops are wanted, and the faults applied to them."""

    def __init__(self, tmp: Path, relays: bool, down_s: float, freeze_s: list[float], drop_s: list[float]):
        self.workers = [WorkerProcess(tmp / f"w{i}").start() for i in range(3)]
        self.relays = [FreezableRelay(w.port) for w in self.workers] if relays else []
        self.down_s = down_s
        self.durations = {"freeze": itertools.cycle(freeze_s), "drop": itertools.cycle(drop_s)}
        self.done: Counter = Counter()

    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self.relays] if self.relays else [w.address for w in self.workers]

    def next_duration(self, kind: str) -> float:
        return self.down_s if kind == "kill" else next(self.durations[kind])

    def apply(self, kind: str, victim: int, seconds: float) -> str:
        w = self.workers[victim]
        if kind == "kill":
            w.kill()
            time.sleep(seconds)
            self.workers[victim] = WorkerProcess(w.cache_dir, port=w.port).start()
            label = "kill"
        elif kind == "freeze":
            w.proc.send_signal(signal.SIGSTOP)
            try:
                time.sleep(seconds)
            finally:
                w.proc.send_signal(signal.SIGCONT)
            label = f"freeze {seconds:g} s"
        else:
            self.relays[victim].drop(True)
            try:
                time.sleep(seconds)
            finally:
                self.relays[victim].drop(False)
            label = f"drop {seconds:g} s"
        self.done[label] += 1
        return label

    def close(self) -> None:
        for r in self.relays:
            r.close()
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.send_signal(signal.SIGCONT)
            w.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--faults", default="kill", help="comma-separated faults taken in turn (default: %(default)s)")
    ap.add_argument("--every", type=float, default=60.0, help="seconds from one fault to the next (%(default)s)")
    ap.add_argument("--down-seconds", type=float, default=10.0, help="a killed worker's time down (%(default)s)")
    ap.add_argument("--freeze-seconds", default="1,8", help="freeze lengths, taken in turn (%(default)s)")
    ap.add_argument("--drop-seconds", default="20", help="packet-drop lengths, taken in turn (%(default)s)")
    ap.add_argument("--dead-after", type=float, default=2.0, help="the coordinator's --dead-after (%(default)s)")
    args = ap.parse_args()
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    if not kinds or any(k not in FAULTS for k in kinds):
        ap.error(f"--faults takes a comma-separated list of {', '.join(FAULTS)}")
    import torch

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="shardwire-soak-"))
    os.environ[STATE_ENV] = str(tmp / "state")  # this run's certificate and known hosts, not the user's
    path = tmp / "soak.gguf"
    write_random_llama(
        path, weight_type="F16", n_layers=6, dim=256, n_heads=8, n_kv_heads=4, ffn_dim=768, context_length=512, seed=11
    )
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(8, 120))] for _ in range(16)]
    samplings = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=3)]
    expected = {
        (i, j): toks
        for j, s in enumerate(samplings)
        for i, toks in enumerate(reference_tokens(path, prompts, args.tokens, s))
    }

    faults = Faults(
        tmp, "drop" in kinds, args.down_seconds, seconds_list(args.freeze_seconds), seconds_list(args.drop_seconds)
    )
    cluster = Cluster(faults.addresses, cache_dir=tmp / "coord", show_progress=False)
    cluster.heartbeat.dead_after = args.dead_after
    try:
        cluster.connect(open_model(path))
        engine = Engine(
            cluster.load(cluster.make_plan(ctx=512, n_slots=STREAMS, prefill_chunk=32, dtype="float32")),
            prefill_chunk=32,
        )
        soak(args, engine, cluster, faults, kinds, prompts, samplings, expected)
        engine.close()
    finally:
        cluster.close()
        faults.close()


def soak(args, engine, cluster, faults: Faults, kinds, prompts, samplings, expected) -> None:
    stop = time.monotonic() + args.minutes * 60
    results = {"completed": 0, "wrong": 0, "failed": 0}
    lock = threading.Lock()

    def stream(k: int) -> None:
        r = random.Random(k)
        while time.monotonic() < stop:
            i, j = r.randrange(len(prompts)), r.randrange(len(samplings))
            h = engine.submit(Request(prompts[i], samplings[j], max_tokens=args.tokens, ignore_eos=True))
            h.result()
            with lock:
                if h.error:
                    results["failed"] += 1
                    print(f"  stream {k}: FAILED: {h.error}", flush=True)
                elif h.tokens != expected[(i, j)]:
                    results["wrong"] += 1
                    print(f"  stream {k}: WRONG tokens for prompt {i}", flush=True)
                else:
                    results["completed"] += 1

    threads = [threading.Thread(target=stream, args=(k,), daemon=True) for k in range(STREAMS)]
    for t in threads:
        t.start()
    memory = []
    started = time.monotonic()
    for n in itertools.count():
        kind, victim = kinds[n % len(kinds)], n % 3
        seconds = faults.next_duration(kind)
        time.sleep(min(max(5.0, args.every - seconds), max(0.0, stop - time.monotonic())))
        if time.monotonic() + seconds >= stop:
            break
        label = faults.apply(kind, victim, seconds)
        memory.append(rss([psutil.Process().pid]))
        print(
            f"{time.monotonic() - started:6.0f} s: {label} on worker {victim}; {results}; "
            f"RSS coordinator {memory[-1]:.0f} MiB, workers {rss([w.proc.pid for w in faults.workers]):.0f} MiB",
            flush=True,
        )
    for t in threads:
        t.join(300)
    recoveries = [e for e in cluster.events if e["recovered"]]
    failed_recoveries = len(cluster.events) - len(recoveries)
    print(
        f"\nsoak: {args.minutes:g} min, {STREAMS} streams, faults {dict(faults.done)} -> {results}; "
        f"{len(recoveries)} recoveries/rebalances ({failed_recoveries} failed), "
        f"slowest {max((e['seconds'] for e in recoveries), default=0):.2f} s; "
        f"coordinator RSS samples (MiB): {', '.join(f'{m:.0f}' for m in memory)}"
    )


if __name__ == "__main__":
    main()
