"""The floor under distributed decode on this machine: what splitting a model across processes
costs before any protocol is involved.

    python -m benchmarks.pipe_floor [--workload small-f16] [--rounds 4] [--steps 256]

In each round, interleaved, with one thread per process pinned as benchmarks/run.py pins them
(coordinator on the first core, worker i on the next, wrapping):

  one process     the whole model as one shardwire Stage in a tight decode loop
  bare pipe       the same two halves as a 2-worker run, each in a bare process; the driver
                  (the coordinator's core) writes the token to the first, the first writes its
                  hidden state to the second, the second writes the greedy token back: the
                  same ring and the same stage code, with os pipes for links and no framework
  bare pipe, one core   the same with both halves on one core
  shardwire       `shardwire bench --rpc` against 2 real workers, as run.py starts them
  llama.cpp       `llama-bench` alone and with 2 `ggml-rpc-server`s, when the build exists

Each line gives ms/token and the efficiency against the one-process figure of the same
round; the bare pipe's halves also report their own compute time per step, so a slowdown of
the stage code itself (not of the links) shows. Whatever efficiency the bare pipe reaches is
the most any system reaches here with that placement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import models, run

WARMUP = 16
STOP = b"\xff\xff\xff\xff"


def _read_exact(fd: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError("pipe closed")
        out += chunk
    return bytes(out)


def _load(path: str, part: str):
    import torch

    from shardwire.devices import TORCH_DTYPES
    from shardwire.formats import open_model
    from shardwire.pipeline.loading import load_stage
    from shardwire.weights.measure import fastest_formats
    from shardwire.weights.policy import default_dtype

    torch.set_num_threads(1)
    model = open_model(path)
    n = model.config.n_layers
    start, end = {"all": (0, n), "first": (0, n // 2), "second": (n // 2, n)}[part]
    dtype = default_dtype("cpu")  # held and computed as a CPU worker holds them (auto's choice when memory allows)
    fastest = fastest_formats("cpu", dtype)
    stage = load_stage(model, start, end, dtype=TORCH_DTYPES[dtype], weights="fast", fastest=fastest)
    stage.allocate_cache(1, 4096)
    return stage


def child(args) -> None:
    """One process of the bare pipe (first or second half), or the whole model (all)."""
    import torch

    stage = _load(args.model, args.part)
    dim = stage.cfg.dim
    compute: list[float] = []
    if args.part == "all":
        token = 1
        t0 = 0.0
        for p in range(WARMUP + args.steps):
            if p == WARMUP:
                t0 = time.perf_counter()
            token = int(stage(torch.tensor([[token]]), [0], [p])[0, -1].argmax())
        print(json.dumps({"ms_per_token": (time.perf_counter() - t0) / args.steps * 1e3}), flush=True)
        return
    rfd, wfd = args.fds
    if args.part == "first":
        os.write(args.ready_fd, b"r")
    else:
        os.write(wfd, b"ready")
    while True:
        head = _read_exact(rfd, 4)
        if head == STOP:
            if args.part == "first":
                os.write(wfd, STOP)
            break
        p = int.from_bytes(head, "little")
        if args.part == "first":
            x = torch.tensor([[int.from_bytes(_read_exact(rfd, 4), "little")]])
        else:
            width = dim * stage.dtype.itemsize
            x = torch.frombuffer(bytearray(_read_exact(rfd, width)), dtype=stage.dtype).view(1, 1, dim)
        t = time.perf_counter()
        y = stage(x, [0], [p])
        if args.part == "first":
            out = head + y.contiguous().view(torch.uint8).numpy().tobytes()
        else:
            out = int(y[0, -1].argmax()).to_bytes(4, "little")
        compute.append(time.perf_counter() - t)
        os.write(wfd, out)
    steady = compute[WARMUP:]
    print(json.dumps({"compute_ms": sum(steady) / max(1, len(steady)) * 1e3}), flush=True)


def _spawn(cmd_args: list[str], core: str, fds: tuple[int, ...] = ()) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.Popen(
        ["taskset", "-c", core, sys.executable, __file__, *cmd_args],
        env=env,
        pass_fds=fds,
        stdout=subprocess.PIPE,
        text=True,
    )


def one_process(model: Path, core: str, steps: int) -> float:
    proc = _spawn(["--child", "all", "--model", str(model), "--steps", str(steps)], core)
    out, _ = proc.communicate()
    return json.loads(out.strip().splitlines()[-1])["ms_per_token"]


def bare_pipe(model: Path, coord_core: str, cores: tuple[str, str], steps: int) -> dict:
    """The ring coordinator -> first -> second -> coordinator over os pipes."""
    to_a_r, to_a_w = os.pipe()
    a_to_b_r, a_to_b_w = os.pipe()
    b_to_c_r, b_to_c_w = os.pipe()
    ready_r, ready_w = os.pipe()
    common = ["--model", str(model), "--steps", str(steps)]
    a = _spawn(
        ["--child", "first", *common, "--fds", str(to_a_r), str(a_to_b_w), "--ready-fd", str(ready_w)],
        cores[0],
        (to_a_r, a_to_b_w, ready_w),
    )
    b = _spawn(["--child", "second", *common, "--fds", str(a_to_b_r), str(b_to_c_w)], cores[1], (a_to_b_r, b_to_c_w))
    for fd in (to_a_r, a_to_b_w, a_to_b_r, b_to_c_w, ready_w):
        os.close(fd)
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {int(coord_core)})
    try:
        _read_exact(ready_r, 1)
        _read_exact(b_to_c_r, 5)
        token, t0 = 1, 0.0
        for p in range(WARMUP + steps):
            if p == WARMUP:
                t0 = time.perf_counter()
            os.write(to_a_w, p.to_bytes(4, "little") + token.to_bytes(4, "little"))
            token = int.from_bytes(_read_exact(b_to_c_r, 4), "little")
        wall = (time.perf_counter() - t0) / steps * 1e3
        os.write(to_a_w, STOP)
        first = json.loads(a.communicate()[0].strip().splitlines()[-1])["compute_ms"]
    finally:
        os.sched_setaffinity(0, affinity)
        for fd in (to_a_w, b_to_c_r, ready_r):
            os.close(fd)
    second = json.loads(b.communicate()[0].strip().splitlines()[-1])["compute_ms"]
    return {"ms_per_token": wall, "first_compute_ms": first, "second_compute_ms": second}


def decode_ms(system: "run.System", model: Path, core: str, rpc: list[str], steps: int) -> float:
    """ms per decoded token of one coordinator invocation, built and parsed as run.py does."""
    cell = run.Cell(model.stem, len(rpc), "direct" if rpc else "local", 0, steps)
    cmd = ["taskset", "-c", core, *system.command(model, cell, rpc, 1)]
    out = subprocess.run(cmd, env=system.env(), capture_output=True, text=True, check=True).stdout
    result = run.Run(system.name, cell.key, 0)
    system.parse(json.loads(out), result)
    return statistics.mean(result.tg_ns) / 1e6 / steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="small-f16", choices=sorted(models.WORKLOADS))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=256, help="decode steps per measurement (default: %(default)s)")
    p.add_argument("--shardwire-only", action="store_true", help="leave llama.cpp out")
    p.add_argument("--child", choices=["all", "first", "second"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--fds", type=int, nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.part = args.child
        child(args)
        return 0

    prefix = None if args.shardwire_only else models.llama_cpp_prefix()
    model = models.ensure(models.WORKLOADS[args.workload], prefix)
    coord_core, (core_a, core_b) = run.cores_for(2, 1)
    print(
        f"{args.workload}: {args.steps} decode steps per figure, {args.rounds} rounds; coordinator on core "
        f"{coord_core}, halves on cores {core_a} and {core_b} (one-core pipe: both on {core_a})",
        flush=True,
    )
    options = argparse.Namespace(threads=1, dtype=None, rpc_cache=True)
    logs = Path(tempfile.mkdtemp(prefix="pipe-floor-"))
    shardwire = run.Shardwire(options, logs)
    llama_cpp = run.LlamaCpp(options, logs, prefix) if prefix is not None else None
    rows: dict[str, list[float]] = {}
    try:
        rpc = shardwire.start_workers(2, [core_a, core_b], logs / "workers.log", model)
        llama_rpc = llama_cpp.start_workers(2, [core_a, core_b], logs / "workers.log") if llama_cpp else []
        for r in range(args.rounds):
            single = one_process(model, core_a, args.steps)
            pipe = bare_pipe(model, coord_core, (core_a, core_b), args.steps)
            pipe_one = bare_pipe(model, coord_core, (core_a, core_a), args.steps)
            sw = decode_ms(shardwire, model, coord_core, rpc, args.steps)
            figures = {
                "one process": single,
                "bare pipe": pipe["ms_per_token"],
                "bare pipe, one core": pipe_one["ms_per_token"],
                "shardwire 2 workers": sw,
            }
            line = (
                f"round {r + 1}: one process {single:.2f} ms/token; bare pipe {pipe['ms_per_token']:.2f} "
                f"(eff {single / pipe['ms_per_token']:.2f}; halves computing {pipe['first_compute_ms']:.2f} + "
                f"{pipe['second_compute_ms']:.2f} ms); one core {pipe_one['ms_per_token']:.2f} "
                f"(eff {single / pipe_one['ms_per_token']:.2f}); shardwire {sw:.2f} (eff {single / sw:.2f})"
            )
            if llama_cpp is not None:
                lc_one = decode_ms(llama_cpp, model, core_a, [], args.steps)
                lc_rpc = decode_ms(llama_cpp, model, coord_core, llama_rpc, args.steps)
                figures.update({"llama.cpp one process": lc_one, "llama.cpp 2 workers": lc_rpc})
                line += f"; llama.cpp {lc_one:.2f} -> {lc_rpc:.2f} (eff {lc_one / lc_rpc:.2f})"
            for k, v in figures.items():
                rows.setdefault(k, []).append(v)
            rows.setdefault("bare pipe compute", []).append(pipe["first_compute_ms"] + pipe["second_compute_ms"])
            print(line, flush=True)
    finally:
        shardwire.stop_workers()
        if llama_cpp is not None:
            llama_cpp.stop_workers()
    med = {k: statistics.median(v) for k, v in rows.items()}
    print("\nmedians (ms/token) and efficiency against the same system's one process:")
    for k, v in med.items():
        base = med["llama.cpp one process"] if k.startswith("llama.cpp") else med["one process"]
        print(f"  {k:24s} {v:7.2f}   eff {base / v:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
