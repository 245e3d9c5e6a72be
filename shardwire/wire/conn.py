"""A framed, authenticated connection over a TCP (optionally TLS) socket."""

from __future__ import annotations

import socket
import ssl
import threading

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
        self.bytes_sent = 0
        self.bytes_received = 0
        self.closed = False
        self.fingerprint: str | None = None  # the peer's TLS certificate, when TLS is on

    def send(self, message: Message, payload=b"", request: int = 0) -> int:
        header = message.to_wire()
        with self._send_lock:
            n = send_frame(self.sock, message.TYPE, header, payload, request)
        self.bytes_sent += n
        return n

    def recv(self, payload_into=None) -> Frame:
        frame = read_frame(self.sock, self.limits, payload_into)
        self.bytes_received += 32 + len(frame.payload)
        if frame.type == MessageType.ERROR:
            err = Error.parse(frame.header)
            raise RemoteError(err.code, f"{self.peer}: {err.message}", frame.request)
        return frame

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

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
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
                raise TLSError(f"{peer}: TLS handshake failed ({e.__class__.__name__}: {e})") from None
            fingerprint = tls.check(sock, peer, pin)
        conn = Connection(sock, peer, limits)
        conn.fingerprint = fingerprint
        nonce = auth.new_nonce()
        conn.send(Hello(role, nonce))
        challenge = conn.expect(Challenge)
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
