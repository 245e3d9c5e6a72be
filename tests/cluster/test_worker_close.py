"""A worker closed in a process that goes on (a coordinator's local stages, `shardwire plan`) leaves
no thread of its own running: one left inside accept() or a socket while the interpreter shuts down
aborted `shardwire plan` at exit."""

import socket
import threading
import time

from shardwire.worker.server import Worker


def _worker_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "shardwire-worker" or t.name.startswith("conn-")]


def test_closing_a_worker_ends_its_accepting_thread_and_its_connections():
    worker = Worker(host="127.0.0.1", port=0, devices=["cpu"], handshake_timeout=30)
    port = worker.bind()
    worker.start()
    peer = socket.create_connection(("127.0.0.1", port))  # connected, its handshake never sent
    deadline = time.monotonic() + 5
    while not any(name.startswith("conn-") for name in _worker_threads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert any(name.startswith("conn-") for name in _worker_threads())
    start = time.monotonic()
    worker.close()
    assert _worker_threads() == []
    assert time.monotonic() - start < 5  # the handshake's 30 s deadline was not waited out
    peer.close()
