"""The cost of TLS (and the token handshake) on a decode step, measured side by side.

Two worker processes on loopback serve a small model twice: once over plain TCP (`--no-tls` on
both sides), once as started with only a token (TLS by default: certificates made and pinned on
first contact). Decode runs alternate between the two setups (A B A B ...) so that drift
on a shared machine hits both alike.

    python -m benchmarks.tls_cost [--rounds 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from shardwire.coordinator import Cluster
from shardwire.engine import Engine, Request
from shardwire.formats import open_model
from shardwire.sampling import SamplingParams
from shardwire.state import STATE_ENV
from shardwire_kit.synthetic import write_random_llama
from tests.support.workers import WorkerProcess

TOKEN = "benchmark-token"


def decode_seconds_per_token(pipeline, n: int) -> float:
    engine = Engine(pipeline)
    try:
        handle = engine.submit(
            Request(list(range(1, 9)), SamplingParams(temperature=0.0), max_tokens=n, ignore_eos=True)
        )
        handle.result()
        return 1.0 / handle.stats.decode_tps
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="shardwire-tls-bench-"))
    path = tmp / "model.gguf"
    write_random_llama(path, weight_type="F16", n_layers=args.layers, dim=args.dim, n_heads=8, n_kv_heads=4)
    model = open_model(path)
    # Ephemeral ports would fill the user's known hosts: this run pins in a folder of its own.
    os.environ[STATE_ENV] = str(tmp / "state")
    plain = [WorkerProcess(tmp / f"plain{i}", extra=("--no-tls",)).start() for i in range(2)]
    secure = [WorkerProcess(tmp / f"tls{i}", token=TOKEN).start() for i in range(2)]  # the defaults
    clusters = {
        "plain TCP": Cluster([w.address for w in plain], cache_dir=tmp / "c1", tls=None, show_progress=False),
        "TLS + token": Cluster([w.address for w in secure], token=TOKEN, cache_dir=tmp / "c2", show_progress=False),
    }
    try:
        pipelines = {}
        for name, cluster in clusters.items():
            cluster.connect(model)
            pipelines[name] = cluster.load(cluster.make_plan(ctx=512))
        times: dict[str, list[float]] = {name: [] for name in clusters}
        for r in range(args.rounds):
            order = list(pipelines.items())
            for name, pipeline in order if r % 2 == 0 else order[::-1]:  # A B B A ...
                times[name].append(decode_seconds_per_token(pipeline, args.tokens))
        base = statistics.median(times["plain TCP"])
        print(
            f"model: {args.layers} blocks, width {args.dim}, F16; 2 workers on loopback; "
            f"{args.rounds} interleaved rounds of {args.tokens} tokens"
        )
        print(f"{'setup':<14} {'ms/token':>9} {'tokens/s':>9} {'ratio':>6}")
        for name, ts in times.items():
            t = statistics.median(ts)
            print(f"{name:<14} {t * 1000:9.3f} {1 / t:9.1f} {t / base:6.3f}")
        dtype = clusters["plain TCP"].plan.stages[0].device.dtype
        hidden = args.dim * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        print(f"hidden state per boundary per token: {hidden} bytes ({dtype}) + frame headers")
    finally:
        for cluster in clusters.values():
            cluster.close()
        for w in plain + secure:
            w.stop()


if __name__ == "__main__":
    main()
