"""A worker's process memory while it holds a model, beside llama.cpp's rpc-server on the same file.

    python benchmarks/memory.py [--workloads moe-q4_0,1b-q4_0,...] [--no-llama-cpp] [--streamed]

For each file and system: one worker (shardwire worker / ggml-rpc-server), idle first; then a
server as a user runs it (shardwire serve --rpc / llama-server --rpc -ngl 99) loads every block
onto it and answers one 32-token completion (one sequence slot of 2048 tokens). From the
worker's /proc/PID/status: idle (settled, before the server), peak (VmHWM) and at rest (a second
after the completion, the model loaded), as growth over idle, split into anonymous and
file-backed memory, and as a ratio to the file bytes of the tensors the worker holds (llama.cpp's
server keeps the token embedding itself; shardwire's worker holds it). Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from run import LISTENING, Server, free_port, machine_info  # noqa: E402

import models  # noqa: E402

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


def settled(pid: int, timeout: float = 60) -> dict[str, int]:
    """The process's status once its resident size stops moving (start-up work done)."""
    before, deadline = status(pid), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = status(pid)
        if abs(now.get("VmRSS", 0) - before.get("VmRSS", 0)) < 1 << 20:
            return now
        before = now
    return before


def _complete(port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    """Wait for the server's /health, then one greedy 32-token completion."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not load the model in time")
        time.sleep(0.2)
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as r:
        json.loads(r.read())


def measure(system: str, path: Path, prefix: Path | None, workdir: Path, threads: int, own_copy: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    log = workdir / f"{system}-{path.stem}.log"
    port = free_port()
    if system == "shardwire":
        cmd = [sys.executable, "-m", "shardwire", "--log-level", "warning", "worker", "--host", "127.0.0.1"]
        cmd += ["--port", "0", "--device", "cpu", "--threads", str(threads), "--cache-dir", str(workdir / "cache")]
        if own_copy:
            cmd += ["--model-dir", str(path.parent)]
        worker = Server("shardwire-worker", cmd, "1", env, log)
        address = "127.0.0.1:" + worker.wait_for(LISTENING, 120)[2]
        server = [sys.executable, "-m", "shardwire", "serve", str(path), "--rpc", address, "--port", str(port)]
        server += ["-c", "2048", "-np", "1", "--cache-dir", str(workdir / "coord")]
    else:
        rpc_port = free_port()
        cmd = [str(prefix / "bin" / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(rpc_port), "-t", str(threads)]
        worker = Server("llama.cpp-rpc", cmd, "1", env, log)
        worker.wait_port(rpc_port, 30)
        server = [str(prefix / "bin" / "llama-server"), "-m", str(path), "--rpc", f"127.0.0.1:{rpc_port}"]
        server += ["-ngl", "99", "--port", str(port), "-t", str(threads), "-c", "2048", "-np", "1"]
    started = time.monotonic()
    try:
        idle = settled(worker.proc.pid)
        with open(log, "a") as out:
            proc = subprocess.Popen(["taskset", "-c", "0", *server], stdout=out, stderr=out, env=env)
            try:
                _complete(port, proc)
                time.sleep(1.0)
                rest = status(worker.proc.pid)
            finally:
                proc.terminate()
                proc.wait(30)
    finally:
        worker.stop()
    held = held_bytes(path, system)
    return {
        "system": system,
        "file": path.name,
        "held_bytes": held,
        "idle": idle,
        "rest": rest,
        "peak_growth": rest["VmHWM"] - idle["VmRSS"],
        "rest_growth": rest["VmRSS"] - idle["VmRSS"],
        "rest_anon_growth": rest["RssAnon"] - idle["RssAnon"],
        "rest_file_growth": rest["RssFile"] - idle["RssFile"],
        "seconds": round(time.monotonic() - started, 1),
    }


def mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| file | system | held MiB | idle MiB | peak growth MiB (x held) | at rest growth MiB (x held) | "
        "at rest anon / file MiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        held = r["held_bytes"]
        lines.append(
            f"| {r['file']} | {r['system']} | {mib(held)} | {mib(r['idle']['VmRSS'])} | "
            f"{mib(r['peak_growth'])} ({r['peak_growth'] / held:.2f}x) | "
            f"{mib(r['rest_growth'])} ({r['rest_growth'] / held:.2f}x) | "
            f"{mib(r['rest_anon_growth'])} / {mib(r['rest_file_growth'])} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="moe-q4_0,moe-q8_0", help=f"of {', '.join(models.WORKLOADS)}")
    p.add_argument("--no-llama-cpp", action="store_true", help="shardwire only")
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument(
        "--streamed",
        action="store_true",
        help="shardwire's worker gets the weights from the coordinator into its cache (default: it reads "
        "its own copy of the file, as llama.cpp's rpc-server -c reads its cache)",
    )
    p.add_argument("--out", default=None, help="JSON results (default: a temporary folder)")
    args = p.parse_args()
    prefix = None if args.no_llama_cpp else models.llama_cpp_prefix()
    systems = ["shardwire"] + (["llama.cpp"] if prefix is not None else [])
    rows = []
    with tempfile.TemporaryDirectory(prefix="shardwire-memory-") as tmp:
        for name in [w for w in args.workloads.split(",") if w]:
            path = models.ensure(models.WORKLOADS[name], prefix)
            for system in systems:
                rows.append(measure(system, path, prefix, Path(tmp), args.threads, not args.streamed))
                print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    cpu = machine_info().get("cpu", "?")
    source = "weights streamed into its cache" if args.streamed else "its own copy of the file"
    print(f"{cpu}, 1 worker holding every block ({source}), {args.threads} thread(s)\n")
    print(table(rows))
    out = Path(args.out) if args.out else Path(tempfile.gettempdir()) / "shardwire-memory.json"
    out.write_text(json.dumps({"machine": machine_info(), "rows": rows}, indent=2))
    print(f"\nwritten: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
