"""The reader of a worker link (shardwire/coordinator/links.py), over socket pairs: dropping a link
never closes a socket its reader is still inside (the number would go to the next connection
while TLS still reads from it), and the reader of a connection
replaced since never reports the link lost."""

from __future__ import annotations

import socket
import threading

from shardwire.coordinator.links import LinkEvents, WorkerLink
from shardwire.wire.conn import Connection


def linked(conn: Connection, lost: list[str]) -> WorkerLink:
    link = WorkerLink.at("127.0.0.1:50052")
    link.conn, link.alive = conn, True
    link.start_reader(LinkEvents(lambda result: None, lambda error, link: None, lambda link, m: lost.append(m)))
    return link


def test_dropping_a_link_never_closes_the_socket_under_its_reader(monkeypatch):
    """The reader is held inside its read (as TLS is while it reads a record) when the link is
    dropped: the socket is shut down at once, closed only after the reader has left it."""
    import shardwire.wire.conn as conn_module

    inside, leave, seen_open = threading.Event(), threading.Event(), []

    def slow_read(sock, limits, payload_into=None):
        inside.set()
        leave.wait(5)
        seen_open.append(sock.fileno() != -1)
        raise ConnectionError("connection closed by peer")

    ours, theirs = socket.socketpair()
    monkeypatch.setattr(conn_module, "read_frame", slow_read)
    conn, lost = Connection(ours, "worker"), []
    link = linked(conn, lost)
    reader = link.reader
    assert inside.wait(5)
    dropping = threading.Thread(target=link.drop)
    dropping.start()
    dropping.join(0.3)
    assert dropping.is_alive() and conn.closed, "drop waits for the reader, with the connection already ended"
    leave.set()
    dropping.join(5)
    reader.join(5)
    assert seen_open == [True] and ours.fileno() == -1 and not reader.is_alive()
    theirs.close()


def test_the_reader_of_a_replaced_connection_does_not_report_the_link_lost():
    ours, theirs = socket.socketpair()
    lost = []
    link = linked(Connection(ours, "worker"), lost)
    old, reader = link.conn, link.reader
    again, again_theirs = socket.socketpair()
    link.conn = Connection(again, "worker")  # connected again before the old reader noticed its end
    theirs.close()
    reader.join(5)
    assert not reader.is_alive() and old.closed and lost == []
    assert link.alive
    link.conn.close()
    again_theirs.close()


def test_a_connection_that_ends_reports_the_link_lost_once():
    ours, theirs = socket.socketpair()
    lost = []
    link = linked(Connection(ours, "worker"), lost)
    theirs.close()
    link.reader.join(5)
    assert len(lost) == 1 and "is gone" in lost[0] and link.conn.closed
