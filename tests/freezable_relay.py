"""A loopback TCP relay that can stop carrying data without closing anything: a link that
silently dies, as a sleeping laptop's Wi-Fi does."""

from __future__ import annotations

import socket
import threading


class FreezableRelay:
    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.frozen = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

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
            try:
                data = src.recv(1 << 16)
            except OSError:
                return
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
        self.listener.close()
        for s in self._sockets:
            try:
                s.close()
            except OSError:
                pass
