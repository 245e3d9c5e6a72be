"""The shardwire command as a user runs it, in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys


def run(*args, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", "shardwire", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""),  # this machine lends its CPU only
    )
