"""A worker's process memory while it holds a model, beside llama.cpp's rpc-server on the same file.

    python benchmarks/memory.py [--workloads moe-q4_0,1b-q4_0,...] [--no-llama-cpp]

For each file and system: one worker (shardwire worker / ggml-rpc-server), idle first; then a
coordinator (shardwire bench --rpc / llama-bench --rpc -ngl 99) loads every block onto it and
runs a short prompt and decode. The worker's /proc/PID/status is sampled every 20 ms: idle
(before the coordinator), peak (VmHWM), and steady (the last sample while the coordinator still
runs, its decode), as growth over idle, split into anonymous and file-backed memory, and as a
ratio to the file bytes of the tensors the worker holds (llama.cpp's coordinator keeps the token
embedding itself; shardwire's worker holds it). Prints a table and writes JSON beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import models  # noqa: E402
from run import LISTENING, Server, free_port, machine_info  # noqa: E402

FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in FIELDS:
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def held_bytes(path: Path, system: str) -> int:
    from shardwire.formats import open_model

    tensors = open_model(path).tensors
    return sum(t.nbytes for n, t in tensors.items() if system == "shardwire" or n != "token_embd.weight")


def measure(system: str, path: Path, prefix: Path | None, workdir: Path, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    log = workdir / f"{system}-{path.stem}.log"
    if system == "shardwire":
        cmd = [sys.executable, "-m", "shardwire", "--log-level", "warning", "worker", "--host", "127.0.0.1"]
        cmd += ["--port", "0", "--device", "cpu", "--threads", str(threads), "--cache-dir", str(workdir / "cache")]
        worker = Server("shardwire-worker", cmd, "1", env, log)
        address = "127.0.0.1:" + worker.wait_for(LISTENING, 120)[2]
        coordinator = [sys.executable, "-m", "shardwire", "bench", str(path), "--rpc", address]
        coordinator += ["-p", "32", "-n", "32", "-r", "1", "-t", str(threads), "--cache-dir", str(workdir / "coord")]
    else:
        port = free_port()
        cmd = [str(prefix / "bin" / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)]
        worker = Server("llama.cpp-rpc", cmd, "1", env, log)
        worker.wait_port(port, 30)
        coordinator = [str(prefix / "bin" / "llama-bench"), "-m", str(path), "--rpc", f"127.0.0.1:{port}"]
        coordinator += ["-ngl", "99", "-p", "32", "-n", "32", "-r", "1", "-t", str(threads)]
    try:
        time.sleep(1.0)
        idle = status(worker.proc.pid)
        started = time.monotonic()
        with open(log, "a") as out:
            proc = subprocess.Popen(["taskset", "-c", "0", *coordinator], stdout=out, stderr=out, env=env)
            last = idle
            while proc.poll() is None:
                sample = status(worker.proc.pid)
                if sample:
                    last = sample
                time.sleep(0.02)
        if proc.returncode != 0:
            raise RuntimeError(f"{system} coordinator failed ({proc.returncode}); see {log}")
        peak = status(worker.proc.pid).get("VmHWM", 0)
    finally:
        worker.stop()
    held = held_bytes(path, system)
    return {
        "system": system,
        "file": path.name,
        "held_bytes": held,
        "idle": idle,
        "steady": last,
        "peak_growth": peak - idle["VmRSS"],
        "steady_growth": last["VmRSS"] - idle["VmRSS"],
        "steady_anon_growth": last["RssAnon"] - idle["RssAnon"],
        "steady_file_growth": last["RssFile"] - idle["RssFile"],
        "seconds": round(time.monotonic() - started, 1),
    }


def mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| file | system | held MiB | idle MiB | peak growth MiB (x held) | steady growth MiB (x held) | "
        "steady anon / file MiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        held = r["held_bytes"]
        lines.append(
            f"| {r['file']} | {r['system']} | {mib(held)} | {mib(r['idle']['VmRSS'])} | "
            f"{mib(r['peak_growth'])} ({r['peak_growth'] / held:.2f}x) | "
            f"{mib(r['steady_growth'])} ({r['steady_growth'] / held:.2f}x) | "
            f"{mib(r['steady_anon_growth'])} / {mib(r['steady_file_growth'])} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="moe-q4_0,moe-q8_0", help=f"of {', '.join(models.WORKLOADS)}")
    p.add_argument("--no-llama-cpp", action="store_true", help="shardwire only")
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="JSON results (default: a temporary folder)")
    args = p.parse_args()
    prefix = None if args.no_llama_cpp else models.llama_cpp_prefix()
    systems = ["shardwire"] + (["llama.cpp"] if prefix is not None else [])
    rows = []
    with tempfile.TemporaryDirectory(prefix="shardwire-memory-") as tmp:
        for name in [w for w in args.workloads.split(",") if w]:
            path = models.ensure(models.WORKLOADS[name], prefix)
            for system in systems:
                rows.append(measure(system, path, prefix, Path(tmp), args.threads))
                print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    cpu = machine_info().get("cpu", "?")
    print(f"{cpu}, 1 worker holding every block, {args.threads} thread(s)\n")
    print(table(rows))
    out = Path(args.out) if args.out else Path(tempfile.gettempdir()) / "shardwire-memory.json"
    out.write_text(json.dumps({"machine": machine_info(), "rows": rows}, indent=2))
    print(f"\nwritten: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
