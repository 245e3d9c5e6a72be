"""Malformed input: property tests of the decoders, and a bounded live fuzz run against a
worker process that must keep serving correctly afterwards."""

import random
import socket
import struct
import time

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwire.coordinator import Cluster
from shardwire.formats import open_model
from shardwire.wire.conn import Connection, connect
from shardwire.wire.frames import (
    MAGIC,
    PROTOCOL_VERSION,
    FrameError,
    Limits,
    MessageType,
    decode_header,
    pack_header,
    parse_fixed,
    read_frame,
)
from shardwire.wire.messages import MESSAGES, Assign, StageSpec, TensorSpec

from models import model_path
from runs import generate, single_process
from workers import WorkerProcess

PARSERS = list(MESSAGES.values())

leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=40),
)
values = st.recursive(
    leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)),
    max_leaves=30,
)
FIELDS = [
    "role",
    "nonce",
    "proof",
    "worker_id",
    "auth",
    "code",
    "message",
    "devices",
    "version",
    "plan",
    "config",
    "qk_interleaved",
    "n_slots",
    "ctx",
    "stages",
    "next",
    "hashes",
    "hash",
    "offset",
    "total",
    "step",
    "rows",
    "pages",
    "sampling",
    "recent",
    "dtype",
    "shape",
    "tokens",
    "logprobs",
    "slot",
    "name",
    "free",
    "t",
    "sources",
    "prefill_chunk",
    "coordinator",
    "kernels",
    "weights",
]
headers = st.dictionaries(st.sampled_from(FIELDS), values, max_size=12)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(headers)
def test_message_parsers_only_raise_frame_errors(header):
    for parser in PARSERS:
        try:
            parser.parse(header)
        except FrameError:
            pass


@settings(max_examples=400, deadline=None)
@given(st.binary(min_size=32, max_size=32))
def test_fixed_header_parser_only_raises_frame_errors(raw):
    try:
        mtype, _, hlen, plen = parse_fixed(raw, Limits())
    except FrameError:
        return
    assert hlen <= Limits().max_header and plen <= Limits().max_payload


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_msgpack_header_decoder_only_raises_frame_errors(raw):
    try:
        assert isinstance(decode_header(raw, Limits()), dict)
    except FrameError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_read_frame_on_arbitrary_bytes(raw):
    a, b = socket.socketpair()
    a.sendall(raw)
    a.close()
    try:
        read_frame(b, Limits())
    except (FrameError, ConnectionError):
        pass
    finally:
        b.close()


# -- a live worker ---------------------------------------------------------------------------

TOKEN = "fuzz-token"


def valid_frames(plan_id: str) -> list[bytes]:
    forward = {
        "plan": plan_id,
        "step": 1,
        "rows": [[0, 0, 4]],
        "pages": [[0]],
        "sampling": [None],
        "recent": [[]],
        "dtype": "int32",
        "shape": [1, 4],
    }
    return [
        pack_header(MessageType.HELLO, {"role": "coordinator", "nonce": b"n" * 32}, 0),
        pack_header(MessageType.DESCRIBE, {}, 0),
        pack_header(MessageType.PING, {"t": 1.0}, 0),
        pack_header(MessageType.FREE, {"slot": 0}, 0),
        pack_header(MessageType.FORWARD, forward, 16) + struct.pack("<4i", 1, 2, 3, 4),
        pack_header(MessageType.FORWARD, dict(forward, rows=[[99, 0, 4]]), 16) + b"\0" * 16,
        pack_header(MessageType.FORWARD, dict(forward, drafts=[[5, 6, 7]]), 16) + struct.pack("<4i", 1, 5, 6, 7),
        pack_header(MessageType.FORWARD, dict(forward, shape=[1, 4, 1 << 20], dtype="float32"), 0),
        pack_header(MessageType.WEIGHTS, {"hash": "a" * 64, "offset": 0, "total": 8}, 8) + b"x" * 8,
        pack_header(MessageType.ASSIGN, {"plan": "x", "config": {}, "stages": []}, 0),
    ]


def mutate(frame: bytes, rng: random.Random) -> bytes:
    data = bytearray(frame)
    kind = rng.randrange(5)
    if kind == 0 and data:  # flip bits
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == 1:  # truncate
        data = data[: rng.randrange(len(data) + 1)]
    elif kind == 2:  # lie about lengths
        struct.pack_into("<IQ", data, 20, rng.choice([0, 1, 1 << 20, 1 << 31]), rng.choice([0, 7, 1 << 40, 2**64 - 1]))
    elif kind == 3:  # random type
        struct.pack_into("<H", data, 6, rng.randrange(0, 40))
    else:  # garbage msgpack of the right length
        junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        data = (
            bytearray(struct.pack("<4sHHHHQIQ", MAGIC, PROTOCOL_VERSION, rng.randrange(1, 19), 0, 0, 0, len(junk), 0))
            + junk
        )
    return bytes(data)


# The frames themselves are fuzzed, so the worker speaks plain TCP: through TLS, random bytes
# would only reach OpenSSL's record layer.
PLAIN = ("--no-tls",)


def authenticated(port: int) -> Connection:
    conn, _ = connect("127.0.0.1", port, token=TOKEN, role="peer")
    return conn


