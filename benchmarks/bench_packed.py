"""Packed weights on the CPU: resident memory per stage against the GGUF bytes, the plan's
accounting against what the process then holds, and decode speed against dequantized bf16.

    python -m benchmarks.packed_models                 # the 1B-class files (once)
    python -m benchmarks.bench_packed memory [--types Q4_0,Q4_K_M,Q8_0]
    python -m benchmarks.bench_packed speed --threads 2 [--rounds 5] [--steps 16]

memory: each (file, mode, stage) loads in a fresh process; resident = the growth of the process's
RSS over the load (the file mapping closed, freed heap returned), peak = VmHWM over a prefill
chunk and decode steps (reset just before). speed: one process holds both a packed and a
dequantized bf16 copy of the model and times decode steps A/B, alternating which goes first.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODELS = Path.home() / ".cache/shardwire/bench-models"
STAGES = {"first": (0, 7), "middle": (7, 15), "last": (15, 22)}


def proc_status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def measure(path: str, mode: str, start: int, end: int, ctx: int, chunk: int, threads: int) -> dict:
    """One stage in this (fresh) process: what it holds, and what the plan said it would."""
    import torch

    from shardwire.devices import release_memory
    from shardwire.formats import TensorReader, open_model
    from shardwire.kvcache import pool_pages
    from shardwire.pipeline.loading import load_stage
    from shardwire.pipeline.plan import PlanDevice, PlannedStage, stage_cost

    torch.set_num_threads(threads)
    torch.ones(1) @ torch.ones(1)  # load the math libraries before the baseline
    model = open_model(path)
    first, last = start == 0, end == model.config.n_layers
    tensors = model.stage_tensors(start, end, first, last)
    gguf_bytes = sum(t.nbytes for t in tensors.values())
    device = PlanDevice("local", "cpu", 1 << 40, "bfloat16", kernels=True)
    planned = stage_cost(
        model.config, tensors, PlannedStage(device, start, end, first, last), mode, 1, pool_pages(1, ctx), chunk
    )
    # warm up: a one-block stage first, so one-time costs (libraries paging in, allocator and
    # thread-pool set-up) are not counted as the stage's
    warm = load_stage(model, start, start + 1, first=False, last=False, dtype=torch.bfloat16, weights=mode)
    warm.allocate_cache(1, 16)
    warm(torch.randn(1, 4, model.config.dim, dtype=torch.bfloat16), [0], [0])
    del warm
    gc.collect()
    release_memory()
    before = proc_status()
    reader = TensorReader()
    t0 = time.perf_counter()
    stage = load_stage(model, start, end, dtype=torch.bfloat16, reader=reader, weights=mode)
    load_s = time.perf_counter() - t0
    reader.close()
    gc.collect()
    release_memory()
    loaded = proc_status()
    stage.allocate_cache(1, ctx)
    cached = proc_status()
    held = sum(p.nbytes for p in stage.parameters())
    x = torch.randint(0, 1000, (1, chunk)) if first else torch.randn(1, chunk, model.config.dim, dtype=torch.bfloat16)
    reset_peak()
    base = proc_status()["VmRSS"]
    stage(x, [0], [0])
    for i in range(4):
        stage(x[:, :1], [0], [chunk + i])
    peak = proc_status()["VmHWM"]
    resident = loaded["VmRSS"] - before["VmRSS"]
    return {
        "file": Path(path).name,
        "mode": mode,
        "blocks": [start, end],
        "first": first,
        "last": last,
        "gguf_bytes": gguf_bytes,
        "resident": resident,
        "ratio": round(resident / gguf_bytes, 3),
        "held_by_tensors": held,
        "planned_weights": planned.weight_bytes,
        "kv_planned": planned.kv_bytes,
        "kv_resident": cached["VmRSS"] - loaded["VmRSS"],
        "planned_total": planned.total_bytes,
        "measured_total": peak - before["VmRSS"],
        "workspace_planned": planned.workspace_bytes,
        "workspace_peak": peak - base,
        "formats": planned.formats,
        "load_s": round(load_s, 1),
    }


def cmd_memory(args) -> None:
    rows = []
    for kind in args.types.split(","):
        path = MODELS / f"rand-1b-{kind}.gguf"
        for mode in args.modes.split(","):
            for name in args.stages.split(","):
                start, end = STAGES[name]
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "_measure",
                        str(path),
                        mode,
                        str(start),
                        str(end),
                        str(args.ctx),
                        str(args.chunk),
                        str(args.threads),
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                row = json.loads(out.strip().splitlines()[-1])
                rows.append(row)
                mib = lambda n: f"{n / 2**20:8.1f}"  # noqa: E731
                print(
                    f"{kind:7} {mode:8} {name:6} gguf {mib(row['gguf_bytes'])} MiB  "
                    f"resident {mib(row['resident'])} MiB = {row['ratio']:.3f}x  "
                    f"| plan weights {mib(row['planned_weights'])}  held {mib(row['held_by_tensors'])}"
                    f"  | plan total {mib(row['planned_total'])}  measured peak {mib(row['measured_total'])} "
                    f"({row['measured_total'] / row['planned_total'] - 1:+.1%})  | {row['formats']}",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def decode_tps(stage, steps: int, start: int) -> float:
    import torch

    x = torch.tensor([[1]])
    t0 = time.perf_counter()
    for i in range(steps):
        stage(x, [0], [start + i])
    return steps / (time.perf_counter() - t0)


def cmd_speed(args) -> None:
    import torch

    from shardwire import weights as quant
    from shardwire.formats import open_model
    from shardwire.pipeline.loading import load_stage

    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU kernel int4 layout block "
        f"{quant.cpu_int4_block()}",
        flush=True,
    )
    for kind in args.types.split(","):
        model = open_model(MODELS / f"rand-1b-{kind}.gguf")
        n = model.config.n_layers
        variants = {}
        for label in args.variants.split(","):
            mode, _, override = label.partition(":")
            saved = dict(quant.FAST)
            if override:  # e.g. packed:Q8_0=int8, the requantized per-channel alternative
                t, f = override.split("=")
                quant.FAST[t] = f
            variants[label] = load_stage(model, 0, n, dtype=torch.bfloat16, weights=mode)
            quant.FAST.clear()
            quant.FAST.update(saved)
            variants[label].allocate_cache(1, args.steps * args.rounds + 64)
        prompt = torch.randint(0, 1000, (1, 32))
        for stage in variants.values():
            stage(prompt, [0], [0])
            decode_tps(stage, 2, 32)  # warm up
        results = {k: [] for k in variants}
        labels = list(variants)
        for r in range(args.rounds):
            order = labels if r % 2 == 0 else labels[::-1]
            for label in order:
                results[label].append(decode_tps(variants[label], args.steps, 40))
        line = ", ".join(
            f"{k}: median {statistics.median(v):.2f} tok/s (min {min(v):.2f}, max {max(v):.2f})"
            for k, v in results.items()
        )
        base = statistics.median(results[labels[-1]])
        ratios = ", ".join(f"{k} {statistics.median(v) / base:.2f}x" for k, v in results.items())
        print(f"{kind}: {line}\n    relative to {labels[-1]}: {ratios}", flush=True)
        del variants
        gc.collect()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_measure":
        path, mode, start, end, ctx, chunk, threads = sys.argv[2:9]
        print(json.dumps(measure(path, mode, int(start), int(end), int(ctx), int(chunk), int(threads))))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("memory")
    m.add_argument("--types", default="Q4_0,Q4_K_M,Q8_0")
    m.add_argument("--modes", default="packed,dequant")
    m.add_argument("--stages", default="first,middle,last")
    m.add_argument("--ctx", type=int, default=2048)
    m.add_argument("--chunk", type=int, default=256)
    m.add_argument("--threads", type=int, default=2)
    m.add_argument("--json", default=None)
    s = sub.add_parser("speed")
    s.add_argument("--types", default="Q4_0,Q4_K_M,Q8_0")
    s.add_argument(
        "--variants",
        default="packed,dequant",
        help="weights modes, the last one the baseline; mode:TYPE=FORMAT overrides a packed format",
    )
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--rounds", type=int, default=5)
    s.add_argument("--steps", type=int, default=16)
    args = p.parse_args()
    {"memory": cmd_memory, "speed": cmd_speed}[args.cmd](args)


if __name__ == "__main__":
    main()
