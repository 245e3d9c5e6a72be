"""Tokens, TLS and a worker that refuses strangers before any model command runs."""

import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from shardwire.coordinator import Cluster
from shardwire.formats import open_model
from shardwire.wire.conn import AuthError, Connection, RemoteError, connect
from shardwire.wire.frames import FrameError
from shardwire.wire.messages import Auth, Challenge, Describe, Devices, Hello, Welcome
from shardwire.wire.tls import TRUST_ON_FIRST_USE, ClientTLS, KnownHosts, TLSError, generate_certificate

from models import model_path
from runs import distributed, single_process
from workers import WorkerProcess

pytestmark = pytest.mark.slow  # worker processes

TOKEN = "correct horse battery staple"


@pytest.fixture
def certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("certs")
    return {
        name: generate_certificate(folder, ["127.0.0.1", "localhost"], name=name)
        for name in ("w1", "w2", "coord", "stranger")
    }


@pytest.fixture
def pool(tmp_path):
    started = []

    def start(**kw):
        w = WorkerProcess(tmp_path / f"cache{len(started)}", **kw).start()
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


PLAIN = ("--no-tls",)  # the handshake itself, read and written by hand below


def tls_args(cert):
    return ("--tls-cert", str(cert[0]), "--tls-key", str(cert[1]))


def assert_no_model_command_ran(conn: Connection):
    """After a refused handshake nothing is served: a DESCRIBE gets no DEVICES back."""
    try:
        conn.send(Describe())
        frame = conn.recv()
    except RemoteError as e:  # an error reply, then the connection closes
        assert "expected AUTH" in str(e)
        with pytest.raises((OSError, ConnectionError)):
            conn.recv()
        return
    except (OSError, ConnectionError, FrameError):
        return
    pytest.fail(f"worker answered {frame.type.name} after a refused handshake")


@pytest.mark.parametrize("client_token", [None, "wrong token"])
def test_missing_or_wrong_token_is_refused(pool, client_token):
    worker = pool(token=TOKEN, extra=PLAIN)
    with pytest.raises(AuthError):
        connect("127.0.0.1", worker.port, token=client_token)
    # A client that skips AUTH and goes straight for a model command is cut off.
    sock = socket.create_connection(("127.0.0.1", worker.port))
    conn = Connection(sock, "raw")
    conn.send(Hello("coordinator", b"x" * 32))
    conn.expect(Challenge)
    assert_no_model_command_ran(conn)
    good, _ = connect("127.0.0.1", worker.port, token=TOKEN)  # the worker still serves the right token
    good.send(Describe())
    assert good.expect(Devices).devices


def test_replayed_handshake_is_refused(pool):
    """Record a real client's AUTH, replay it on a new connection: the worker's nonce changed."""
    worker = pool(token=TOKEN, extra=PLAIN)
    from shardwire.wire import auth

    sock = socket.create_connection(("127.0.0.1", worker.port))
    conn = Connection(sock, "victim")
    nonce = auth.new_nonce()
    conn.send(Hello("coordinator", nonce))
    challenge = conn.expect(Challenge)
    recorded = auth.client_proof(TOKEN, nonce, challenge.nonce)
    conn.close()

    sock = socket.create_connection(("127.0.0.1", worker.port))
    replay = Connection(sock, "attacker")
    replay.send(Hello("coordinator", nonce))
    replay.expect(Challenge)
    replay.send(Auth(recorded))
    with pytest.raises(Exception, match="authentication failed"):
        replay.expect(Welcome)


def test_plain_tcp_client_against_a_tls_worker(pool, certs):
    worker = pool(extra=tls_args(certs["w1"]))
    with pytest.raises((ConnectionError, FrameError, OSError)):
        connect("127.0.0.1", worker.port, token=None)
    pin = certs["w1"][2]
    conn, _ = connect("127.0.0.1", worker.port, token=None, tls=ClientTLS(pins={pin}))
    conn.close()


def test_tls_client_refuses_a_certificate_it_does_not_trust(pool, certs):
    worker = pool(extra=tls_args(certs["stranger"]))
    with pytest.raises(TLSError, match="not trusted"):
        connect("127.0.0.1", worker.port, token=None, tls=ClientTLS(pins={certs["w1"][2]}))
    with pytest.raises(TLSError, match="handshake failed"):
        connect("127.0.0.1", worker.port, token=None, tls=ClientTLS(ca=certs["w1"][0]))


def test_mutual_tls_requires_a_client_certificate(pool, certs):
    worker = pool(extra=tls_args(certs["w1"]) + ("--tls-ca", str(certs["coord"][0])))
    pin = certs["w1"][2]
    with pytest.raises((TLSError, ConnectionError, OSError)):
        conn, _ = connect("127.0.0.1", worker.port, token=None, tls=ClientTLS(pins={pin}))
        conn.send(Describe())
        conn.expect(Devices)
    conn, _ = connect(
        "127.0.0.1", worker.port, token=None, tls=ClientTLS(pins={pin}, cert=certs["coord"][0], key=certs["coord"][1])
    )
    conn.close()


def test_token_and_tls_end_to_end_give_the_same_tokens(pool, certs, tmp_path):
    path = model_path("llama", "Q8_0")
    w1 = pool(token=TOKEN, extra=tls_args(certs["w1"]))
    w2 = pool(token=TOKEN, extra=tls_args(certs["w2"]))
    tls = ClientTLS(pins={certs["w1"][2], certs["w2"][2]})
    model = open_model(path)
    cluster = Cluster([w1.address, w2.address], token=TOKEN, tls=tls, cache_dir=tmp_path, show_progress=False)
    try:
        cluster.connect(model)
        assert [l.fingerprint for l in cluster.links] == [certs["w1"][2], certs["w2"][2]]
        pipeline = cluster.load(cluster.make_plan(ctx=256, dtype="float32"))
        from runs import generate

        tokens, _ = generate(pipeline)
    finally:
        cluster.close()
    assert tokens == single_process(path)[0]


