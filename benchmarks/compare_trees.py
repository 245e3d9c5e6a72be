"""Prompt and decode speed of this checkout beside another one (say, main before a change), on
the same model files and the same machine, interleaved A B B A so drift hits both alike.

    git worktree add /tmp/before HEAD~3
    python -m benchmarks.compare_trees /tmp/before model.gguf [more.gguf ...] --workers 2 -p 64 -n 32 [--streams 8]

Each round starts `--workers` worker processes from one tree (one thread each, pinned as run.py
pins them), runs that tree's `shardwire bench` over them, and stops them; with
`--workers 0` the bench runs the model in one process. Prints tokens/s per tree and the ratio
this / other for each model and test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from . import run

HERE = Path(__file__).resolve().parents[1]


def bench(tree: Path, model: Path, args, log: Path) -> dict[str, float]:
    workers = run.start_tree_workers(tree, args.workers, log)
    try:
        cmd = [
            sys.executable,
            "-m",
            "shardwire",
            "bench",
            str(model),
            "-p",
            str(args.n_prompt),
            "-n",
            str(args.n_gen),
            "-r",
            str(args.reps),
            "-t",
            "1",
            "-o",
            "json",
        ]
        if workers:
            cmd += ["--rpc", ",".join(w.address for w in workers)]
        if args.streams:
            cmd += ["--streams", str(args.streams)]
        env = run.tree_env(tree)
        out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=args.timeout)
        if out.returncode != 0:
            raise RuntimeError(f"bench in {tree} failed:\n{out.stderr[-2000:]}")
        return {t["test"]: t["avg_ts"] for t in json.loads(out.stdout)["tests"]}
    finally:
        for worker in workers:
            worker.stop()


def main() -> int:
    run.private_state_dir()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("other", type=Path, help="the other checkout (a git worktree)")
    p.add_argument("models", type=Path, nargs="+", help="GGUF files")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("-p", "--n-prompt", type=int, default=64)
    p.add_argument("-n", "--n-gen", type=int, default=32)
    p.add_argument("-r", "--reps", type=int, default=2, help="runs of each test inside one bench")
    p.add_argument("--streams", type=int, default=0, help="also decode -n tokens in this many concurrent sequences")
    p.add_argument("--rounds", type=int, default=2, help="A B B A rounds")
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args()
    trees = {"this": HERE, "other": args.other.resolve()}
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"CPU: {cpu}; {args.workers} worker(s), 1 thread each; this = {trees['this']}, other = {trees['other']}")
    log = Path(tempfile.mkdtemp(prefix="shardwire-compare-")) / "workers.log"
    print(f"workers' output: {log}")
    for model in args.models:
        runs: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
        for r in range(args.rounds):
            for name in ("this", "other") if r % 2 == 0 else ("other", "this"):
                for test, tps in bench(trees[name], model, args, log).items():
                    runs[name].setdefault(test, []).append(tps)
        print(f"\n{model.name}")
        print(f"{'test':<8} {'this tok/s':>12} {'other tok/s':>12} {'this/other':>11}  runs")
        for test in runs["this"]:
            a, b = runs["this"][test], runs["other"][test]
            print(
                f"{test:<8} {statistics.mean(a):>12.2f} {statistics.mean(b):>12.2f} "
                f"{statistics.mean(a) / statistics.mean(b):>10.3f}x  "
                f"{' '.join(f'{x:.1f}' for x in a)} | {' '.join(f'{x:.1f}' for x in b)}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
