"""Frames, message validation and the authenticated handshake, over real loopback sockets."""

import socket
import struct
import subprocess
import sys
import threading
import time

import msgpack
import pytest

from shardwire.wire import auth
from shardwire.wire.conn import AuthError, Connection, connect, server_handshake
from shardwire.wire.frames import (
    FIXED_SIZE,
    MAGIC,
    PROTOCOL_VERSION,
    FrameError,
    Limits,
    MessageType,
    pack_header,
    read_frame,
    send_frame,
)
from shardwire.wire.messages import (
    MESSAGES,
    Assign,
    Auth,
    Challenge,
    Describe,
    DeviceInfo,
    Devices,
    Error,
    Forward,
    Free,
    Hello,
    Need,
    NextHop,
    Ok,
    OverrideSpec,
    Ping,
    Pong,
    Ready,
    Release,
    Result,
    Sampled,
    StageReport,
    StageSpec,
    TensorSpec,
    Vocab,
    Weights,
    Welcome,
    parse_message,
)


def socket_pair():
    a, b = socket.socketpair()
    return a, b


def raw_frame(mtype=1, header=b"\x80", payload=b"", magic=MAGIC, version=PROTOCOL_VERSION, flags=0, plen=None):
    plen = len(payload) if plen is None else plen
    return struct.pack("<4sHHHHQIQ", magic, version, mtype, flags, 0, 7, len(header), plen) + header + payload


def test_frame_round_trip_with_payload_into_buffer():
    a, b = socket_pair()
    payload = bytes(range(256)) * 1000
    sender = threading.Thread(target=send_frame, args=(a, MessageType.FORWARD, {"x": [1, 2]}, payload, 42))
    sender.start()
    target = bytearray(len(payload))
    frame = read_frame(b, Limits(), lambda t, h, n: target)
    assert frame.type == MessageType.FORWARD and frame.request == 42
    assert frame.header == {"x": [1, 2]} and frame.payload is target and bytes(target) == payload
    sender.join()


@pytest.mark.parametrize(
    "data, message",
    [
        (raw_frame(magic=b"HTTP"), "bad magic"),
        (raw_frame(version=99), "protocol version 99"),
        (raw_frame(mtype=999), "unknown message type"),
        (raw_frame(flags=1), "reserved"),
        (raw_frame(header=b"\xc1"), "malformed msgpack"),
        (raw_frame(header=msgpack.packb([1, 2])), "not a map"),
    ],
)
def test_bad_frames_are_rejected(data, message):
    a, b = socket_pair()
    a.sendall(data)
    with pytest.raises(FrameError, match=message):
        read_frame(b, Limits())


def test_terabyte_payload_is_rejected_before_allocating():
    a, b = socket_pair()
    a.sendall(raw_frame(mtype=MessageType.FORWARD, plen=1 << 40))
    allocated = []
    with pytest.raises(FrameError, match="exceeds the limit"):
        read_frame(b, Limits(), lambda *args: allocated.append(args))
    assert not allocated


def test_oversized_header_is_rejected():
    a, b = socket_pair()
    a.sendall(struct.pack("<4sHHHHQIQ", MAGIC, PROTOCOL_VERSION, 1, 0, 0, 0, 1 << 30, 0))
    with pytest.raises(FrameError, match="header of"):
        read_frame(b, Limits())


def forward_header(**over):
    h = {
        "plan": "p",
        "step": 1,
        "rows": [[0, 0, 3]],
        "pages": [[0]],
        "sampling": [None],
        "recent": [[]],
        "dtype": "int32",
        "shape": [1, 3],
    }
    h.update(over)
    return h