def test_coordinator_stage_speaks_tls_to_remote_workers(pool, certs, tmp_path):
    """-ngl keeps a stage on the coordinator, whose in-process worker reaches w1 over TLS."""
    path = model_path("qwen2", "F32")
    w1 = pool(token=TOKEN, extra=tls_args(certs["w1"]))
    (tokens, _), plan, _ = distributed(
        path, [w1.address], tmp_path, n_gpu_layers=2, token=TOKEN, tls=ClientTLS(pins={certs["w1"][2]})
    )
    assert [s.device.worker for s in plan.stages] == ["local:cpu", w1.address]
    assert tokens == single_process(path)[0]


def test_listening_beyond_loopback_needs_a_token_or_insecure(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "shardwire",
        "worker",
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--cache-dir",
        str(tmp_path),
    ]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0
    assert "without authentication" in refused.stderr and "--insecure" in refused.stderr
    w = WorkerProcess(tmp_path, extra=("--insecure",), host="0.0.0.0")
    w.start()
    try:
        assert any("WITHOUT authentication" in line for line in w.log)
    finally:
        w.stop()


def test_repeated_failures_are_slowed_down(pool):
    worker = pool(token=TOKEN)
    for _ in range(3):
        with pytest.raises(AuthError):
            connect("127.0.0.1", worker.port, token="guess", tls=TRUST_ON_FIRST_USE)
    start = time.monotonic()
    with pytest.raises(AuthError):
        connect("127.0.0.1", worker.port, token="guess", tls=TRUST_ON_FIRST_USE)
    assert time.monotonic() - start >= 0.9


def test_the_token_never_appears_in_worker_output(pool, tmp_path):
    worker = pool(token=TOKEN)
    with pytest.raises(AuthError):
        connect("127.0.0.1", worker.port, token="wrong", tls=TRUST_ON_FIRST_USE)
    conn, _ = connect("127.0.0.1", worker.port, token=TOKEN, tls=TRUST_ON_FIRST_USE)
    conn.close()
    worker.stop()
    time.sleep(0.2)
    assert TOKEN not in "".join(worker.log)


def test_a_fresh_worker_speaks_tls_with_nothing_set_up(tmp_path):
    """A worker with no certificate makes one on first start (several starting at once agree on
    one), prints its fingerprint, and a coordinator with only the token gets a TLS link to it,
    pinned in its known hosts."""
    state = {"SHARDWIRE_STATE_DIR": str(tmp_path / "state")}
    workers = [WorkerProcess(tmp_path / f"cache{i}", token=TOKEN, env=state, host="0.0.0.0") for i in range(3)]
    threads = [threading.Thread(target=w.start) for w in workers]  # they race to make the certificate
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        printed = {FINGERPRINT.search("".join(w.log))[0] for w in workers}
        assert len(printed) == 1
        (fingerprint,) = printed
        known = tmp_path / "known"
        tls = ClientTLS(known_hosts=KnownHosts(known))
        cluster = Cluster([workers[0].address], token=TOKEN, tls=tls, cache_dir=tmp_path, show_progress=False)
        try:
            cluster.connect(open_model(model_path("llama", "Q8_0")))
            assert cluster.status()["workers"][0]["tls"] == fingerprint
        finally:
            cluster.close()
        assert known.read_text() == f"{workers[0].address} {fingerprint}\n"
    finally:
        for w in workers:
            w.stop()


FINGERPRINT = re.compile(r"sha256:[0-9a-f]{64}")


def test_a_swapped_certificate_at_the_same_address_is_refused(pool, certs, tmp_path):
    known = KnownHosts(tmp_path / "known_hosts")
    worker = pool(token=TOKEN)
    conn, _ = connect("127.0.0.1", worker.port, token=TOKEN, tls=ClientTLS(known_hosts=known))
    conn.close()
    port = worker.port
    worker.stop()
    impostor = pool(token=TOKEN, port=port, extra=tls_args(certs["stranger"]))
    with pytest.raises(TLSError, match="intercepting") as refused:
        connect("127.0.0.1", impostor.port, token=TOKEN, tls=ClientTLS(known_hosts=known))
    assert f"remove the line for 127.0.0.1:{port}" in str(refused.value) and certs["stranger"][2] in str(refused.value)
    # Accepting the new certificate is the user's explicit step, as the message says.
    conn, _ = connect("127.0.0.1", impostor.port, token=TOKEN, tls=ClientTLS(pins={certs["stranger"][2]}))
    conn.close()


def test_tls_on_one_side_only_says_how_to_match_them(pool):
    plain = pool(token=TOKEN, extra=PLAIN)
    with pytest.raises(TLSError, match="--no-tls"):
        connect("127.0.0.1", plain.port, token=TOKEN, tls=TRUST_ON_FIRST_USE)
    tls = pool(token=TOKEN)
    with pytest.raises(ConnectionError, match="--no-tls"):
        connect("127.0.0.1", tls.port, token=TOKEN, tls=None)
    conn, _ = connect("127.0.0.1", plain.port, token=TOKEN, tls=None)  # --no-tls on both: plain TCP
    assert conn.fingerprint is None
    conn.close()
