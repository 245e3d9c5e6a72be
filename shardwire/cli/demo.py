"""`shardwire demo`: a real trained model split across worker processes on this machine.

Starts `shardwire worker` processes on free loopback ports, splits glassllm (a 4-block Llama
trained on Alice in Wonderland, converted to GGUF on first use) across them, streams a
continuation, prints the speed, and stops the workers again, on Ctrl-C and errors too.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import threading
import time

from ..coordinator import Cluster
from ..engine import Engine, Request
from ..formats import open_model
from ..tokenizer import load_tokenizer
from ..wire.tls import ClientTLS
from .generate import sampling_from_args, speeds, stream

log = logging.getLogger("shardwire.cli.demo")

_LISTENING = re.compile(r"listening on (\S+):(\d+) \(TLS (sha256:[0-9a-f]{64})")


class LocalWorkers:
    """`shardwire worker` processes on loopback, stopped on exit from the `with` block whatever happens."""

    def __init__(self, count: int, device: str, threads: int, token: str, log_level: str = "warning"):
        self.count, self.device, self.threads, self.token, self.log_level = count, device, threads, token, log_level
        self.procs: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        self.fingerprints: set[str] = set()  # the certificates they printed: the demo trusts exactly these

    def __enter__(self) -> "LocalWorkers":
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self, timeout: float = 120.0) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.threads), SHARDWIRE_TOKEN=self.token)
        cmd = [
            sys.executable,
            "-m",
            "shardwire",
            "--log-level",
            self.log_level,
            "worker",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--device",
            self.device,
            "--threads",
            str(self.threads),
        ]
        # Every process starts before any reader thread exists: forking beside Python threads is unsafe
        # with a preexec_fn. Own sessions keep a terminal's Ctrl-C for the demo, which stops them in order.
        for _ in range(self.count):
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=env,
                    text=True,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            )
        ports: queue.Queue = queue.Queue()
        for i, proc in enumerate(self.procs):
            threading.Thread(
                target=self._read, args=(i, proc, ports), daemon=True, name=f"worker{i + 1}-output"
            ).start()
        found: dict[int, tuple[str, str]] = {}
        deadline = time.monotonic() + timeout
        while len(found) < self.count:
            try:
                i, listening = ports.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"the workers did not start within {timeout:.0f} s") from None
            if listening is None:
                raise RuntimeError(f"worker {i + 1} exited before listening (exit code {self.procs[i].wait()})")
            found[i] = listening
        self.addresses = [found[i][0] for i in range(self.count)]
        self.fingerprints = {fingerprint for _, fingerprint in found.values()}

    def _read(self, i: int, proc: subprocess.Popen, ports: queue.Queue) -> None:
        """Finds the port the worker printed, then keeps its pipe drained, passing on what it logs."""
        announced = False
        for line in proc.stdout:
            m = _LISTENING.search(line)
            if m and not announced:
                announced = True
                ports.put((i, (f"{m[1]}:{m[2]}", m[3])))
            level = logging.WARNING if re.search(r" (WARNING|ERROR|CRITICAL) ", line) else logging.DEBUG
            log.log(level, "[worker %d] %s", i + 1, line.rstrip())
        if not announced:
            ports.put((i, None))

    def stop(self, grace: float = 10.0) -> None:
        """Ctrl-C for each worker (it frees its stages and exits), then a kill for any still running."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT if os.name == "posix" else signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _die_with_parent() -> None:
    """A worker stops on the Ctrl-C the demo sends it, even where the demo itself was started
    ignoring Ctrl-C (as a shell's background job is); on Linux it also gets SIGTERM if the demo is
    killed outright (kill -9), so none is orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def run_demo(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` cleans up as Ctrl-C does
    started = time.perf_counter()
    print(
        "shardwire demo: glassllm, a 4-block Llama trained on Alice in Wonderland, split across "
        f"{args.workers} worker processes on this machine",
        flush=True,
    )
    try:
        import glassllm  # noqa: F401

        from shardwire_kit.glassllm import cached_glassllm_gguf
    except ImportError:
        raise ValueError("the demo's model comes with the demo extra: pip install 'shardwire[demo]'") from None
    path = cached_glassllm_gguf()  # converted by shardwire_kit.writer on first use
    model = open_model(path)
    tokenizer = load_tokenizer(model)
    n_layers, ctx = model.config.n_layers, model.config.context_length
    if not 1 <= args.workers <= n_layers:
        raise ValueError(f"--workers must be between 1 and {n_layers} (the model has {n_layers} blocks)")
    prompt = tokenizer.encode(args.prompt)
    if not 0 < len(prompt) < ctx:
        raise ValueError(f"the prompt must be 1 to {ctx - 1} tokens; it is {len(prompt)}")
    print(f"model: {path}", flush=True)
    token = secrets.token_hex(16)  # loopback ports are open to every local user: the workers want this token
    level = logging.getLevelName(log.getEffectiveLevel()).lower()
    with LocalWorkers(args.workers, args.device, args.threads, token, level) as workers:
        for i, (proc, address) in enumerate(zip(workers.procs, workers.addresses)):
            print(
                f"worker {i + 1}: pid {proc.pid}, listening on {address} ({args.device}, "
                f"{args.threads} thread{'s' if args.threads != 1 else ''})",
                flush=True,
            )
        # its own workers, on ports that change every run: pinned as they printed, not as known hosts
        cluster = Cluster(workers.addresses, token=token, tls=ClientTLS(pins=workers.fingerprints), show_progress=True)
        try:
            cluster.connect(model)
            plan = cluster.make_plan(tensor_split=[1.0] * args.workers, n_slots=1, ctx=ctx, weights="auto")
            print(plan.table(), flush=True)
            pipeline = cluster.load(plan)
            loaded = cluster.load_stats
            print(
                f"weights: {_size(loaded.get('streamed', 0))} sent over TCP, {_size(loaded.get('cache', 0))} from "
                f"the workers' caches (a second run sends nothing)\n",
                flush=True,
            )
            engine = Engine(pipeline, tokenizer)
            try:
                handle = engine.submit(Request(prompt, sampling_from_args(args), max_tokens=args.n_predict))
                stream(handle, args.prompt)
            finally:
                engine.close()
        finally:
            cluster.close()
    if handle.error:
        print(f"shardwire: error: {handle.error}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - started
    print(f"\n{speeds(handle)} | {elapsed:.1f} s in all; workers stopped", flush=True)
    return 0