def test_forward_validation():
    assert Forward.parse(forward_header()).payload_nbytes() == 12
    hidden = Forward.parse(forward_header(dtype="bfloat16", shape=[1, 3, 64]))
    assert hidden.payload_nbytes() == 3 * 64 * 2
    bad = [
        forward_header(rows=[]),
        forward_header(rows=[[0, 0]]),
        forward_header(rows=[[0, -1, 3]]),
        forward_header(
            rows=[[0, 0, 3], [1, 0, 2]], pages=[[0], [1]], sampling=[None, None], recent=[[], []], shape=[2, 3]
        ),
        forward_header(dtype="float64"),
        forward_header(shape=[1, 4]),
        forward_header(shape=[1, 3, 1 << 40]),
        forward_header(dtype="float32", shape=[1, 3]),
        forward_header(sampling=[]),
        forward_header(recent=[["x"]]),
        forward_header(step="1"),
        forward_header(rows=[[True, 0, 3]]),
        forward_header(pages=[]),
        forward_header(pages=[[0, 1]]),  # one page more than positions 0-2 need
        forward_header(pages=[[-1]]),
        forward_header(pages=[[True]]),
    ]
    for h in bad:
        with pytest.raises(FrameError):
            Forward.parse(h)


def test_shape_product_overflow_is_rejected():
    # each dimension is bounded, so the product cannot wrap or ask for absurd memory
    with pytest.raises(FrameError):
        Forward.parse(
            forward_header(
                rows=[[0, 0, 1 << 20]], pages=[list(range(1 << 16))], shape=[1, 1 << 20, 1 << 20], dtype="float32"
            )
        )


def tensor_spec(**over):
    d = {
        "name": "blk.0.attn_q.weight",
        "dtype": "F16",
        "shape": [64, 64],
        "nbytes": 8192,
        "hash": "a" * 64,
        "file": "m.gguf",
        "file_size": 10,
        "offset": 0,
    }
    d.update(over)
    return d


def test_tensor_spec_validation():
    TensorSpec.parse(tensor_spec())
    for bad in [
        tensor_spec(file="../etc/passwd"),
        tensor_spec(file="a/b"),
        tensor_spec(hash="zz"),
        tensor_spec(dtype="PICKLE"),
        tensor_spec(shape=[0, 1]),
        tensor_spec(nbytes=-1),
    ]:
        with pytest.raises(FrameError):
            TensorSpec.parse(bad)


def test_assign_stages_must_be_consecutive():
    stage = {
        "index": 0,
        "device": "cpu",
        "start": 0,
        "end": 2,
        "first": True,
        "last": False,
        "dtype": "float32",
        "weights": "dequant",
        "fastest": {},
        "tensors": [tensor_spec()],
        "overrides": [],
    }
    later = dict(stage, index=1, start=3, end=4, first=False)
    h = {
        "plan": "p",
        "coordinator": "c",
        "config": {},
        "qk_interleaved": True,
        "n_slots": 1,
        "ctx": 64,
        "prefill_chunk": 512,
        "kv_pages": 4,
        "stages": [stage, later],
        "next": None,
        "window_step": 512,
    }
    with pytest.raises(FrameError, match="consecutive"):
        Assign.parse(h)
    h["stages"] = [stage, dict(later, start=2)]
    assert len(Assign.parse(h).stages) == 2


