"""`shardwire demo` as a newcomer runs it: real text from glassllm split across two worker processes,
and no process left behind, whether it ends or is interrupted."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import psutil
import pytest

pytestmark = pytest.mark.slow  # worker processes

pytest.importorskip("glassllm")

from shardwire.weights.in_use import compute_line  # noqa: E402

PROMPT = "Alice was beginning to get very tired"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    # A cache of its own: the first run converts glassllm to GGUF, as on a fresh machine.
    return dict(os.environ, SHARDWIRE_CACHE=str(tmp_path_factory.mktemp("cache")), PYTHONUNBUFFERED="1")


def demo(env, *args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "shardwire", "demo", *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # as from a terminal, whatever this run inherited (a shell's background jobs ignore Ctrl-C)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def worker_pids(out: str) -> list[int]:
    return [int(p) for p in re.findall(r"^worker \d+: pid (\d+)", out, re.M)]


def running(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE and "worker" in p.cmdline()
    except psutil.NoSuchProcess:
        return False


def test_demo_streams_real_text_and_stops_its_workers(env):
    proc = demo(env, "-n", "32", "--seed", "7")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, out + err
    pids = worker_pids(out)
    assert len(pids) == 2
    assert "blocks" in out and "0-1+embd" in out and "2-3+head" in out  # the plan, one half per worker
    assert out.count(f"/cpu: {compute_line('cpu')}\n") == 2  # the kernels on each worker's device
    generated = out.split(PROMPT, 1)[1].split("\nprompt:", 1)[0]
    assert len(generated.strip()) >= 20 and re.search(r"\b(the|and|she|was|to|of|a)\b", generated), generated
    assert re.search(r"generation: \d+ tokens at [\d.]+ tokens/s", out)
    assert not [p for p in pids if running(p)]


def test_ctrl_c_stops_the_workers_too(env):
    proc = demo(env, "-n", "96")
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if len(worker_pids("".join(lines))) == 2:
            break
    pids = worker_pids("".join(lines))
    assert len(pids) == 2 and all(running(p) for p in pids)
    # Freeze one worker, as a hung machine would be, so the demo cannot finish before Ctrl-C.
    os.kill(pids[1], signal.SIGSTOP)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, "".join(lines) + out + err
    assert not [p for p in pids if running(p)]
