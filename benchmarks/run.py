"""Side-by-side benchmark: llama.cpp RPC against shardwire, same work, same machine, one run.

    python -m benchmarks.run --quick          # a few minutes
    python -m benchmarks.run                  # the full matrix (bounded by --time-limit)
    python -m benchmarks.run --shardwire-only # no llama.cpp build needed

For every cell (a model file, a number of workers, a link) both systems run the same test,
interleaved A B B A ...:
  llama.cpp  ggml-rpc-server workers + llama-bench --rpc as the coordinator
  shardwire  `shardwire worker` processes + `shardwire bench --rpc` as the coordinator
with the same threads per process, each process pinned to the same core (taskset), the same
GGUF file and the same prompt and generation lengths. Cells without workers are each system's
single-process baseline (llama-bench alone; shardwire bench alone).

Links: "direct" connects straight to the workers on loopback. Otherwise every worker sits
behind its own relay (benchmarks/relay.py, in this process) that adds the one-way delay and a
1 Gbit/s cap and counts bytes. The coordinator is given the relays' addresses, and shardwire's
coordinator gives a worker the next worker's address from that same list, so worker-to-worker
traffic crosses a relay too: every pair of processes talks through an emulated link, for
both systems alike. Shaping is switched on once a coordinator reports its model loaded
(weight transfer is not what is measured) and off when it exits.

Figures per cell and system: prompt tokens/s (ppP), decode tokens/s (tgN), time to first
token (the ppP run: a P-token prompt until its first sampled token), bytes per decode step on
the wire (relay counters over the tgN runs), peak memory per process (the coordinator's
ru_maxrss from wait4, each worker's VmHWM), ratios shardwire / llama.cpp, and each system's
distributed efficiency. Results go to benchmarks/results/<name>/ as results.json, results.md
and results.png (benchmarks/report.py renders the last two from the first).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import models, report
from .relay import Relay, Shaping

HERE = Path(__file__).resolve().parent


GBIT = 1e9 / 8


def private_state_dir() -> None:
    """The workers' certificate and the coordinators' known hosts for this run only: benchmark
    ports come and go, and would fill the user's known_hosts with stale pins."""
    import tempfile

    from shardwire.state import STATE_ENV

    os.environ.setdefault(STATE_ENV, tempfile.mkdtemp(prefix="shardwire-bench-state-"))


PROGRESS = re.compile(r"benchmark (\d+)/(\d+): (warmup )?(prompt|generation) run(?: (\d+)/(\d+))?")
LISTENING = re.compile(r"listening on (\S+):(\d+)")


# ---------------------------------------------------------------------------------------------
# The matrix


@dataclass(frozen=True)
class Cell:
    workload: str
    workers: int  # 0: the single-process baseline
    # "local" (no workers), "direct", a one-way delay in ms through relays ("0", "0.2", "1"), or
    # "sweep": through relays, the delay switched at every decode run (args.sweep), so the
    # delays are compared seconds apart inside one invocation rather than minutes apart
    link: str
    n_prompt: int
    n_gen: int
    streams: int = 0  # shardwire only: also decode with this many concurrent sequences

    @property
    def key(self) -> str:
        return f"{self.workload}/w{self.workers}/{self.link}"

    @property
    def delay_ms(self) -> float | None:
        if self.link == "sweep":
            return 0.0
        return None if self.link in ("local", "direct") else float(self.link)


def plan_cells(args) -> list[list[Cell]]:
    """Groups of cells that share one set of workers (a model and a worker count), in the
    order they run: the ones the targets need first, so a time limit cuts the least important.
    Within a group the links alternate too, so a drift in the machine's load hits them alike."""
    groups = []
    for w in args.workloads:
        big = not w.startswith("small")
        p = args.n_prompt_big if big else args.n_prompt
        n = args.n_gen_big if big else args.n_gen
        streams = args.streams if (not big or args.streams_big) else 0
        workers = args.workers_big if big else args.workers
        delays_for = args.delay_workers_big if big else args.delay_workers
        groups.append([Cell(w, 0, "local", p, n)])
        for k in sorted(workers, key=lambda k: (k != 2, k)):
            links = ["direct"] + (args.links + (["sweep"] if args.sweep else []) if k in delays_for else [])
            groups.append(
                [
                    Cell(w, k, link, 0 if link == "sweep" else p, n, streams if k == 2 and link == "direct" else 0)
                    for link in links
                ]
            )
    return groups


