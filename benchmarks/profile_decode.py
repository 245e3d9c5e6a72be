"""Where shardwire's per-token decode time goes: py-spy on every process of a 2-worker run,
and a compute-only timing of the same stages in one process.

    python -m benchmarks.profile_decode [--workload small-f16] [--workers 2] [--steps 400]

1. Compute only: each worker's stage (the same blocks, dtype, one thread) run in this process
   with T=1 decode inputs; the sum over stages is the arithmetic a decode step cannot avoid.
   Also the same stages at width 64 (same block count): what remains there is per-op
   dispatch overhead (PyTorch + Python), not arithmetic.
2. End to end: `shardwire bench --rpc` against real workers, each process pinned to a core;
   py-spy samples every thread of the coordinator and the workers (with idle time, so the
   samples of a thread add up to wall time) while they decode. Each frame's share of its
   thread's samples x the measured ms/token = its ms per token.
Writes benchmarks/results/profile-<time>/ (raw py-spy stacks, profile.md) and prints the table.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import models
from .run import LISTENING, PROGRESS, Server, cores_for, private_state_dir

HERE = Path(__file__).resolve().parent


PY_SPY = Path(sys.executable).parent / "py-spy"

FRAME = re.compile(r"^(.*) \((.*):(\d+)\)$")
ROOT = HERE.parent


def _source(path: str, line: int) -> str:
    for candidate in (Path(path), ROOT / path, ROOT / "shardwire" / path):
        try:
            return candidate.read_text().splitlines()[line - 1].strip()
        except (OSError, IndexError):
            continue
    return ""


def where(stack: tuple) -> str:
    """The innermost shardwire frame and its line of code, with the library call below it."""
    parsed = [FRAME.match(f) for f in stack]
    ours = [i for i, m in enumerate(parsed) if m and "shardwire/" in m[2] and "benchmarks" not in m[2]]
    if not ours:
        m = parsed[-1] if parsed else None
        return f"{m[1]} ({Path(m[2]).name})" if m else "?"
    i = ours[-1]
    m = parsed[i]
    text = f"{Path(m[2]).name}:{m[3]} {m[1]}: `{_source(m[2], int(m[3]))[:60]}`"
    if i < len(parsed) - 1 and parsed[-1]:
        text += f" -> {parsed[-1][1]} ({Path(parsed[-1][2]).name})"
    return text


def parse_raw(path: Path) -> dict[str, collections.Counter]:
    """py-spy --format raw --threads: 'thread (tid): name;frame;frame... count' per line."""
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        stack_text, _, count = line.rpartition(" ")
        if not stack_text:
            continue
        frames = stack_text.split(";")
        thread = frames[0].split(": ", 1)[-1]
        threads[thread][tuple(frames[1:])] += int(count)
    return threads


def compute_only(model_path: Path, n_workers: int, threads: int, steps: int) -> dict:
    """ms per decode step of each worker's stage alone, at the model's width and at width 64."""
    import torch

    from shardwire.formats import open_model
    from shardwire.model import Stage
    from shardwire.pipeline.loading import load_stage
    from shardwire.pipeline.plan import split_blocks
    from shardwire_kit.synthetic import random_model

    torch.set_num_threads(threads)
    model = open_model(model_path)
    cfg = model.config
    counts = split_blocks(cfg.n_layers, [1.0] * n_workers)
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c

    def time_stage(stage, first: bool) -> float:
        stage.allocate_cache(1, steps + 8)
        x = torch.tensor([[1]]) if first else torch.randn(1, 1, stage.cfg.dim)
        for i in range(5):
            stage(x, [0], [i])
        t0 = time.perf_counter()
        for i in range(5, steps):
            stage(x, [0], [i])
        return (time.perf_counter() - t0) / (steps - 5) * 1000

    out = {"stages": [], "narrow": []}
    small_cfg, small_tensors = random_model(
        "llama", n_layers=cfg.n_layers, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256
    )
    for a, b in bounds:
        stage = load_stage(model, a, b)
        out["stages"].append({"blocks": [a, b], "ms": time_stage(stage, a == 0)})
        del stage
        weights = {
            k: torch.from_numpy(v)
            for k, v in small_tensors.items()
            if not k.startswith("blk.") or a <= int(k.split(".")[1]) < b
        }
        narrow = Stage(small_cfg, a, b, weights, a == 0, b == cfg.n_layers)
        out["narrow"].append({"blocks": [a, b], "ms": time_stage(narrow, a == 0)})
    return out


def main() -> int:
    private_state_dir()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="small-f16", choices=list(models.WORKLOADS))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=400, help="decode steps of the profiled run")
    p.add_argument("--rate", type=int, default=400, help="py-spy samples per second")
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = Path(args.out) if args.out else HERE / "results" / f"profile-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    model = models.ensure(models.WORKLOADS[args.workload], None)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    coord_core, worker_cores = cores_for(args.workers, args.threads)

    print("compute only (this process, pinned like worker 0) ...", flush=True)
    os.sched_setaffinity(0, {int(c) for c in worker_cores[0].split(",")})
    compute = compute_only(model, args.workers, args.threads, 200)
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))

    servers, addresses = [], []
    log = out / "workers.log"
    for i in range(args.workers):
        s = Server(
            f"worker{i}",
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
                str(args.threads),
                "--model-dir",
                str(model.parent),
            ],
            worker_cores[i],
            env,
            log,
        )
        servers.append(s)
        addresses.append(f"127.0.0.1:{s.wait_for(LISTENING, 120)[2]}")
    spies = []
    try:
        cmd = [
            "taskset",
            "-c",
            coord_core,
            sys.executable,
            "-m",
            "shardwire",
            "bench",
            str(model),
            "--rpc",
            ",".join(addresses),
            "-ts",
            ",".join(["1"] * args.workers),
            "-p",
            "0",
            "-n",
            str(args.steps),
            "-r",
            "1",
            "-t",
            str(args.threads),
            "-o",
            "json",
            "--progress",
        ]
        coord = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        started = threading.Event()

        def watch():
            for line in coord.stderr:
                m = PROGRESS.search(line)
                if m and not m[3] and m[4] == "generation":
                    started.set()

        threading.Thread(target=watch, daemon=True).start()
        if not started.wait(300):
            raise RuntimeError("the coordinator did not start decoding")
        time.sleep(0.5)
        duration = 4
        targets = [("coordinator", coord.pid)] + [(f"worker{i}", s.proc.pid) for i, s in enumerate(servers)]
        for name, pid in targets:
            spies.append(
                (
                    name,
                    out / f"{name}.txt",
                    subprocess.Popen(
                        [
                            str(PY_SPY),
                            "record",
                            "--pid",
                            str(pid),
                            "--rate",
                            str(args.rate),
                            "--duration",
                            str(duration),
                            "--format",
                            "raw",
                            "--output",
                            str(out / f"{name}.txt"),
                            "--idle",
                            "--threads",
                            "--nonblocking",
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE,
                        text=True,
                    ),
                )
            )
        for _, _, spy in spies:
            spy.wait(60)
        result, _ = coord.communicate(timeout=600)
    finally:
        for s in servers:
            s.stop()
    import json

    report = json.loads(result)
    tg = next(t for t in report["tests"] if t["n_gen"])
    ms_per_token = 1000 / tg["avg_ts"]
    lines = [
        f"# Where shardwire's decode time goes ({args.workload}, {args.workers} workers on loopback, "
        f"{args.threads} thread per process)",
        "",
        f"Measured end to end: {tg['avg_ts']:.1f} tokens/s = **{ms_per_token:.2f} ms per token** "
        f"(tg{args.steps}, `shardwire bench --rpc`, processes pinned as in benchmarks/run.py).",
        "",
        "Compute only (each stage alone in one process, T=1, same dtype and threads): "
        + ", ".join(f"blocks {s['blocks'][0]}-{s['blocks'][1] - 1}: {s['ms']:.2f} ms" for s in compute["stages"])
        + f"; sum **{sum(s['ms'] for s in compute['stages']):.2f} ms**. The same stages at width 64 "
        f"(dispatch overhead, no arithmetic to speak of): "
        + ", ".join(f"{s['ms']:.2f} ms" for s in compute["narrow"])
        + f"; sum {sum(s['ms'] for s in compute['narrow']):.2f} ms.",
        "",
        "{busy}",
        "",
    ]
    busy_ms = []
    for name, path, spy in spies:
        if not path.exists():
            lines.append(f"{name}: py-spy wrote nothing ({spy.stderr.read()[-300:]})")
            continue
        threads = parse_raw(path)
        lines += [
            f"## {name}",
            "",
            "| thread | ms per token | top places (ms per token; waiting shows as recv/wait) |",
            "| --- | ---: | --- |",
        ]
        for thread, stacks in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
            total = sum(stacks.values())
            if thread.startswith("stage"):  # busy = everything but waiting for the next step
                idle = sum(n for st, n in stacks.items() if "queue.get()" in where(st))
                busy_ms.append((name, (total - idle) / total * ms_per_token))
            places = collections.Counter()
            for stack, n in stacks.items():
                places[where(stack)] += n
            top = "<br>".join(f"{v / total * ms_per_token:.2f} {k}" for k, v in places.most_common(6))
            lines.append(f"| {thread} | {ms_per_token:.2f} | {top} |")
        lines.append("")
    compute_sum = sum(x["ms"] for x in compute["stages"])
    busy_sum = sum(b for _, b in busy_ms)
    lines[lines.index("{busy}")] = (
        "Stage threads busy per token in the real run (py-spy, all but waiting on their queue): "
        + ", ".join(f"{n} {b:.2f} ms" for n, b in busy_ms)
        + f"; sum **{busy_sum:.2f} ms** against {compute_sum:.2f} ms "
        f"compute-only. Of the {ms_per_token:.2f} ms per token, {ms_per_token - busy_sum:.2f} ms is outside the "
        f"stage threads (wire, hand-offs between threads and processes, the coordinator), and "
        f"{busy_sum - compute_sum:.2f} ms is the same stage compute running slower inside the pipeline than alone."
    )
    text = "\n".join(lines)
    (out / "profile.md").write_text(text)
    (out / "compute.json").write_text(json.dumps({"compute": compute, "bench": report}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
