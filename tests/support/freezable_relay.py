"""A loopback TCP relay that can stop carrying data without closing anything.

Two faults, each an Event to set and clear:
- `frozen`: bytes are read and thrown away, as a sleeping laptop's Wi-Fi does to what it was
  sent; once cleared the streams carry on with a gap in them.
- `dropping`: a route that drops every packet for a while: nothing crosses in either direction
  (data, or a connection's end), nothing is refused or closed. TCP retransmits what a dead
  route lost, so once cleared every byte arrives, late and in order.
"""

from __future__ import annotations

import socket
import threading


class FreezableRelay:
    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.frozen = threading.Event()
        self.dropping = threading.Event()
        self._flowing = threading.Condition()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def drop(self, on: bool) -> None:
        """Start or end a window in which the route drops every packet."""
        with self._flowing:
            if on:
                self.dropping.set()
            else:
                self.dropping.clear()
                self._flowing.notify_all()

    def _wait_while_dropping(self) -> None:
        with self._flowing:
            while self.dropping.is_set():
                self._flowing.wait(0.5)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            self._sockets += [client, server]
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            self._wait_while_dropping()
            try:
                data = src.recv(1 << 16)
            except OSError:
                return
            self._wait_while_dropping()  # what was read as the window opened waits for it to close
            if not data:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            if self.frozen.is_set():
                continue  # swallowed: neither delivered nor refused
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self.drop(False)
        self.listener.close()
        for s in self._sockets:
            try:
                s.close()
            except OSError:
                pass
