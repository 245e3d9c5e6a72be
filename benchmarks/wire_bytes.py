"""shardwire's bytes on the wire per decode step, per stage boundary.

    python -m benchmarks.wire_bytes                       # the benchmark's layouts, computed
    python -m benchmarks.wire_bytes --dim 8192 --dtype bfloat16 --rows 8
    python -m benchmarks.wire_bytes --measure MODEL.gguf --workers 2   # counted on real sockets

Per decode step every boundary is crossed once:
    coordinator --FORWARD(token ids)--> S1 --FORWARD(hidden)--> S2 ... Sn --RESULT(token ids)--> coordinator
A hidden-state FORWARD carries rows x dim x element size bytes of payload plus a 32-byte
fixed header and a small msgpack header (plan id, step, rows, sampling parameters); the
RESULT carries sampled token ids only: no logits, no weights. The computed figures pack
the very frames the code sends (shardwire.wire.frames / messages); --measure runs real
workers behind counting relays (benchmarks/relay.py) and reports what crossed each link.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ELEMENT = {"float32": 4, "float16": 2, "bfloat16": 2}


def frame_sizes(dim: int, dtype: str, rows: int = 1, position: int = 600) -> dict:
    """Bytes of each frame of one decode step, from the real encoders."""
    from dataclasses import asdict

    from shardwire.kvcache import pages_for
    from shardwire.sampling import GREEDY
    from shardwire.wire.frames import MessageType, pack_header
    from shardwire.wire.messages import Forward

    plan = "0123456789abcdef"  # plan ids are 16 hex digits
    row_list = [(i, position, 1) for i in range(rows)]
    sampling = [asdict(GREEDY) for _ in range(rows)]
    recent = [[] for _ in range(rows)]
    pages = [list(range(i * 64, i * 64 + pages_for(position + 1))) for i in range(rows)]
    ids = Forward(plan, 123456, row_list, pages, sampling, recent, "int32", [rows, 1])
    hidden = Forward(plan, 123456, row_list, pages, sampling, recent, dtype, [rows, 1, dim])
    result = {"step": 123456, "tokens": [31999] * rows, "logprobs": [None] * rows}
    sizes = {}
    for name, mtype, header, payload in [
        ("coordinator -> first stage (token ids)", MessageType.FORWARD, ids.to_header(), 4 * rows),
        ("stage -> next stage (hidden state)", MessageType.FORWARD, hidden.to_header(), ELEMENT[dtype] * dim * rows),
        ("last stage -> coordinator (sampled ids)", MessageType.RESULT, result, 0),
    ]:
        head = len(pack_header(mtype, header, payload, 0))
        sizes[name] = {"header": head, "payload": payload, "total": head + payload}
    return sizes


def per_step(sizes: dict, n_workers: int) -> int:
    names = list(sizes)
    return sizes[names[0]]["total"] + (n_workers - 1) * sizes[names[1]]["total"] + sizes[names[2]]["total"]


def show_computed(args) -> None:
    from shardwire.weights.policy import default_dtype

    from . import models

    if args.dtype is None:
        args.dtype = default_dtype("cpu")

    layouts = (
        [(name, l.params["dim"]) for name, l in models.LAYOUTS.items()]
        if args.dim is None
        else [(f"width {args.dim}", args.dim)]
    )
    for name, dim in layouts:
        sizes = frame_sizes(dim, args.dtype, args.rows)
        print(f"{name}: hidden width {dim}, {args.dtype} activations, {args.rows} row(s) per step")
        for frame, s in sizes.items():
            print(f"  {frame:42s} {s['total']:8d} B  (payload {s['payload']}, headers {s['header']})")
        for n in (1, 2, 3):
            print(
                f"  per decode step with {n} worker{'s' if n > 1 else ' '}: {per_step(sizes, n):8d} B "
                f"over {n + 1} crossings"
            )
        print()


def measure(args) -> None:
    """Real workers behind counting relays; bytes per decode step on each link."""
    import os
    import re
    import subprocess

    from shardwire.coordinator.launch import add_cluster_args, build_pipeline
    from shardwire.engine import Engine, Request
    from shardwire.formats import open_model
    from shardwire.sampling import GREEDY

    from .relay import Relay

    model = open_model(args.measure)
    procs, relays = [], []
    try:
        for i in range(args.workers):
            p = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "shardwire",
                    "worker",
                    "--port",
                    "0",
                    "--device",
                    "cpu",
                    "--threads",
                    "1",
                    "--model-dir",
                    str(Path(args.measure).resolve().parent),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=dict(os.environ, OMP_NUM_THREADS="1"),
            )
            procs.append(p)
            for line in p.stdout:
                m = re.search(r"listening on (\S+):(\d+)", line)
                if m:
                    relays.append(Relay(("127.0.0.1", int(m[2]))))
                    break
        parser = argparse.ArgumentParser()
        add_cluster_args(parser)  # the coordinator's own defaults, as `shardwire generate` has them
        ns = parser.parse_args(["--rpc", ",".join(r.address for r in relays)])
        ns.ctx_size, ns.device, ns.dtype, ns.weights = args.steps + 16, None, None, "auto"
        pipeline, cluster = build_pipeline(model, ns, quiet=True)
        engine = Engine(pipeline, None)
        links = cluster.links
        engine.submit(Request([1], GREEDY, max_tokens=4, ignore_eos=True)).result()  # warm up
        before = [(r.counter.up, r.counter.down) for r in relays]
        sent = [l.conn.bytes_sent for l in links]
        t0 = time.perf_counter()
        engine.submit(Request([1], GREEDY, max_tokens=args.steps, ignore_eos=True)).result()
        elapsed = time.perf_counter() - t0
        after = [(r.counter.up, r.counter.down) for r in relays]
        sent_after = [l.conn.bytes_sent for l in links]
        engine.close()
        pipeline.close()
        steps = args.steps
        print(
            f"{args.measure}: {args.workers} workers, {steps} decode steps in {elapsed:.2f} s "
            f"(heartbeats included, about 1 per second per worker)"
        )
        total = 0
        for i, (b, a) in enumerate(zip(before, after)):
            up, down = (a[0] - b[0]) / steps, (a[1] - b[1]) / steps
            from_coordinator = (sent_after[i] - sent[i]) / steps
            total += up + down
            src = "coordinator" if i == 0 else f"worker {i - 1} (+ coordinator {from_coordinator:.0f})"
            print(f"  link into worker {i}: {up:8.0f} B/step up (from {src}), {down:8.0f} B/step down")
        print(f"  all links: {total:.0f} B per decode step")
        dtype = pipeline.cluster.plan.stages[0].device.dtype
        sizes = frame_sizes(model.config.dim, dtype)
        print(f"  computed: {per_step(sizes, args.workers)} B per decode step ({dtype} activations)")
    finally:
        for r in relays:
            r.close()
        for p in procs:
            p.terminate()
            p.wait(10)


def main() -> int:
    from .run import private_state_dir

    private_state_dir()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=None, help="hidden width (default: the benchmark's layouts)")
    p.add_argument(
        "--dtype",
        default=None,
        choices=sorted(ELEMENT),
        help="activation dtype on the wire (default: the stage's compute dtype on this machine's CPU)",
    )
    p.add_argument("--rows", type=int, default=1, help="sequences in one step (default: %(default)s)")
    p.add_argument("--measure", default=None, metavar="MODEL", help="count bytes on real sockets for this model")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=64)
    args = p.parse_args()
    if args.measure:
        measure(args)
    else:
        show_computed(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
