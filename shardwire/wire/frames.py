"""Binary frames: a fixed 32-byte header, a msgpack header, then raw payload bytes.

    magic    4s   b"SHWR"
    version  u16  PROTOCOL_VERSION
    type     u16  MessageType
    flags    u16  reserved, must be 0
    reserved u16  must be 0
    request  u64  request id chosen by the sender of a request, echoed by its reply
    hlen     u32  msgpack header length
    plen     u64  payload length

Every length is checked against limits before anything is allocated, and the msgpack
header is decoded with its own size limits; nothing off the wire is ever executed.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass, field
from enum import IntEnum

import msgpack

MAGIC = b"SHWR"
# 2: DEVICES reports kernels, ASSIGN carries prefill_chunk; 3: ASSIGN stages carry -ot overrides;
# 4: VOCAB, and FORWARD rows may carry grammar constraints; 5: FORWARD rows carry their KV page
# tables; 6: DEVICES names each device's kernels (compute), ASSIGN's model config carries the
# fields of the families' registry (sliding window, local RoPE, query and embedding scales, logit cap);
# 7: FORWARD rows may carry proposed tokens, RESULT gives each row a list of sampled tokens;
# 8: ASSIGN carries the sliding windows' ring step, READY's stages what their start chose by measuring
PROTOCOL_VERSION = 8
_FIXED = struct.Struct("<4sHHHHQIQ")
FIXED_SIZE = _FIXED.size


class MessageType(IntEnum):
    HELLO = 1  # client -> server: version, role, client nonce
    CHALLENGE = 2  # server -> client: server nonce, whether a token is required
    AUTH = 3  # client -> server: client proof
    WELCOME = 4  # server -> client: server proof; the handshake is done
    ERROR = 5
    DESCRIBE = 6  # -> DEVICES
    DEVICES = 7
    ASSIGN = 8  # plan for this worker -> NEED (missing weights) or READY
    NEED = 9
    WEIGHTS = 10  # one chunk of one tensor's bytes
    READY = 11
    FORWARD = 12  # a step: token ids or hidden states for a batch of rows
    RESULT = 13  # sampled tokens from the last stage
    FREE = 14  # a sequence slot is no longer used
    PING = 15
    PONG = 16
    RELEASE = 17  # drop the plan and its memory
    OK = 18
    VOCAB = 19  # the tokens' bytes, for the grammar matchers of the stage that samples


@dataclass
class Limits:
    max_header: int = 1 << 20
    max_payload: int = 256 << 20


class FrameError(ValueError):
    """A frame that breaks the protocol; the connection it came on is closed."""


@dataclass
class Frame:
    type: MessageType
    header: dict = field(default_factory=dict)
    payload: bytes | bytearray | memoryview = b""
    request: int = 0


def pack_header(type: MessageType, header: dict, payload_len: int, request: int = 0) -> bytes:
    body = msgpack.packb(header, use_bin_type=True)
    return _FIXED.pack(MAGIC, PROTOCOL_VERSION, int(type), 0, 0, request, len(body), payload_len) + body


def parse_fixed(raw: bytes, limits: Limits) -> tuple[MessageType, int, int, int]:
    """Validate the fixed header; returns (type, request id, header length, payload length)."""
    magic, version, mtype, flags, reserved, request, hlen, plen = _FIXED.unpack(raw)
    if magic != MAGIC:
        raise FrameError("bad magic: not a shardwire peer")
    if version != PROTOCOL_VERSION:
        raise FrameError(f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION})")
    try:
        mtype = MessageType(mtype)
    except ValueError:
        raise FrameError(f"unknown message type {mtype}") from None
    if flags or reserved:
        raise FrameError("reserved header bits are set")
    if hlen > limits.max_header:
        raise FrameError(f"header of {hlen} bytes exceeds the limit of {limits.max_header}")
    if plen > limits.max_payload:
        raise FrameError(f"payload of {plen} bytes exceeds the limit of {limits.max_payload}")
    return mtype, request, hlen, plen


def decode_header(raw: bytes, limits: Limits) -> dict:
    try:
        header = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_str_len=limits.max_header,
            max_bin_len=limits.max_header,
            max_array_len=1 << 20,
            max_map_len=1 << 16,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises many types on malformed input
        raise FrameError(f"malformed msgpack header: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise FrameError("msgpack header is not a map")
    return header


def recv_exact(sock: socket.socket, buf: memoryview) -> None:
    """Fill `buf` from `sock`; raises ConnectionError at end of stream."""
    got, n = 0, len(buf)
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k


def read_frame(sock: socket.socket, limits: Limits, payload_into=None) -> Frame:
    """Read one frame. `payload_into(type, header, nbytes)` may return a preallocated writable
    buffer for the payload (e.g. a tensor's storage); otherwise a bytearray is allocated."""
    fixed = bytearray(FIXED_SIZE)
    recv_exact(sock, memoryview(fixed))
    mtype, request, hlen, plen = parse_fixed(bytes(fixed), limits)
    raw = bytearray(hlen)
    recv_exact(sock, memoryview(raw))
    header = decode_header(bytes(raw), limits)
    payload: bytearray | memoryview = b""
    if plen:
        target = payload_into(mtype, header, plen) if payload_into is not None else None
        payload = target if target is not None else bytearray(plen)
        recv_exact(sock, memoryview(payload).cast("B"))
    return Frame(mtype, header, payload, request)


def send_frame(
    sock: socket.socket,
    type: MessageType,
    header: dict | None = None,
    payload: bytes | bytearray | memoryview = b"",
    request: int = 0,
) -> int:
    """Send one frame; returns the bytes written."""
    view = memoryview(payload).cast("B") if len(payload) else b""
    head = pack_header(type, header or {}, len(view), request)
    if len(view) <= 64 << 10:
        data = head + bytes(view)
        sock.sendall(data)
        return len(data)
    sock.sendall(head)
    sock.sendall(view)
    return len(head) + len(view)
