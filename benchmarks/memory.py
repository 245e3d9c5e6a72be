"""Workers' process memory while they hold a model, beside llama.cpp's rpc-server on the same file.

    python -m benchmarks.memory [--workloads moe-q4_0,1b-q4_0,...] [--workers 1,2] [--no-llama-cpp]
                                [--ctx 1024] [--swa-full]

For each file, worker count and system: the workers (shardwire worker / ggml-rpc-server), idle
first; then a server as a user runs it (shardwire serve --rpc / llama-server --rpc -ngl 99 -ts
1,1,...) loads the blocks onto them and answers one 32-token completion of a prompt longer than a
prefill chunk, in one sequence slot whose context (--ctx tokens) the prompt and reply nearly fill,
so that the KV cache each system sizes for that context is in use. From each worker's
/proc/PID/status: idle (settled, before the server), peak (VmHWM) and at rest (a second after the
completion, the model loaded), as growth over idle, split into anonymous and file-backed memory,
and as a ratio to the file bytes of the tensors it holds (llama.cpp's server keeps the token
embedding itself; shardwire's first worker holds it); the KV cache each system says the worker
holds (shardwire's plan; llama-server's log) and the growth at rest less it, which a longer or
shorter context does not change; beside shardwire's, what its plan said that worker needs, and
the server's own memory. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from . import models
from .run import LISTENING, Server, free_port, machine_info, private_state_dir, wait_healthy

CTX = 1024  # each system's one sequence slot (--ctx); the completion below fills ~97% of it


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


def held_bytes(path: Path, system: str, n_workers: int) -> list[int]:
    """File bytes of the tensors each worker holds: blocks split evenly in order (both systems'
    split for equal devices), the head on the last; the embedding on shardwire's first worker
    (llama.cpp's server keeps it)."""
    from shardwire.formats import open_model
    from shardwire.pipeline.plan import split_blocks_evenly

    model = open_model(path)
    counts, start, out = split_blocks_evenly(model.config.n_layers, [1.0] * n_workers), 0, []
    for i, count in enumerate(counts):
        first, last = i == 0, i == n_workers - 1
        names = model.stage_tensors(start, start + count, first and system == "shardwire", last)
        out.append(sum(t.nbytes for t in names.values()))
        start += count
    return out


def planned_bytes(
    path: Path, addresses: list[str], workdir: Path, ctx: int, swa_full: bool
) -> tuple[list[int], list[int]]:
    """What shardwire's plan says each worker's stage needs (weights, KV cache, workspace), and
    its KV cache alone (the pool at its most, which a completion filling the slot reaches)."""
    from shardwire.coordinator import Cluster
    from shardwire.formats import open_model

    model = open_model(path)
    cluster = Cluster(addresses, cache_dir=workdir / "plan", show_progress=False)
    try:
        cluster.connect(model)
        split = [1.0] * len(addresses)
        plan = cluster.make_plan(n_slots=1, ctx=ctx, weights="auto", tensor_split=split, swa_full=swa_full)
        return [s.total_bytes + sum(s.elsewhere.values()) for s in plan.stages], [s.kv_bytes for s in plan.stages]
    finally:
        cluster.close()


def llama_kv_cache_bytes(log: Path, addresses: list[str]) -> list[int]:
    """The KV buffers llama-server put on each rpc-server, as its log says (a sliding-window
    model's two caches each say theirs)."""
    sizes = [0] * len(addresses)
    for line in log.read_text(errors="replace").splitlines():
        found = re.search(r"(\S+) KV buffer size = +([\d.]+) MiB", line)
        for i, address in enumerate(addresses):
            if found and f"[{address}]" in found.group(1):
                sizes[i] += round(float(found.group(2)) * 2**20)
    return sizes


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


def _complete(port: int, proc: subprocess.Popen, ctx: int, timeout: float = 600) -> None:
    """Wait for the server's /health, then one greedy 32-token completion of a prompt longer than
    a prefill chunk (so the workspace a chunk needs is used) that, with it, nearly fills `ctx`."""
    wait_healthy(port, proc, timeout)
    prompt = "Once upon a time, in a small town beside a wide river, there lived a clockmaker. " * (48 * ctx // 1024)
    body = json.dumps({"prompt": prompt, "max_tokens": 32, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as r:
        json.loads(r.read())


def measure(
    system: str,
    path: Path,
    prefix: Path | None,
    workdir: Path,
    threads: int,
    own_copy: bool,
    n_workers: int,
    ctx: int = CTX,
    swa_full: bool = False,
) -> list[dict]:
    """One row per worker, each with the server's (the coordinator's) own memory."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    log = workdir / f"{system}-{path.stem}-{n_workers}.log"
    port, workers, addresses = free_port(), [], []
    try:
        for i in range(n_workers):
            core = str(1 + i % max(1, (os.cpu_count() or 2) - 1))
            if system == "shardwire":
                cmd = [sys.executable, "-m", "shardwire", "--log-level", "warning", "worker", "--host", "127.0.0.1"]
                cmd += ["--port", "0", "--device", "cpu", "--threads", str(threads)]
                cmd += ["--cache-dir", str(workdir / f"cache{i}")]
                if own_copy:
                    cmd += ["--model-dir", str(path.parent)]
                workers.append(Server(f"shardwire-worker-{i}", cmd, core, env, log))
                addresses.append("127.0.0.1:" + workers[-1].wait_for(LISTENING, 120)[2])
            else:
                rpc_port = free_port()
                cmd = [str(prefix / "bin" / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(rpc_port)]
                workers.append(Server(f"llama.cpp-rpc-{i}", cmd + ["-t", str(threads)], core, env, log))
                workers[-1].wait_port(rpc_port, 30)
                addresses.append(f"127.0.0.1:{rpc_port}")
        split = ",".join(["1"] * n_workers)
        if system == "shardwire":
            server = [sys.executable, "-m", "shardwire", "serve", str(path), "--rpc", ",".join(addresses)]
            server += [
                "--port",
                str(port),
                "-c",
                str(ctx),
                "-np",
                "1",
                "-ts",
                split,
                "--cache-dir",
                str(workdir / "coord"),
            ]
        else:
            server = [str(prefix / "bin" / "llama-server"), "-m", str(path), "--rpc", ",".join(addresses)]
            server += ["-ngl", "99", "-ts", split, "--port", str(port), "-t", str(threads), "-c", str(ctx), "-np", "1"]
            server += ["-lv", "4"]  # it logs its KV buffers' sizes (llama_kv_cache_bytes) at this level
        server += ["--swa-full"] if swa_full else []  # both servers' flag
        idle = [settled(w.proc.pid) for w in workers]
        if system == "shardwire":
            planned, kv = planned_bytes(path, addresses, workdir, ctx, swa_full)
        else:
            planned = [None] * n_workers
        started = time.monotonic()
        with open(log, "a") as out:
            proc = subprocess.Popen(["taskset", "-c", "0", *server], stdout=out, stderr=out, env=env)
            try:
                _complete(port, proc, ctx)
                loaded_s = time.monotonic() - started
                time.sleep(1.0)
                rest = [status(w.proc.pid) for w in workers]
                coordinator = status(proc.pid)
            finally:
                proc.terminate()
                proc.wait(30)
    finally:
        for w in workers:
            w.stop()
    if system != "shardwire":
        kv = llama_kv_cache_bytes(log, addresses)
    held = held_bytes(path, system, n_workers)
    return [
        {
            "system": system,
            "file": path.name,
            "workers": n_workers,
            "worker": i,
            "held_bytes": held[i],
            "planned_bytes": planned[i],
            "idle": idle[i],
            "rest": rest[i],
            "peak_growth": rest[i]["VmHWM"] - idle[i]["VmRSS"],
            "rest_growth": rest[i]["VmRSS"] - idle[i]["VmRSS"],
            "rest_anon_growth": rest[i]["RssAnon"] - idle[i]["RssAnon"],
            "rest_file_growth": rest[i]["RssFile"] - idle[i]["RssFile"],
            "kv_bytes": kv[i],
            "coordinator": coordinator,
            "ready_and_answered_s": round(loaded_s, 1),
        }
        for i in range(n_workers)
    ]


ONE_PROCESS = """
import json, sys, time
from shardwire.coordinator.launch import local_pipeline
from shardwire.weights.policy import default_dtype
from shardwire.engine import Engine, Request
from shardwire.formats import open_model
from shardwire.sampling import GREEDY

def status():
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out

model = open_model(sys.argv[1])
idle = status()
start = time.monotonic()
pipeline = local_pipeline(model, "cpu", default_dtype("cpu"), "auto", 1, CTX_TOKENS, swa_full=SWA_FULL)
loaded_s = time.monotonic() - start
engine = Engine(pipeline)
handle = engine.submit(Request(list(range(10, PROMPT_END)), GREEDY, max_tokens=32))
handle.result()
time.sleep(1.0)
print(json.dumps({"idle": idle, "rest": status(), "load_s": loaded_s}))
engine.close()
"""


def one_process(path: Path, threads: int, ctx: int = CTX, swa_full: bool = False) -> dict:
    """`generate`/`serve`/`bench` without workers: the model loaded in the process itself, a
    prompt and 32 tokens decoded that nearly fill its `ctx`-token context."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    script = ONE_PROCESS.replace("CTX_TOKENS", str(ctx)).replace("PROMPT_END", str(10 + ctx - 48))
    script = script.replace("SWA_FULL", str(swa_full))
    out = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", script, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
        check=True,
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    from shardwire.formats import open_model

    held = sum(t.nbytes for t in open_model(path).tensors.values())
    return {
        "file": path.name,
        "held_bytes": held,
        "peak_growth": r["rest"]["VmHWM"] - r["idle"]["VmRSS"],
        "rest_growth": r["rest"]["VmRSS"] - r["idle"]["VmRSS"],
        "load_s": round(r["load_s"], 1),
    }


def mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| file | system | workers | worker | held MiB | peak growth MiB (x held) | at rest growth MiB (x held) | "
        "at rest anon / file MiB | KV cache MiB | at rest less KV MiB (x held) | plan MiB (x peak growth) | "
        "coordinator peak / at rest MiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        held, planned = r["held_bytes"], r["planned_bytes"]
        plan = f"{mib(planned)} ({planned / r['peak_growth']:.2f}x)" if planned else "–"
        less_kv = r["rest_growth"] - r["kv_bytes"]
        lines.append(
            f"| {r['file']} | {r['system']} | {r['workers']} | {r['worker']} | {mib(held)} | "
            f"{mib(r['peak_growth'])} ({r['peak_growth'] / held:.2f}x) | "
            f"{mib(r['rest_growth'])} ({r['rest_growth'] / held:.2f}x) | "
            f"{mib(r['rest_anon_growth'])} / {mib(r['rest_file_growth'])} | {r['kv_bytes'] / 2**20:.1f} | "
            f"{mib(less_kv)} ({less_kv / held:.2f}x) | {plan} | "
            f"{mib(r['coordinator']['VmHWM'])} / {mib(r['coordinator']['VmRSS'])} |"
        )
    return "\n".join(lines)


def main() -> int:
    private_state_dir()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="moe-q4_0,moe-q8_0", help=f"of {', '.join(models.WORKLOADS)}")
    p.add_argument("--no-llama-cpp", action="store_true", help="shardwire only")
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("--workers", default="1,2", help="worker counts (default: %(default)s)")
    p.add_argument("--no-one-process", dest="one_process", action="store_false", help="skip the one-process runs")
    p.add_argument(
        "--streamed",
        action="store_true",
        help="shardwire's worker gets the weights from the coordinator into its cache (default: it reads "
        "its own copy of the file, as llama.cpp's rpc-server -c reads its cache)",
    )
    p.add_argument("--ctx", type=int, default=CTX, help="the one sequence slot's context (default: %(default)s)")
    p.add_argument(
        "--swa-full",
        action="store_true",
        help="both servers' --swa-full: blocks on a sliding window keep every position (default: their window's)",
    )
    p.add_argument("--out", default=None, help="JSON results (default: a temporary folder)")
    args = p.parse_args()
    prefix = None if args.no_llama_cpp else models.llama_cpp_prefix()
    systems = ["shardwire"] + (["llama.cpp"] if prefix is not None else [])
    rows, alone = [], []
    with tempfile.TemporaryDirectory(prefix="shardwire-memory-") as tmp:
        for name in [w for w in args.workloads.split(",") if w]:
            path = models.ensure(models.WORKLOADS[name], prefix)
            for n in [int(k) for k in args.workers.split(",") if k]:
                for system in systems:
                    got = measure(
                        system, path, prefix, Path(tmp), args.threads, not args.streamed, n, args.ctx, args.swa_full
                    )
                    rows += got
                    print("\n".join(table(got).splitlines()[2:]), file=sys.stderr, flush=True)
            if args.one_process:
                alone.append(one_process(path, args.threads, args.ctx, args.swa_full))
    cpu = machine_info().get("cpu", "?")
    source = "weights streamed into its cache" if args.streamed else "its own copy of the file"
    kept = "every position (--swa-full)" if args.swa_full else "their window's"
    print(f"{cpu}, workers reading {source}, {args.threads} thread(s), one {args.ctx}-token slot, ", end="")
    print(f"sliding-window blocks keeping {kept}\n")
    print(table(rows))
    if alone:
        print(f"\nshardwire in one process (no workers), {args.ctx - 48}-token prompt, 32 tokens:\n")
        print("| file | file MiB | peak growth MiB (x file) | at rest growth MiB (x file) | load s |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for r in alone:
            held = r["held_bytes"]
            print(
                f"| {r['file']} | {mib(held)} | {mib(r['peak_growth'])} ({r['peak_growth'] / held:.2f}x) | "
                f"{mib(r['rest_growth'])} ({r['rest_growth'] / held:.2f}x) | {r['load_s']} |"
            )
    out = Path(args.out) if args.out else Path(tempfile.gettempdir()) / "shardwire-memory.json"
    out.write_text(json.dumps({"machine": machine_info(), "rows": rows, "one_process": alone}, indent=2))
    print(f"\nwritten: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
