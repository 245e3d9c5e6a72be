"""The budget for connections that have not finished their handshake (no processes: the flood
itself, against a worker process, is in test_flood)."""

import socket
import time

import pytest

from shardwire.worker.admission import Admission


@pytest.fixture
def sockets():
    made = []

    def pair():
        a, b = socket.socketpair()
        made.extend((a, b))
        return a, b

    yield pair
    for s in made:
        s.close()


def dropped(peer: socket.socket) -> bool:
    """The worker's side was shut down: the peer reads the end of the stream."""
    peer.settimeout(1.0)
    return peer.recv(1) == b""


def test_an_address_over_its_share_has_its_new_connection_refused(sockets):
    admission = Admission(total=10, per_address=2, deadline=60)
    held = [admission.admit(sockets()[0], "10.0.0.9") for _ in range(2)]
    assert admission.admit(sockets()[0], "10.0.0.9") is None
    assert admission.admit(sockets()[0], "10.0.0.1") is not None  # another address is not affected
    admission.finished(held[0])
    assert admission.admit(sockets()[0], "10.0.0.9") is not None
    admission.close()


def test_a_full_budget_drops_the_oldest_of_the_address_holding_most(sockets):
    admission = Admission(total=4, per_address=3, deadline=60)
    flood = [sockets() for _ in range(3)]
    entries = [admission.admit(ours, "10.0.0.9") for ours, _ in flood]
    coordinator, coordinator_peer = sockets()
    ours = admission.admit(coordinator, "10.0.0.1")
    newcomer, _ = sockets()
    assert admission.admit(newcomer, "10.0.0.7") is not None  # the total was full: someone made room
    assert entries[0].dropped.is_set() and dropped(flood[0][1])
    assert not ours.dropped.is_set() and not any(e.dropped.is_set() for e in entries[1:])
    coordinator_peer.setblocking(False)
    with pytest.raises(BlockingIOError):
        coordinator_peer.recv(1)  # still open
    admission.close()


def test_a_handshake_past_its_deadline_is_dropped(sockets):
    admission = Admission(total=4, per_address=4, deadline=0.3)
    ours, peer = sockets()
    entry = admission.admit(ours, "10.0.0.9")
    assert entry.dropped.wait(2.0) and dropped(peer)
    admission.finished(entry)  # the connection's own thread, ending: nothing left to count
    assert admission.admit(sockets()[0], "10.0.0.9") is not None
    admission.close()


def test_a_finished_handshake_is_never_dropped(sockets):
    admission = Admission(total=1, per_address=1, deadline=0.2)
    ours, peer = sockets()
    entry = admission.admit(ours, "10.0.0.9")
    admission.finished(entry)
    time.sleep(0.5)
    admission.admit(sockets()[0], "10.0.0.1")
    assert not entry.dropped.is_set()
    peer.setblocking(False)
    with pytest.raises(BlockingIOError):
        peer.recv(1)
    admission.close()
