"""How busy the machine was while something was timed: the CPU time that other processes took, and
that a hypervisor stole, over the span (from /proc/stat, against this process's own CPU time). A
kernel measurement taken while others kept a core busy says more about them than about the
kernels, so it is kept only as provisional (measure.py)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

BUSY_CORES = 0.25  # other processes' average CPU use, in cores, above which the machine counts as busy
BUSY_STEAL = 0.05  # the share of CPU time a hypervisor took, above which it counts as busy too


@dataclass(frozen=True)
class Load:
    others: float | None  # cores other processes kept busy on average; None where unknown
    steal: float = 0.0  # share of all CPU time the hypervisor took

    @property
    def busy(self) -> bool:
        return self.others is not None and (self.others > BUSY_CORES or self.steal > BUSY_STEAL)

    def words(self) -> str:
        if self.others is None:
            return "load unknown"
        state = "under load" if self.busy else "quiet"
        return f"{state}: other processes used {self.others:.2f} cores, {self.steal:.0%} stolen"


def _cpu_seconds() -> tuple[float, float, float] | None:
    """All CPUs' busy, stolen and total seconds since boot; None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields + [0] * (8 - len(fields))
    hz = os.sysconf("SC_CLK_TCK")
    busy = user + nice + system + irq + softirq
    return busy / hz, steal / hz, (busy + idle + iowait + steal) / hz


class Watch:
    """`with Watch() as w: ...`, then w.load: how busy the rest of the machine was meanwhile."""

    load = Load(None)

    def __enter__(self) -> "Watch":
        self._start = time.monotonic(), time.process_time(), _cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        (wall0, own0, stat0), stat1 = self._start, _cpu_seconds()
        wall, own = time.monotonic() - wall0, time.process_time() - own0
        if stat0 is None or stat1 is None or wall <= 0:
            return
        busy, steal, total = (b - a for a, b in zip(stat0, stat1))
        self.load = Load(max(0.0, (busy - own) / wall), steal / total if total > 0 else 0.0)


def now(seconds: float = 0.25) -> Load:
    """How busy the machine is over the next `seconds` (this process idle meanwhile)."""
    with Watch() as watch:
        time.sleep(seconds)
    return watch.load