# One of each message, as a sender builds it.
SPEC = TensorSpec("blk.0.attn_q.weight", "Q4_K", [64, 256], 9216, "a" * 64, "m.gguf", 123456, 4096)
EXAMPLES = [
    Hello("coordinator", b"n" * 32),
    Challenge(b"c" * 32, "host/1234", True),
    Auth(b"p" * 32),
    Welcome(b""),
    Error("plan", "worker w rejects the plan: too big"),
    Ping(12.5),
    Pong(12.5),
    Pong(12.5, [[0, 3.25], [2, 11.0]]),
    Describe(),
    Release(),
    Ok(),
    Free(3),
    Devices(
        "host/1234",
        "0.1.0",
        [
            DeviceInfo("cpu", 1 << 30, 2 << 30, "bfloat16", True, {"Q4_K": "ggml", "F16": "dense"}, {"F16": "ggml"}),
            DeviceInfo("cuda:0", 5, 9, "float16", False, {}, compute="PyTorch 2.13.0, CUDA 12.8, NVIDIA H100"),
        ],
    ),
    Assign(
        "plan1",
        "coord1",
        {"arch": "llama", "n_layers": 2},
        True,
        4,
        256,
        64,
        64,
        [
            StageSpec(0, "cpu", 0, 1, True, False, "float32", "fast", {"Q4_K": "ggml"}, [SPEC], []),
            StageSpec(
                1,
                "cpu:1",
                1,
                2,
                False,
                True,
                "bfloat16",
                "compact",
                {},
                [],
                [OverrideSpec("_exps", "cpu", "float32", {})],
            ),
        ],
        NextHop("10.0.0.2", 50052, "sha256:" + "b" * 64),
    ),
    Need(["a" * 64, "b" * 64]),
    Weights("a" * 64, 8 << 20, 9 << 20),
    Ready(
        [StageReport(0, 1000, 200), StageReport(1, 50, 20, ["latent attention: absorbed (every row)"])],
        {"file": 10, "cache": 0, "streamed": 5},
    ),
    Forward(
        "plan1",
        7,
        [(0, 0, 4), (2, 10, 4)],
        [[0], [5]],
        [None, {"temperature": 0.0}],
        [[], [1, 2]],
        "float32",
        [2, 4, 16],
    ),
    Result(7, [[], [42], [3, 9]], [None, [[-0.5, [[42, -0.5], [7, -1.25]]]], None]),
    Forward(
        "plan1",
        8,
        [(0, 4, 1), (1, 9, 1)],
        [[3], [1]],
        [{"temperature": 1.0}, {"temperature": 0.0}],
        [[], []],
        "int32",
        [2, 1],
        [{"key": "c" * 64, "consumed": 2, "grammar": '{"grammars": []}', "tokens": [5, 6]}, None],
    ),
    Forward("plan1", 9, [(0, 6, 3)], [[3]], [{"temperature": 0.0}], [[]], "int32", [1, 3], None, [[7, 8]]),
    Vocab("plan1", 3, [2]),
]


def test_every_message_type_has_an_example():
    assert {type(m) for m in EXAMPLES} == set(MESSAGES.values())
    assert set(MESSAGES) == set(MessageType)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_messages_round_trip_through_a_frame(message):
    a, b = socket.socketpair()
    try:
        Connection(a, "a").send(message, request=5)
        frame = read_frame(b, Limits())
    finally:
        a.close()
        b.close()
    assert frame.type == message.TYPE and frame.request == 5
    assert parse_message(frame) == message


def test_result_carries_sampled_tokens_both_ways():
    sampled = [[], [Sampled(42)], [Sampled(9, -0.25, [(9, -0.25), (3, -2.0)]), Sampled(4, -0.5, [(4, -0.5)])]]
    assert Result.of_sampled(3, sampled).sampled() == sampled


@pytest.mark.parametrize(
    "drafts",
    [[[1, 2, 3]], [[1], [2]], [[-1, 2]], [[1.5]], [["a"]], [[True]], "no"],
    ids=["as-many-as-tokens", "more-rows", "negative", "float", "text", "bool", "not-a-list"],
)
def test_a_forward_with_bad_drafts_is_refused(drafts):
    good = Forward("plan1", 9, [(0, 6, 3)], [[3]], [None], [[]], "int32", [1, 3], None, [[7, 8]]).to_wire()
    with pytest.raises(FrameError, match="drafts"):
        Forward.parse({**good, "drafts": drafts})


@pytest.mark.parametrize(
    "stages", [[[0]], [[0, -1.0]], [["0", 1.0]], [[0, float("nan")]], [[True, 1.0]], [[1 << 20, 1.0]], "0"]
)
def test_a_pong_with_bad_stage_times_is_refused(stages):
    with pytest.raises(FrameError, match="PONG"):
        Pong.parse({"t": 1.0, "stages": stages})