# ---------------------------------------------------------------------------------------------
# Processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_env(tree: Path) -> dict:
    """The environment that runs `tree`'s shardwire (another checkout, e.g. main before a change)."""
    return dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def start_tree_workers(tree: Path, n: int, log: Path) -> list["Server"]:
    """`n` workers from `tree`'s code (run from inside it, so its own package is the one
    imported), one thread each, pinned as cores_for() pins them; if one fails to start, the others
    are stopped."""
    _, cores = cores_for(n, 1)
    cmd = [sys.executable, "-m", "shardwire", "worker", "--port", "0", "--device", "cpu", "--threads", "1"]
    workers: list[Server] = []
    try:
        for i in range(n):
            worker = Server(f"worker{i}", cmd, cores[i], tree_env(tree), log, cwd=tree)
            workers.append(worker)
            worker.address = f"127.0.0.1:{worker.wait_for(LISTENING, 120)[2]}"
    except BaseException:
        for worker in workers:
            worker.stop()
        raise
    return workers


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float) -> None:
    """Until a server's GET /health answers 200 (its model is loaded); an error if it exits first."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not load the model in time")
        time.sleep(0.2)


def vm_hwm(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Server:
    """A long-running worker process (ggml-rpc-server or shardwire worker), pinned."""

    def __init__(self, name: str, cmd: list[str], core: str, env: dict, log: Path, cwd: Path | None = None):
        self.name, self.log_path = name, log
        self.proc = subprocess.Popen(
            ["taskset", "-c", core, *cmd],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._line_event = threading.Event()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()
        self.address = ""

    def _drain(self) -> None:
        with open(self.log_path, "a") as log:
            for line in self.proc.stdout:
                self.lines.append(line)
                log.write(line)
                log.flush()
                self._line_event.set()

    def wait_for(self, pattern: re.Pattern, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            while seen < len(self.lines):
                m = pattern.search(self.lines[seen])
                seen += 1
                if m:
                    return m
            if self.proc.poll() is not None:
                break
            self._line_event.wait(0.1)
            self._line_event.clear()
        raise RuntimeError(f"{self.name} did not start:\n" + "".join(self.lines[-30:]))

    def wait_port(self, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not open port {port}:\n" + "".join(self.lines[-30:]))

    @property
    def peak_rss(self) -> int | None:
        return vm_hwm(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@dataclass
class Run:
    """One coordinator invocation."""

    system: str
    cell: str
    rep: int
    ok: bool = False
    error: str | None = None
    wall_s: float = 0.0
    pp_ns: list = field(default_factory=list)  # per prompt run
    tg_ns: list = field(default_factory=list)  # per generation run
    streams_ts: list = field(default_factory=list)
    n_prompt: int = 0
    n_gen: int = 0
    streams: int = 0
    tg_bytes_per_token: float | None = None
    pp_bytes: float | None = None
    relay_bytes_per_token: dict = field(default_factory=dict)  # relay -> {"up":, "down":}
    coordinator_rss: int | None = None
    load_s: float | None = None
    formats: list = field(default_factory=list)  # shardwire: per stage, which kernel holds each stored type
    sweep_delays: list = field(default_factory=list)  # one-way delay (ms) of each generation run, in order


def run_coordinator(
    system: str,
    cmd: list[str],
    core: str,
    env: dict,
    timeout: float,
    relays: dict[str, Relay],
    shaping: Shaping,
    log: Path,
    run: Run,
    sweep: list[float] | None = None,
) -> dict | list | None:
    """Run one coordinator to completion: snapshot the relay counters at each progress line,
    switch shaping on when the model is loaded, collect its JSON and its peak memory."""
    events: list[tuple[str, int, int, dict]] = []  # (kind, benchmark index, rep, counters)

    def snapshot() -> dict:
        return {name: (r.counter.up, r.counter.down) for name, r in relays.items()}

    t0 = time.monotonic()
    loaded_at = [None]
    proc = subprocess.Popen(
        ["taskset", "-c", core, *cmd],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
        start_new_session=True,
    )
    timer = threading.Timer(timeout, lambda: proc.poll() is None and os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    err_lines: list[str] = []

    def read_stderr():
        for line in proc.stderr:
            err_lines.append(line)
            m = PROGRESS.search(line)
            if m or "shardwire-bench: loaded" in line:
                if loaded_at[0] is None:
                    loaded_at[0] = time.monotonic() - t0
                    shaping.enabled = True
            if m and not m[3]:
                if sweep and m[4] == "generation":  # the next decode run goes at the next delay
                    shaping.delay_s = sweep[(int(m[5]) - 1) % len(sweep)] / 1000
                    run.sweep_delays.append(sweep[(int(m[5]) - 1) % len(sweep)])
                events.append((m[4], int(m[1]), int(m[5]), snapshot()))
            elif m:
                events.append(("warmup", int(m[1]), 0, snapshot()))
            elif "shardwire-bench: done" in line:
                events.append(("done", 0, 0, snapshot()))

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    timer.cancel()
    reader.join(10)
    shaping.enabled = False
    events.append(("end", 0, 0, snapshot()))
    run.wall_s = time.monotonic() - t0
    run.load_s = loaded_at[0]
    run.coordinator_rss = usage.ru_maxrss * 1024
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n# rc={proc.returncode} wall={run.wall_s:.1f}s\n{''.join(err_lines)}\n{out}\n")
    if proc.returncode != 0:
        run.error = f"{system} exited with {proc.returncode}: " + "".join(err_lines[-5:]).strip()[-600:]
        return None
    try:
        data = json.loads(out)
    except ValueError:
        run.error = f"{system} printed no JSON"
        return None
    if relays:
        _wire_figures(events, run, relays)
    return data


def _wire_figures(events, run: Run, relays: dict) -> None:
    """Bytes per decode step from the counters taken at each progress line: a generation run's
    bytes are those between its own line and the next line."""
    gen_index = min((e[1] for e in events if e[0] == "generation"), default=None)
    per_relay = {name: [0, 0] for name in relays}
    total, tokens = 0, 0
    pp_total, pp_runs = 0, 0
    for i, (kind, index, rep, snap) in enumerate(events[:-1]):
        nxt = events[i + 1][3]
        if kind == "generation" and index == gen_index:
            for name in relays:
                per_relay[name][0] += nxt[name][0] - snap[name][0]
                per_relay[name][1] += nxt[name][1] - snap[name][1]
            total += sum(nxt[n][0] + nxt[n][1] - snap[n][0] - snap[n][1] for n in relays)
            tokens += run.n_gen
        elif kind == "prompt":
            pp_total += sum(nxt[n][0] + nxt[n][1] - snap[n][0] - snap[n][1] for n in relays)
            pp_runs += 1
    if tokens:
        run.tg_bytes_per_token = total / tokens
        run.relay_bytes_per_token = {n: {"up": v[0] / tokens, "down": v[1] / tokens} for n, v in per_relay.items()}
    if pp_runs:
        run.pp_bytes = pp_total / pp_runs


# ---------------------------------------------------------------------------------------------
# The two systems


class System:
    name = ""

    def __init__(self, args, out: Path):
        self.args, self.out = args, out
        self.servers: list[Server] = []

    def env(self) -> dict:
        t = str(self.args.threads)
        return dict(os.environ, OMP_NUM_THREADS=t, MKL_NUM_THREADS=t, PYTHONUNBUFFERED="1")

    def stop_workers(self) -> dict:
        peaks = {s.name: s.peak_rss for s in self.servers}
        for s in self.servers:
            s.stop()
        self.servers = []
        return peaks


class LlamaCpp(System):
    name = "llama.cpp"

    def __init__(self, args, out, prefix: Path):
        super().__init__(args, out)
        self.prefix = prefix
        self.rpc_cache = models.CACHE / "llama-rpc-cache"

    def env(self) -> dict:
        return dict(super().env(), LLAMA_CACHE=str(self.rpc_cache), LD_LIBRARY_PATH=str(self.prefix / "lib"))

    def start_workers(self, n: int, cores: list[str], log: Path) -> list[str]:
        addresses = []
        for i in range(n):
            port = free_port()
            cmd = [
                str(self.prefix / "bin" / "ggml-rpc-server"),
                "-H",
                "127.0.0.1",
                "-p",
                str(port),
                "-t",
                str(self.args.threads),
            ]
            if self.args.rpc_cache:
                cmd.append("-c")
            s = Server(f"llama.cpp-rpc-{i}", cmd, cores[i], self.env(), log)
            self.servers.append(s)
            s.wait_port(port, 30)
            addresses.append(f"127.0.0.1:{port}")
        return addresses

    def command(self, model: Path, cell: Cell, rpc: list[str], reps: int) -> list[str]:
        cmd = [
            str(self.prefix / "bin" / "llama-bench"),
            "-m",
            str(model),
            "-p",
            str(cell.n_prompt),
            "-n",
            str(cell.n_gen),
            "-r",
            str(reps),
            "-t",
            str(self.args.threads),
            "-ngl",
            "99",
            "-o",
            "json",
            "--progress",
        ]
        if rpc:
            cmd += ["--rpc", ",".join(rpc), "-ts", "/".join(["1"] * len(rpc))]
        return cmd

    @staticmethod
    def parse(data, run: Run) -> None:
        for t in data:
            if t["n_prompt"] > 0 and t["n_gen"] == 0:
                run.pp_ns += t["samples_ns"]
            elif t["n_gen"] > 0 and t["n_prompt"] == 0:
                run.tg_ns += t["samples_ns"]


class Shardwire(System):
    name = "shardwire"

    def __init__(self, args, out):
        super().__init__(args, out)
        self.cache_dir = models.CACHE / "shardwire-cache"

    def start_workers(self, n: int, cores: list[str], log: Path, model: Path) -> list[str]:
        addresses = []
        for i in range(n):
            cmd = [
                sys.executable,
                "-m",
                "shardwire",
                "--log-level",
                "warning",
                "worker",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--device",
                "cpu",
                "--threads",
                str(self.args.threads),
                "--cache-dir",
                str(self.cache_dir),
                "--model-dir",
                str(model.parent),
            ]
            s = Server(f"shardwire-worker-{i}", cmd, cores[i], self.env(), log)
            self.servers.append(s)
            m = s.wait_for(LISTENING, 120)
            addresses.append(f"127.0.0.1:{m[2]}")
        return addresses

    def command(self, model: Path, cell: Cell, rpc: list[str], reps: int) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "shardwire",
            "bench",
            str(model),
            "-p",
            str(cell.n_prompt),
            "-n",
            str(cell.n_gen),
            "-r",
            str(reps),
            "-t",
            str(self.args.threads),
            "-o",
            "json",
            "--progress",
            "--cache-dir",
            str(self.cache_dir),
        ]
        if self.args.dtype:
            cmd += ["--dtype", self.args.dtype]
        if rpc:
            cmd += ["--rpc", ",".join(rpc), "-ts", ",".join(["1"] * len(rpc))]
        if cell.streams > 1:
            cmd += ["--streams", str(cell.streams)]
        return cmd

    @staticmethod
    def parse(data, run: Run) -> None:
        for t in data["tests"]:
            if t["n_prompt"] > 0:
                run.pp_ns += t["samples_ns"]
            elif t.get("streams", 1) > 1:
                run.streams_ts += [t["n_gen"] * t["streams"] / (s / 1e9) for s in t["samples_ns"]]
            else:
                run.tg_ns += t["samples_ns"]


# ---------------------------------------------------------------------------------------------
# Running the matrix


def cores_for(n_workers: int, threads: int) -> tuple[str, list[str]]:
    """(coordinator cores, each worker's cores): the coordinator on the first core(s), worker i
    on the next ones, wrapping around the cores this process may use."""
    cores = sorted(os.sched_getaffinity(0))

    def take(start: int) -> str:
        return ",".join(str(cores[(start + j) % len(cores)]) for j in range(threads))

    return take(0), [take((i + 1) * threads) for i in range(n_workers)]


def run_cell(cells: list[Cell], systems: list[System], model: Path, args, out: Path, deadline: float) -> list[Run]:
    """One group: start each system's workers once (and a relay before each worker when a
    link needs one), then run every cell of the group, alternating systems and links."""
    head = cells[0]
    group_key = f"{head.workload}/w{head.workers}"
    log = out / "logs" / (group_key.replace("/", "_") + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    coord_core, worker_cores = cores_for(head.workers, args.threads)
    runs: list[Run] = []
    direct: dict[str, list[str]] = {}
    relays: dict[str, dict[str, Relay]] = {}
    shaping = Shaping(enabled=False)
    relayed = any(c.delay_ms is not None for c in cells)
    worker_peaks: dict[str, int | None] = {}
    try:
        for system in systems:
            direct[system.name], relays[system.name] = [], {}
            if head.workers:
                if isinstance(system, Shardwire):
                    direct[system.name] = system.start_workers(head.workers, worker_cores, log, model)
                else:
                    direct[system.name] = system.start_workers(head.workers, worker_cores, log)
                if relayed:
                    for i, a in enumerate(direct[system.name]):
                        host, port = a.rsplit(":", 1)
                        relays[system.name][f"worker{i}"] = Relay(
                            (host, int(port)), shaping=shaping, nice=args.relay_nice
                        )
        for alt in range(args.alternations):
            for cell in cells:
                order = systems if alt % 2 == 0 else list(reversed(systems))  # A B, then B A
                # Efficiency compares with the single process: run it right before, in the same
                # group, so both see the same load on a shared machine.
                jobs = [(system, False) for system in order]
                if cell.link == "direct" and args.paired_baseline:
                    jobs = [(system, base) for system in order for base in (True, False)]
                for system, baseline in jobs:
                    key = cell.key + ("-baseline" if baseline else "")
                    run = Run(
                        system.name,
                        key,
                        alt,
                        n_prompt=cell.n_prompt,
                        n_gen=cell.n_gen,
                        streams=cell.streams if isinstance(system, Shardwire) and not baseline else 0,
                    )
                    runs.append(run)
                    remaining = deadline - time.monotonic()
                    if remaining < 10:
                        run.error = "skipped: time limit"
                        continue
                    through = relays[system.name] if cell.delay_ms is not None else {}
                    addresses = [r.address for r in through.values()] if through else direct[system.name]
                    if baseline:
                        addresses = []
                    shaping.delay_s = (cell.delay_ms or 0) / 1000
                    shaping.rate = args.rate_gbit * GBIT if args.rate_gbit else None
                    sweep = args.sweep if cell.link == "sweep" else None
                    run_cell_ = Cell(cell.workload, 0, "local", cell.n_prompt, cell.n_gen) if baseline else cell
                    cmd = system.command(
                        model, run_cell_, addresses, len(sweep) * args.sweep_rounds if sweep else args.reps
                    )
                    data = run_coordinator(
                        system.name,
                        cmd,
                        coord_core,
                        system.env(),
                        min(args.run_timeout, remaining),
                        through,
                        shaping,
                        log,
                        run,
                        sweep,
                    )
                    if data is not None:
                        system.parse(data, run)
                        if isinstance(system, Shardwire):
                            run.load_s = data.get("load_s", run.load_s)
                            run.formats = data.get("formats", run.formats)
                        run.ok = bool(run.pp_ns or run.tg_ns)
                    status = "ok" if run.ok else f"FAILED: {run.error}"
                    tg = f"tg {cell.n_gen / statistics.median(run.tg_ns) * 1e9:7.2f} t/s" if run.tg_ns else ""
                    pp = f"pp {cell.n_prompt / statistics.median(run.pp_ns) * 1e9:7.1f} t/s" if run.pp_ns else ""
                    st = f"x{cell.streams} {statistics.median(run.streams_ts):6.1f} t/s" if run.streams_ts else ""
                    wire = f"{run.tg_bytes_per_token:8.0f} B/token" if run.tg_bytes_per_token else ""
                    print(
                        f"  {key:24s} {system.name:9s} #{alt} {pp} {tg} {st} {wire} ({run.wall_s:.0f} s) {status}",
                        flush=True,
                    )
    except Exception as e:  # a group that cannot start is reported, the next one still runs
        for cell in cells:
            runs.append(Run("harness", cell.key, 0, error=f"{type(e).__name__}: {e}"))
        print(f"  {group_key}: {e}", flush=True)
    finally:
        for system in systems:
            worker_peaks.update(system.stop_workers())
        for rs in relays.values():
            for r in rs.values():
                r.close()
    for run in runs:
        if run.system != "harness":
            run.__dict__["worker_rss"] = {k: v for k, v in worker_peaks.items() if k.startswith(run.system)}
    return runs


def machine_info() -> dict:
    import psutil

    info = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "load_avg_start": os.getloadavg(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        from shardwire.weights import ggml_cpu

        info["ggml"] = ggml_cpu.build() or "none (PyTorch's kernels)"
    except ImportError:
        pass
    try:
        info["commit"] = subprocess.run(
            ["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(HERE.parent), "status", "--porcelain", "--", "shardwire"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        info["shardwire_tree_dirty"] = bool(dirty)
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few minutes: fewer cells, shorter tests")
    p.add_argument("--shardwire-only", action="store_true", help="run shardwire's side only (no llama.cpp)")
    p.add_argument("--workloads", default=None, help=f"comma-separated, of {', '.join(models.WORKLOADS)}")
    p.add_argument("--workers", default="1,2,3", help="worker counts on direct loopback (default: %(default)s)")
    p.add_argument("--links", default="0,0.2,1", help="one-way delays in ms through relays (default: %(default)s)")
    p.add_argument("--workers-big", default="1,2,3", help="worker counts on direct loopback, 1B models")
    p.add_argument("--delay-workers", default="2", help="worker counts run at each delay, small model")
    p.add_argument("--delay-workers-big", default="2", help="worker counts run at each delay, 1B models")
    p.add_argument(
        "--sweep",
        default="0,1",
        help="one-way delays (ms) the sweep cell alternates between decode runs, '' for none (default: %(default)s)",
    )
    p.add_argument("--sweep-rounds", type=int, default=3, help="rounds through --sweep per invocation")
    p.add_argument("--rate-gbit", type=float, default=1.0, help="bandwidth cap of relayed links (default: %(default)s)")
    p.add_argument("-p", "--n-prompt", type=int, default=512)
    p.add_argument("-n", "--n-gen", type=int, default=128)
    p.add_argument("--n-prompt-big", type=int, default=None, help="prompt length for 1B models (default: -p)")
    p.add_argument("--n-gen-big", type=int, default=None, help="decode length for 1B models (default: -n)")
    p.add_argument("--streams", type=int, default=8, help="concurrent sequences for shardwire's streams test")
    p.add_argument("--streams-big", action="store_true", help="also run the streams test on 1B models")
    p.add_argument("-r", "--reps", type=int, default=2, help="runs of each test inside one invocation")
    p.add_argument("--alternations", type=int, default=2, help="invocations per system per cell, A B B A ...")
    p.add_argument("-t", "--threads", type=int, default=1, help="threads per process (default: %(default)s)")
    p.add_argument(
        "--dtype",
        default=None,
        help="shardwire's compute dtype (default: each worker's own choice, bf16 on CPUs with native bf16)",
    )
    p.add_argument(
        "--no-rpc-cache",
        dest="rpc_cache",
        action="store_false",
        help="run ggml-rpc-server without -c (its local weight cache)",
    )
    p.add_argument(
        "--no-paired-baseline",
        dest="paired_baseline",
        action="store_false",
        help="do not rerun the single process beside each loopback cell (efficiency then compares "
        "cells run minutes apart)",
    )
    p.add_argument(
        "--relay-nice",
        type=int,
        default=-10,
        help="nice value of the relay threads: the emulated network should not wait for a CPU "
        "behind the processes it links (default: %(default)s; needs root, else ignored)",
    )
    p.add_argument("--time-limit", type=float, default=None, help="seconds for the whole run")
    p.add_argument("--run-timeout", type=float, default=900, help="seconds for one invocation")
    p.add_argument("--out", default=None, help="output folder (default: benchmarks/results/<mode>-<time>)")
    pre, _ = p.parse_known_args(argv)
    if pre.quick:  # the small model in full, the 1B layout at 2 workers with short tests
        p.set_defaults(
            workloads="small-f16,1b-q4_0",
            links="0",
            n_prompt_big=128,
            n_gen_big=16,
            workers_big="2",
            delay_workers_big="",
            time_limit=1200,
            run_timeout=240,
        )
    else:
        p.set_defaults(workloads="small-f16,1b-q8_0,1b-q4_0,1b-q4_k", time_limit=3 * 3600, sweep="0,0.2,1")
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    for w in args.workloads:
        if w not in models.WORKLOADS:
            p.error(f"unknown workload {w} (choose from {', '.join(models.WORKLOADS)})")
    args.workers = [int(x) for x in args.workers.split(",") if x]
    args.links = [x for x in args.links.split(",") if x]
    args.sweep = [float(x) for x in args.sweep.split(",") if x]
    args.workers_big = [int(x) for x in args.workers_big.split(",") if x]
    args.delay_workers = [int(x) for x in args.delay_workers.split(",") if x]
    args.delay_workers_big = [int(x) for x in args.delay_workers_big.split(",") if x]
    args.n_prompt_big = args.n_prompt_big or args.n_prompt
    args.n_gen_big = args.n_gen_big or args.n_gen
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    private_state_dir()
    start = time.monotonic()
    deadline = start + args.time_limit
    mode = "quick" if args.quick else "full"
    out = Path(args.out) if args.out else HERE / "results" / f"{mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    prefix = None
    if not args.shardwire_only:
        print("llama.cpp: building or finding the cached build (benchmarks/build_llama_cpp.sh) ...", flush=True)
        prefix = models.llama_cpp_prefix()
        if prefix is None:
            print("llama.cpp is not available: running shardwire's side only", flush=True)
    systems: list[System] = ([LlamaCpp(args, out, prefix)] if prefix else []) + [Shardwire(args, out)]
    files = {}
    for w in args.workloads:
        files[w] = models.ensure(models.WORKLOADS[w], prefix)
    groups = plan_cells(args)
    cells = [c for g in groups for c in g]
    print(
        f"{len(cells)} cells in {len(groups)} groups, {len(systems)} systems, up to {args.time_limit / 60:.0f} min "
        f"-> {out}",
        flush=True,
    )
    results = {
        "meta": {
            "mode": mode,
            "argv": sys.argv,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": machine_info(),
            "systems": [s.name for s in systems],
            "llama_cpp": str(prefix) if prefix else None,
            "threads": args.threads,
            "rate_gbit": args.rate_gbit,
            "reps": args.reps,
            "alternations": args.alternations,
            "models": {w: models.describe(f) for w, f in files.items()},
        },
        "cells": [asdict(c) | {"key": c.key} for c in cells],
        "runs": [],
    }
    for group in groups:
        if time.monotonic() > deadline - 10:
            print(f"  {group[0].workload}/w{group[0].workers}: skipped (time limit)", flush=True)
            continue
        runs = run_cell(group, systems, files[group[0].workload], args, out, deadline)
        results["runs"] += [r.__dict__ for r in runs]
        (out / "results.json").write_text(json.dumps(results, indent=1))
    results["meta"]["elapsed_s"] = time.monotonic() - start
    results["meta"]["load_avg_end"] = os.getloadavg()
    results["summary"] = report.summarize(results)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    report.write(results, out)
    print(f"\n{(out / 'results.md').read_text()}\nwritten: {out}/results.json, results.md, results.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
