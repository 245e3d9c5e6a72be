"""Mutual challenge-response over a shared token: HMAC-SHA256 over fresh nonces from both
sides. The token never crosses the wire, and a recorded handshake is useless later because
the other side's nonce is new each time.

    client -> HELLO(client nonce)      worker -> CHALLENGE(worker nonce)
    client -> AUTH(client proof)       worker -> WELCOME(worker proof), only if the client's was right
"""

from __future__ import annotations

import hashlib
import hmac
import os

NONCE_SIZE = 32
_SERVER_LABEL = b"shardwire/1 worker proof"
_CLIENT_LABEL = b"shardwire/1 client proof"


def new_nonce() -> bytes:
    return os.urandom(NONCE_SIZE)


def _mac(token: str, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(
        token.encode(), label + b"".join(len(p).to_bytes(2, "big") + p for p in parts), hashlib.sha256
    ).digest()


def server_proof(token: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return _mac(token, _SERVER_LABEL, client_nonce, server_nonce)


def client_proof(token: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return _mac(token, _CLIENT_LABEL, server_nonce, client_nonce)


def verify(expected: bytes, given: bytes) -> bool:
    return hmac.compare_digest(expected, given)
