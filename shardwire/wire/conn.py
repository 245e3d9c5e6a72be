"""A framed, authenticated connection over a TCP (optionally TLS) socket."""

from __future__ import annotations

import os
import select
import socket
import ssl
import threading
import time
from contextlib import contextmanager

from . import auth
from .frames import Frame, FrameError, Limits, MessageType, read_frame, send_frame
from .messages import Auth, Challenge, Error, Hello, Message, Welcome
from .tls import ClientTLS, TLSError


class RemoteError(RuntimeError):
    """The peer answered with an ERROR frame."""

    def __init__(self, code: str, message: str, request: int = 0):
        super().__init__(message)
        self.code, self.request = code, request


class AuthError(ConnectionError):
    """The handshake failed: wrong or missing token, or an impostor."""


class Connection:
    def __init__(self, sock: socket.socket, peer: str, limits: Limits | None = None):
        self.sock, self.peer = sock, peer
        self.limits = limits or Limits()
        self._send_lock = threading.Lock()
        self._recv_lock = threading.RLock()  # held while a read is under way (payload_into may close)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.closed = False
        self.last_heard = time.monotonic()  # when the peer last sent a frame
        self.fingerprint: str | None = None  # the peer's TLS certificate, when TLS is on

    def send(self, message: Message, payload=b"", request: int = 0) -> int:
        header = message.to_wire()
        with self._send_lock, self._shut_down_as_closed():
            n = send_frame(self.sock, message.TYPE, header, payload, request)
        self.bytes_sent += n
        return n

    def recv(self, payload_into=None) -> Frame:
        with self._recv_lock, self._shut_down_as_closed():
            frame = read_frame(self.sock, self.limits, payload_into)
        self.last_heard = time.monotonic()
        self.bytes_received += 32 + len(frame.payload)
        if frame.type == MessageType.ERROR:
            err = Error.parse(frame.header)
            raise RemoteError(err.code, f"{self.peer}: {err.message}", frame.request)
        return frame

    def readable(self, seconds: float, spin: bool = False) -> bool:
        """Whether bytes of a frame are waiting, or arrive within `seconds`: asleep in poll, or
        spinning (polling, yielding the core to whatever else is ready to run on it), which keeps
        the CPU awake: a sleeping one takes tens to hundreds of microseconds to wake, most on VMs."""
        pending = getattr(self.sock, "pending", None)  # bytes TLS has decrypted already
        try:
            if self.sock.fileno() < 0 or (pending is not None and pending()):
                return True  # bytes to read, or a closed link, which the next recv() reports
        except (OSError, ValueError):
            return True
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        if not spin:
            return bool(poller.poll(max(0, int(seconds * 1000))))
        end = time.monotonic() + seconds
        while not poller.poll(0):
            if time.monotonic() >= end:
                return False
            os.sched_yield()
        return True

    @contextmanager
    def _shut_down_as_closed(self):
        """Once shut down, the socket's TLS layer answers a read or write with AttributeError or
        ValueError; callers see the end of the connection."""
        if self.closed:
            raise ConnectionError(f"{self.peer}: connection closed")
        try:
            yield
        except FrameError:
            raise
        except (AttributeError, ValueError):
            if not self.closed:
                raise
            raise ConnectionError(f"{self.peer}: connection closed") from None

    def expect_frame(self, cls: type[Message]) -> Frame:
        """The next frame, which must be of `cls`'s type (its payload is wanted too)."""
        frame = self.recv()
        if frame.type != cls.TYPE:
            raise FrameError(f"{self.peer}: expected {cls.TYPE.name}, got {frame.type.name}")
        return frame

    def expect(self, cls: type[Message]) -> Message:
        """The next message, which must be a `cls`."""
        return cls.parse(self.expect_frame(cls).header)

    def send_error(self, code: str, message: str, request: int = 0) -> None:
        try:
            self.send(Error(code, message), request=request)
        except OSError:
            pass

    def shutdown(self) -> None:
        """End the connection for everyone using it: a thread reading or writing it wakes with an
        error, later calls fail at once. The socket itself stays open until close()."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Shut down, then close the socket once no read or write is under way: closed under a
        reader, its number could go to the next file or socket opened while TLS still reads from
        that number."""
        self.shutdown()
        with self._recv_lock, self._send_lock:
            self.sock.close()


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def connect(
    host: str,
    port: int,
    *,
    token: str | None,
    role: str = "coordinator",
    timeout: float = 10.0,
    tls: ClientTLS | None = None,
    pin: str | None = None,
    limits: Limits | None = None,
) -> tuple[Connection, Challenge]:
    """Open a connection (TLS first when `tls` is given) and run the HELLO handshake as the
    client. The worker must be trusted (CA or pinned fingerprint) before anything is sent,
    and with a token it must also prove it knows the token: a coordinator never sends a
    request's tokens to an impostor."""
    peer = f"{host}:{port}"
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        tune(sock)
        fingerprint = None
        if tls is not None:
            try:
                sock = tls.context().wrap_socket(sock, server_hostname=host)
            except (ssl.SSLError, ssl.CertificateError) as e:
                raise TLSError(
                    f"{peer}: TLS handshake failed ({e.__class__.__name__}: {e}); if that worker was started with "
                    "--no-tls, pass --no-tls here too"
                ) from None
            fingerprint = tls.check(sock, peer, pin)
        conn = Connection(sock, peer, limits)
        conn.fingerprint = fingerprint
        nonce = auth.new_nonce()
        conn.send(Hello(role, nonce))
        try:
            challenge = conn.expect(Challenge)
        except (ConnectionError, FrameError) as e:
            if tls is not None:
                raise
            raise ConnectionError(
                f"{peer}: the worker did not answer the handshake ({e}); workers speak TLS unless started with "
                "--no-tls: drop --no-tls here (or start the worker with it)"
            ) from None
        if token is not None and not challenge.auth:
            raise AuthError(f"{peer}: worker has no token configured, but this side requires one")
        if token is None and challenge.auth:
            raise AuthError(f"{peer}: worker requires a token (set SHARDWIRE_TOKEN or use --token-file)")
        # The client proves itself first, so a stranger who connects to a worker learns
        # nothing derived from the token to guess at offline.
        proof = auth.client_proof(token, nonce, challenge.nonce) if token is not None else b""
        conn.send(Auth(proof))
        try:
            welcome = conn.expect(Welcome)
        except RemoteError as e:
            raise AuthError(str(e)) from None
        if token is not None and not auth.verify(auth.server_proof(token, nonce, challenge.nonce), welcome.proof):
            raise AuthError(f"{peer}: worker failed to prove it knows the token (an impostor?)")
        sock.settimeout(None)
        return conn, challenge
    except BaseException:
        sock.close()
        raise


def server_handshake(conn: Connection, token: str | None, worker_id: str) -> Hello:
    """Run the HELLO handshake as the worker; raises AuthError (the caller replies and closes)."""
    frame = conn.recv()
    if frame.type != MessageType.HELLO:
        raise FrameError(f"expected HELLO first, got {frame.type.name}")
    hello = Hello.parse(frame.header)
    nonce = auth.new_nonce()
    conn.send(Challenge(nonce, worker_id, token is not None))
    answer = conn.expect(Auth)
    if token is not None and not auth.verify(auth.client_proof(token, hello.nonce, nonce), answer.proof):
        raise AuthError(f"{conn.peer}: authentication failed")
    conn.send(Welcome(auth.server_proof(token, hello.nonce, nonce) if token else b""))
    return hello