def send_and_drop(port: int, payload: bytes, authed: bool) -> bool:
    """Whether `payload` went out (past the handshake, when `authed`)."""
    try:
        conn = authenticated(port) if authed else Connection(socket.create_connection(("127.0.0.1", port), 2), "f")
        conn.sock.settimeout(0.05)
        conn.sock.sendall(payload)
        try:
            conn.sock.recv(4096)
        except (socket.timeout, OSError):
            pass
        conn.close()
        return True
    except (OSError, ConnectionError):
        return False


@pytest.mark.slow
def test_live_fuzz_leaves_the_worker_serving(tmp_path):
    path = model_path("llama", "Q8_0")
    worker = WorkerProcess(tmp_path / "cache", token=TOKEN, extra=PLAIN).start()
    try:
        model = open_model(path)
        cluster = Cluster([worker.address], token=TOKEN, cache_dir=tmp_path / "coord", tls=None, show_progress=False)
        cluster.connect(model)
        pipeline = cluster.load(cluster.make_plan(ctx=256, dtype="float32"))
        proc = psutil.Process(worker.proc.pid)
        rss_before = proc.memory_info().rss
        rng = random.Random(1234)
        frames = valid_frames(cluster.plan_id)
        sent = {"random": 0, "mutated": 0, "authenticated": 0}
        deadline = time.monotonic() + 60
        for i in range(1500):
            if time.monotonic() > deadline:
                break
            choice = rng.random()
            if choice < 0.2:
                send_and_drop(worker.port, bytes(rng.randrange(256) for _ in range(rng.randint(1, 200))), False)
                sent["random"] += 1
            elif choice < 0.6:
                send_and_drop(worker.port, mutate(rng.choice(frames), rng), False)
                sent["mutated"] += 1
            else:  # past the handshake: frames reach the plan's own checks
                batch = b"".join(mutate(rng.choice(frames), rng) for _ in range(rng.randint(1, 4)))
                sent["authenticated"] += send_and_drop(worker.port, batch, True)
        total = sum(sent.values())
        print(
            f"live fuzz: {total} connections {sent}, worker RSS "
            f"{rss_before / 2**20:.1f} -> {proc.memory_info().rss / 2**20:.1f} MiB"
        )
        assert worker.proc.poll() is None, "".join(worker.log[-30:])
        assert total >= 1000 and sent["authenticated"] >= 0.3 * total
        tokens, _ = generate(pipeline)
        assert tokens == single_process(path)[0]
        assert proc.memory_info().rss - rss_before < 64 << 20
        cluster.close()
    finally:
        worker.stop()


@pytest.mark.slow
def test_oversized_and_out_of_plan_requests_are_rejected_without_allocating(tmp_path):
    path = model_path("llama", "F32")
    worker = WorkerProcess(tmp_path / "cache", token=TOKEN, extra=PLAIN).start()
    try:
        cluster = Cluster([worker.address], token=TOKEN, cache_dir=tmp_path / "coord", tls=None, show_progress=False)
        cluster.connect(open_model(path))
        pipeline = cluster.load(cluster.make_plan(ctx=256, dtype="float32"))
        proc = psutil.Process(worker.proc.pid)
        rss_before = proc.memory_info().rss
        forward = {
            "plan": cluster.plan_id,
            "step": 9,
            "rows": [[0, 0, 4]],
            "pages": [[0]],
            "sampling": [None],
            "recent": [[]],
            "dtype": "int32",
            "shape": [1, 4],
        }
        cases = {
            "a 1 TB payload": (MessageType.FORWARD, forward, 1 << 40, "exceeds the limit"),
            "a shape whose product overflows": (
                MessageType.FORWARD,
                dict(forward, dtype="float32", shape=[1, 4, 1 << 20], rows=[[0, 0, 4]]),
                16,
                "does not match|elements|hidden size",
            ),
            "a slot outside the plan": (MessageType.FORWARD, dict(forward, rows=[[7, 0, 4]]), 16, "slot 7"),
            "positions past the context": (
                MessageType.FORWARD,
                dict(forward, rows=[[0, 300, 4]], pages=[list(range(19))]),
                16,
                "exceed the context",
            ),
            "a page outside the pool": (
                MessageType.FORWARD,
                dict(forward, pages=[[1 << 20]]),
                16,
                "outside the plan's pool",
            ),
            "too few pages": (
                MessageType.FORWARD,
                dict(forward, rows=[[0, 14, 4]]),
                16,
                "pages must be the 2 page ids",
            ),
        }
        for what, (mtype, header, plen, message) in cases.items():
            conn = authenticated(worker.port)
            conn.sock.sendall(pack_header(mtype, header, plen))
            with pytest.raises(Exception, match=message):
                conn.recv()
            conn.close()
        # an ASSIGN with a layer outside the model, from a second coordinator: refused
        conn, _ = connect("127.0.0.1", worker.port, token=TOKEN)
        spec = TensorSpec("blk.9.attn_q.weight", "F32", [256, 256], 262144, "a" * 64, "x.gguf", 1, 0)
        stage = StageSpec(0, "cpu", 8, 10, False, False, "float32", "dequant", {}, [spec], [])
        conn.send(Assign("evil", "another", open_model(path).config.to_dict(), True, 1, 64, 512, 4, [stage], None))
        with pytest.raises(Exception, match="rejects the plan"):
            conn.recv()
        conn.close()
        assert proc.memory_info().rss - rss_before < 16 << 20
        tokens, _ = generate(pipeline)
        assert tokens == single_process(path)[0]
        cluster.close()
    finally:
        worker.stop()
