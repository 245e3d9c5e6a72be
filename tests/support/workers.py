"""Real `shardwire worker` processes on loopback for tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

_LISTENING = re.compile(r"listening on (\S+):(\d+)")


class WorkerProcess:
    def __init__(
        self,
        cache_dir: Path,
        extra: tuple[str, ...] = (),
        port: int = 0,
        token: str | None = None,
        devices: str = "cpu",
        threads: int = 1,
        host: str = "127.0.0.1",
        env: dict[str, str] | None = None,
        launcher: tuple[str, ...] = (),
        cwd: Path | None = None,
    ):
        """`launcher` goes before the worker's command line (e.g. a command entering a namespace);
        `cwd`, where not the tests', keeps this tree's package off the worker's path."""
        self.cache_dir, self.extra, self.port, self.token = cache_dir, extra, port, token
        self.devices, self.threads, self.host = devices, threads, host
        self.env, self.launcher, self.cwd = env or {}, launcher, cwd
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "WorkerProcess":
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.threads), **self.env)
        if self.token is not None:
            env["SHARDWIRE_TOKEN"] = self.token
        cmd = [
            *self.launcher,
            sys.executable,
            "-m",
            "shardwire",
            "--log-level",
            "info",
            "worker",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--device",
            self.devices,
            "--threads",
            str(self.threads),
            "--cache-dir",
            str(self.cache_dir),
            *self.extra,
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, cwd=self.cwd
        )
        deadline = time.monotonic() + timeout
        lines = self.log = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = _LISTENING.search(line)
            if m:
                self.port = int(m[2])
                # keep draining output so the worker never blocks on a full pipe
                import threading

                threading.Thread(target=self._drain, daemon=True).start()
                return self
        self.stop()
        raise RuntimeError("worker did not start:\n" + "".join(lines))

    def restarted(self) -> "WorkerProcess":
        """A new worker at this one's address, with its cache folder and options (this one killed
        or stopped): what a user restarting it would run."""
        return WorkerProcess(
            self.cache_dir,
            self.extra,
            self.port,
            self.token,
            self.devices,
            self.threads,
            self.host,
            self.env,
            self.launcher,
            self.cwd,
        ).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
