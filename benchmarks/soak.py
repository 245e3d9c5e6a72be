"""Soak: four concurrent streams through three workers while a worker is killed and restarted
every minute. Bounded by --minutes. Every request must complete with the tokens an
uninterrupted single-process run gives; memory must not creep.

    python benchmarks/soak.py [--minutes 10]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from shardwire.coordinator import Cluster  # noqa: E402
from shardwire.engine import Engine, Request  # noqa: E402
from shardwire.formats import open_model  # noqa: E402
from shardwire.loading import load_stage  # noqa: E402
from shardwire.pipeline import LocalPipeline  # noqa: E402
from shardwire.sampling import SamplingParams  # noqa: E402
from shardwire_kit.synthetic import write_random_llama  # noqa: E402

from workers import WorkerProcess  # noqa: E402

STREAMS = 4


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="shardwire-soak-"))
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

    workers = [WorkerProcess(tmp / f"w{i}").start() for i in range(3)]
    cluster = Cluster([w.address for w in workers], cache_dir=tmp / "coord", show_progress=False)
    cluster.heartbeat.dead_after = 2.0
    cluster.connect(open_model(path))
    engine = Engine(
        cluster.load(cluster.make_plan(ctx=512, n_slots=STREAMS, prefill_chunk=32, dtype="float32")), prefill_chunk=32
    )
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
    kills = 0
    started = time.monotonic()
    while time.monotonic() < stop:
        time.sleep(min(50.0, max(0.0, stop - time.monotonic())))
        if time.monotonic() >= stop:
            break
        victim = kills % 3
        workers[victim].kill()
        kills += 1
        time.sleep(10)
        workers[victim] = WorkerProcess(workers[victim].cache_dir, port=workers[victim].port).start()
        memory.append(rss([psutil.Process().pid]))
        print(
            f"{time.monotonic() - started:6.0f} s: killed and restarted worker {victim}; {results}; "
            f"RSS coordinator {memory[-1]:.0f} MiB, workers {rss([w.proc.pid for w in workers]):.0f} MiB",
            flush=True,
        )
    for t in threads:
        t.join(300)
    engine.close()
    cluster.close()
    for w in workers:
        w.stop()
    recoveries = [e for e in cluster.events if e["recovered"]]
    print(
        f"\nsoak: {args.minutes:.0f} min, {STREAMS} streams, {kills} kills -> {results}; "
        f"{len(recoveries)} recoveries/rebalances, slowest {max((e['seconds'] for e in recoveries), default=0):.2f} s; "
        f"coordinator RSS samples (MiB): {', '.join(f'{m:.0f}' for m in memory)}"
    )


if __name__ == "__main__":
    main()
