"""pytest plugin for running llama.cpp's server tests against the shim (llama_server_suite.py
loads it with -p, in place of the suite's own conftest.py, whose session start launches every
preset once only to download its model).

It stops the servers a test started, after each test; bounds each test with an alarm
(LLAMA_SUITE_TEST_TIMEOUT seconds); and stands in for the `wget` module utils.py imports (used
only to download media, which cannot happen here).
"""

from __future__ import annotations

import os
import signal
import sys
import types

import pytest

if "wget" not in sys.modules:
    try:
        import wget  # noqa: F401
    except ImportError:
        stub = types.ModuleType("wget")

        def download(url, out=None):
            raise RuntimeError(f"no downloads in this run: {url}")

        stub.download = download
        sys.modules["wget"] = stub


class TestTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise TestTimeout(f"the test ran past LLAMA_SUITE_TEST_TIMEOUT={os.environ.get('LLAMA_SUITE_TEST_TIMEOUT')} s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    seconds = int(os.environ.get("LLAMA_SUITE_TEST_TIMEOUT", "0"))
    if seconds > 0:
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)


@pytest.fixture(autouse=True)
def stop_servers_after_each_test():
    yield
    import utils  # the suite's own, on PYTHONPATH

    for server in list(utils.server_instances):
        server.stop()
