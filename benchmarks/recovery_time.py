"""Recovery time after a worker is killed mid-generation: from the kill to the next token.

Three worker processes on loopback serve a 1B-class model (22 blocks, width 2048, FFN 5632,
32 heads / 4 KV heads, vocab 32000, random weights, Q8_0 GGUF). Each worker has its own copy of
the model file (--model-dir), so the stages it must take over are read from local disk, not
streamed. Mid-generation one worker is killed with SIGKILL; the two that are left take its
blocks, every sequence replays its tokens, and decoding continues.

    python -m benchmarks.recovery_time [--kills 2] [--tokens 96]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from shardwire.coordinator import Cluster
from shardwire.engine import Engine, Request
from shardwire.formats import open_model
from shardwire.sampling import SamplingParams
from shardwire_kit.synthetic import random_model, tiny_vocab_metadata
from shardwire_kit.writer import write_gguf
from tests.support.workers import WorkerProcess


def one_b_model(folder: Path) -> Path:
    path = folder / "1b-q8_0.gguf"
    if not path.exists():
        vocab = tiny_vocab_metadata()
        tokens = vocab["tokenizer.ggml.tokens"]
        # a 32000-token vocabulary: the tiny BPE padded with unused tokens
        vocab = {
            **vocab,
            "tokenizer.ggml.tokens": tokens + [f"<unused{i}>" for i in range(32000 - len(tokens))],
            "tokenizer.ggml.token_type": vocab["tokenizer.ggml.token_type"] + [5] * (32000 - len(tokens)),
        }
        cfg, tensors = random_model(
            "llama",
            n_layers=22,
            dim=2048,
            n_heads=32,
            n_kv_heads=4,
            ffn_dim=5632,
            vocab_size=32000,
            context_length=2048,
        )
        write_gguf(path, cfg, tensors, vocab, weight_type="Q8_0")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--models", default=str(Path.home() / ".cache" / "shardwire" / "bench-models"))
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    models = Path(args.models)
    models.mkdir(parents=True, exist_ok=True)
    path = one_b_model(models)
    tmp = Path(tempfile.mkdtemp(prefix="shardwire-recovery-"))
    extra = ("--model-dir", str(models))
    workers = [WorkerProcess(tmp / f"w{i}", extra=extra).start() for i in range(3)]
    cluster = Cluster([w.address for w in workers], cache_dir=tmp / "coord", show_progress=False)
    cluster.heartbeat.dead_after = 3.0
    try:
        cluster.connect(open_model(path))
        t = time.monotonic()
        pipeline = cluster.load(cluster.make_plan(ctx=512, n_slots=2))
        print(
            f"model {path.name}: first load {time.monotonic() - t:.1f} s "
            f"({', '.join(f'{k} {v / 2**20:.0f} MiB' for k, v in cluster.load_stats.items())})"
        )
        engine = Engine(pipeline, prefill_chunk=128)
        for kill in range(args.kills):
            victim = kill % 3
            handle = engine.submit(
                Request(list(range(1, 65)), SamplingParams(temperature=0.0), max_tokens=args.tokens, ignore_eos=True)
            )
            stamps: list[float] = []
            done = threading.Event()

            def watch(h=handle, stamps=stamps):
                for event in h:
                    if event.token is not None:
                        stamps.append(time.monotonic())
                done.set()

            threading.Thread(target=watch, daemon=True).start()
            while len(stamps) < 16:
                time.sleep(0.005)
            before = len(stamps)
            killed_at = time.monotonic()
            workers[victim].kill()
            done.wait(600)
            after = next(s for s in stamps[before:] if s > killed_at)
            gaps = [b - a for a, b in zip(stamps, stamps[1:before])]
            event = cluster.events[-1]
            print(
                f"kill {kill + 1}: worker {victim} killed after {before} tokens; next token "
                f"{after - killed_at:.2f} s later (re-plan + load {event['seconds']:.2f} s, replayed "
                f"{event['replayed_tokens']} tokens; "
                f"a normal token takes {1000 * sorted(gaps)[len(gaps) // 2]:.0f} ms); "
                f"error: {handle.error}; plan now {event['plan']}"
            )
            workers[victim] = WorkerProcess(workers[victim].cache_dir, port=workers[victim].port, extra=extra).start()
            deadline = time.monotonic() + 120
            while len(cluster.plan.stages) < 3 and time.monotonic() < deadline:
                engine.submit(Request([1, 2, 3], SamplingParams(temperature=0.0), max_tokens=1)).result()
                time.sleep(0.5)
            print(
                f"  worker {victim} restarted and re-admitted: plan back to {len(cluster.plan.stages)} stages "
                f"(rebalance {cluster.events[-1]['seconds']:.2f} s)"
            )
        engine.close()
    finally:
        cluster.close()
        for w in workers:
            w.stop()


if __name__ == "__main__":
    main()
