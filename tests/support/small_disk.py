"""A small disk for a test, without root: a tmpfs mounted in a user and mount namespace of its
own. Processes started with `launcher` run inside it and see the tmpfs at `mountpoint`; writes
past its size fail with ENOSPC as on a full disk. From outside, its files are read through the
holder process's view of the file system (`outside`).

    with SmallDisk(tmp_path / "disk", "2m") as disk:
        WorkerProcess(disk.mountpoint / "cache", launcher=disk.launcher).start()
        disk.resize("64m")   # room again, same files
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


class SmallDisk:
    def __init__(self, mountpoint: Path, size: str):
        if shutil.which("unshare") is None or shutil.which("nsenter") is None:
            pytest.skip("needs util-linux's unshare and nsenter")
        self.mountpoint = mountpoint
        mountpoint.mkdir(parents=True, exist_ok=True)
        script = f"mount -t tmpfs -o size={size} tmpfs '{mountpoint}' && echo mounted && exec sleep 3600"
        self.holder = subprocess.Popen(
            ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        first = self.holder.stdout.readline()
        if first.strip() != "mounted":
            self.close()
            pytest.skip(f"no user and mount namespaces here: {first.strip()}")

    @property
    def launcher(self) -> tuple[str, ...]:
        """Goes before a command line to run it inside the namespace (it keeps its process id)."""
        return ("nsenter", "-t", str(self.holder.pid), "--user", "--mount", "--preserve-credentials")

    def outside(self, inside: Path) -> Path:
        """Where a path inside the namespace can be read from this process."""
        return Path(f"/proc/{self.holder.pid}/root") / inside.relative_to("/")

    def resize(self, size: str) -> None:
        subprocess.run(
            [*self.launcher, "mount", "-o", f"remount,size={size}", str(self.mountpoint)], check=True, timeout=30
        )

    def close(self) -> None:
        if self.holder.poll() is None:
            self.holder.kill()
        self.holder.wait(10)

    def __enter__(self) -> "SmallDisk":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