@pytest.mark.parametrize("choices", [["x" * 401], [7], ["a"] * 9, "latent attention"])
def test_a_ready_with_bad_choices_is_refused(choices):
    with pytest.raises(FrameError, match="READY stage"):
        Ready.parse({"stages": [{"index": 0, "weight_bytes": 1, "kv_bytes": 1, "choices": choices}], "sources": {}})


@pytest.mark.parametrize(
    "tokens, logprobs",
    [([[1, 2]], [[[-0.5, []]]]), ([[1, -2]], [None]), ([5], [None]), ([[1]], [[[-0.5]]])],
    ids=["fewer-logprobs", "negative", "not-a-list", "short-logprob"],
)
def test_a_bad_result_is_refused(tokens, logprobs):
    with pytest.raises(FrameError, match="RESULT"):
        Result.parse({"step": 1, "tokens": tokens, "logprobs": logprobs})


# -- the handshake -----------------------------------------------------------------------


def serve_once(token, results):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)

    def run():
        sock, addr = listener.accept()
        conn = Connection(sock, "test")
        try:
            results.append(server_handshake(conn, token, "w1"))
        except Exception as e:  # the test inspects what the server saw
            conn.send_error("auth", "authentication failed")
            results.append(e)
        finally:
            conn.close()
            listener.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return listener.getsockname()[1], t


@pytest.mark.parametrize(
    "server_token, client_token, ok",
    [
        ("secret", "secret", True),
        (None, None, True),
        ("secret", "wrong", False),
        ("secret", None, False),
        (None, "secret", False),  # a coordinator with a token never talks to a worker without one
    ],
)
def test_handshake(server_token, client_token, ok):
    results = []
    port, t = serve_once(server_token, results)
    if ok:
        conn, challenge = connect("127.0.0.1", port, token=client_token)
        assert challenge.worker_id == "w1"
        conn.close()
    else:
        with pytest.raises(AuthError):
            connect("127.0.0.1", port, token=client_token)
    t.join(5)
    assert ok == (not isinstance(results[0], Exception))


def test_replayed_auth_is_refused():
    """A recorded AUTH answers an old challenge; the worker's fresh nonce makes it worthless."""
    token = "secret"
    results = []
    port, t = serve_once(token, results)
    old_client_nonce, old_server_nonce = auth.new_nonce(), auth.new_nonce()
    recorded = auth.client_proof(token, old_client_nonce, old_server_nonce)
    sock = socket.create_connection(("127.0.0.1", port))
    conn = Connection(sock, "attacker")
    conn.send(Hello("coordinator", old_client_nonce))
    conn.expect(Challenge)
    conn.send(Auth(recorded))
    with pytest.raises(Exception, match="authentication failed"):
        conn.expect(Welcome)
    t.join(5)
    assert isinstance(results[0], AuthError)


def test_fixed_header_size():
    assert FIXED_SIZE == 32
    assert len(pack_header(MessageType.PING, {}, 0)) == 33


def test_devices_carry_the_compute_dtype_and_kernels_each_device_does_best():
    base = {
        "worker_id": "w",
        "version": "1",
        "devices": [
            {"name": "cpu", "free": 1, "total": 2, "dtype": "bfloat16", "kernels": True, "fastest": {"Q8_0": "ggml"}}
        ],
    }
    assert Devices.parse(base).devices[0] == DeviceInfo("cpu", 1, 2, "bfloat16", True, {"Q8_0": "ggml"})
    measured = dict(
        base["devices"][0], products={"Q8_0": "shardwire", "F16": "ggml"}, row_products={"F16": "shardwire"}
    )
    parsed = Devices.parse(dict(base, devices=[measured])).devices[0]
    assert parsed.products == {"Q8_0": "shardwire", "F16": "ggml"} and parsed.row_products == {"F16": "shardwire"}
    bad_fields = [
        ("row_products", {"F16": "avx"}),
        ("row_products", "shardwire"),
        ("products", {"Q8_0": "tinyblas"}),
        ("products", {"Q9": "ggml"}),
        ("products", ["Q8_0"]),
        ("dtype", "int4"),
        ("kernels", "yes"),
        ("dtype", None),
        ("fastest", {"Q8_0": "pickle"}),
        ("fastest", {"Q9": "ggml"}),
        ("fastest", None),
    ]
    for field, bad in bad_fields:
        devices = [dict(base["devices"][0], **{field: bad})]
        with pytest.raises(FrameError, match=field):
            Devices.parse(dict(base, devices=devices))


