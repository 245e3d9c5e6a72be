"""A framed, authenticated connection over a TCP (optionally TLS) socket."""
from __future__ import annotations

import socket
import ssl
import threading

from . import auth
from .frames import Frame, FrameError, Limits, MessageType, read_frame, send_frame
from .messages import Auth, Challenge, Error, Hello


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

    def send(self, type: MessageType, header: dict | None = None, payload=b"", request: int = 0) -> int:
        with self._send_lock:
            n = send_frame(self.sock, type, header, payload, request)
        self.bytes_sent += n
        return n

    def recv(self, payload_into=None) -> Frame:
        frame = read_frame(self.sock, self.limits, payload_into)
        self.bytes_received += 32 + len(frame.payload)
        if frame.type == MessageType.ERROR:
            err = Error.parse(frame.header)
            raise RemoteError(err.code, f"{self.peer}: {err.message}", frame.request)
        return frame

    def expect(self, type: MessageType, payload_into=None) -> Frame:
        frame = self.recv(payload_into)
        if frame.type != type:
            raise FrameError(f"{self.peer}: expected {type.name}, got {frame.type.name}")
        return frame

    def send_error(self, code: str, message: str, request: int = 0) -> None:
        try:
            self.send(MessageType.ERROR, {"code": code, "message": message[:4000]}, request=request)
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


def connect(host: str, port: int, *, token: str | None, role: str = "coordinator",
            timeout: float = 10.0, tls: ssl.SSLContext | None = None,
            limits: Limits | None = None) -> tuple[Connection, Challenge]:
    """Open a connection and run the HELLO handshake as the client.

    With a token, the worker must prove it knows it too: a coordinator never sends a
    request's tokens to an impostor."""
    peer = f"{host}:{port}"
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        tune(sock)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=host)
        conn = Connection(sock, peer, limits)
        nonce = auth.new_nonce()
        conn.send(MessageType.HELLO, {"role": role, "nonce": nonce})
        challenge = Challenge.parse(conn.expect(MessageType.CHALLENGE).header)
        if token is not None:
            if not challenge.auth:
                raise AuthError(f"{peer}: worker has no token configured, but this side requires one")
            if not auth.verify(auth.server_proof(token, nonce, challenge.nonce), challenge.proof):
                raise AuthError(f"{peer}: worker failed to prove it knows the token (wrong token or impostor)")
            proof = auth.client_proof(token, nonce, challenge.nonce)
        elif challenge.auth:
            raise AuthError(f"{peer}: worker requires a token (use --token or SHARDWIRE_TOKEN)")
        else:
            proof = b""
        conn.send(MessageType.AUTH, {"proof": proof})
        try:
            conn.expect(MessageType.WELCOME)
        except RemoteError as e:
            raise AuthError(str(e)) from None
        sock.settimeout(None)
        return conn, challenge
    except BaseException:
        sock.close()
        raise


def server_handshake(conn: Connection, token: str | None, worker_id: str) -> Hello:
    """Run the HELLO handshake as the worker; raises AuthError after replying with an ERROR."""
    frame = conn.recv()
    if frame.type != MessageType.HELLO:
        raise FrameError(f"expected HELLO first, got {frame.type.name}")
    hello = Hello.parse(frame.header)
    nonce = auth.new_nonce()
    proof = auth.server_proof(token, hello.nonce, nonce) if token is not None else b""
    conn.send(MessageType.CHALLENGE, {"nonce": nonce, "proof": proof, "worker_id": worker_id,
                                      "auth": token is not None})
    answer = Auth.parse(conn.expect(MessageType.AUTH).header)
    if token is not None and not auth.verify(auth.client_proof(token, hello.nonce, nonce), answer.proof):
        conn.send_error("auth", "authentication failed")
        raise AuthError(f"{conn.peer}: authentication failed")
    conn.send(MessageType.WELCOME, {})
    return hello
