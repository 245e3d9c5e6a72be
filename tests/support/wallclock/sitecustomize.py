"""Put on PYTHONPATH by tests only: this process's wall clock jumps when it gets SIGUSR1, by the
next of the seconds listed in SHARDWIRE_TEST_CLOCK_JUMPS (e.g. "3600,-7200"). time.time and
time.time_ns jump; the monotonic clocks do not, as on a machine whose clock is set by hand or
by NTP."""

import os
import signal
import time

_jumps = [float(s) for s in os.environ.get("SHARDWIRE_TEST_CLOCK_JUMPS", "").split(",") if s.strip()]
_offset = [0.0]
_real_time, _real_time_ns = time.time, time.time_ns


def _jump(signum, frame):
    if _jumps:
        _offset[0] += _jumps.pop(0)
        print(f"wall clock jumped: now off by {_offset[0]:+.0f} s", flush=True)


if _jumps:
    time.time = lambda: _real_time() + _offset[0]
    time.time_ns = lambda: _real_time_ns() + int(_offset[0] * 1e9)
    signal.signal(signal.SIGUSR1, _jump)