def test_assign_override_patterns_are_checked():
    stage = dict(
        index=0, device="cpu", start=0, end=1, first=True, last=True, dtype="float32", weights="dequant", fastest={}
    )
    override = {"pattern": "ffn_(", "device": "cpu", "dtype": "float32", "fastest": {}}
    with pytest.raises(FrameError, match="not a regular expression"):
        StageSpec.parse(dict(stage, tensors=[], overrides=[override]))
    with pytest.raises(FrameError, match="'overrides' has more than 64"):
        StageSpec.parse(dict(stage, tensors=[], overrides=[dict(override, pattern="x")] * 65))


def test_a_connection_says_whether_a_frame_is_waiting_asleep_or_spinning():
    """readable(): False once `seconds` pass with nothing sent, whether it sleeps in poll or spins;
    True as soon as a frame's bytes are there, which the next recv() reads whole."""
    ours, theirs = socket.socketpair()
    conn, peer = Connection(ours, "peer"), Connection(theirs, "us")
    try:
        for spin in (False, True):
            started = time.monotonic()
            assert not conn.readable(0.05, spin=spin)
            assert time.monotonic() - started >= 0.04
        threading.Timer(0.05, lambda: peer.send(Ping(1.5))).start()
        assert conn.readable(5, spin=True)
        assert conn.readable(0)
        assert parse_message(conn.recv()) == Ping(1.5)
    finally:
        ours.close()
        theirs.close()


def test_a_closed_connection_is_readable_so_that_recv_reports_it():
    """A link closed under a reader waiting in readable() (another coordinator took the worker
    over) ends the wait at once; the recv() after it raises, as a reader's recv always did."""
    ours, theirs = socket.socketpair()
    conn = Connection(ours, "peer")
    conn.close()
    started = time.monotonic()
    assert conn.readable(5, spin=True)
    assert time.monotonic() - started < 1
    with pytest.raises((OSError, ConnectionError)):
        conn.recv()
    theirs.close()


def test_message_numbers_and_the_protocol_version_are_pinned():
    """Both sides of a link agree on these numbers: changing one is a new PROTOCOL_VERSION, with a
    line of its history in frames.py."""
    assert PROTOCOL_VERSION == 8
    assert {m.name: m.value for m in MessageType} == {
        "HELLO": 1,
        "CHALLENGE": 2,
        "AUTH": 3,
        "WELCOME": 4,
        "ERROR": 5,
        "DESCRIBE": 6,
        "DEVICES": 7,
        "ASSIGN": 8,
        "NEED": 9,
        "WEIGHTS": 10,
        "READY": 11,
        "FORWARD": 12,
        "RESULT": 13,
        "FREE": 14,
        "PING": 15,
        "PONG": 16,
        "RELEASE": 17,
        "OK": 18,
        "VOCAB": 19,
    }


def test_the_wire_imports_neither_torch_nor_the_grammar_library():
    """wire/ is a leaf: the standard library, msgpack and shardwire.enums (and state, for TLS files)."""
    code = (
        "import sys, shardwire.wire.messages, shardwire.wire.conn, shardwire.wire.tls\n"
        "own = ('shardwire.wire', 'shardwire.enums', 'shardwire.state')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'llguidance')"
        " or m.startswith('shardwire.') and not m.startswith(own)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
