"""What TLS a worker and a coordinator get from their command-line options, and the known hosts
a coordinator pins workers in (no processes: the handshakes themselves are in test_security)."""

import argparse

import pytest

from shardwire.wire.options import add_client_tls_args, add_worker_tls_args, client_tls, server_tls
from shardwire.wire.tls import KnownHosts, TLSError, generate_certificate

A, B = "sha256:" + "a" * 64, "sha256:" + "b" * 64


def parse(add, *argv):
    p = argparse.ArgumentParser()
    add(p.add_argument_group() if add is add_client_tls_args else p)
    return p.parse_args(argv)


def test_a_worker_makes_its_certificate_once_and_keeps_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWIRE_STATE_DIR", str(tmp_path))
    first = server_tls(parse(add_worker_tls_args))
    again = server_tls(parse(add_worker_tls_args))
    assert first.cert.parent == tmp_path / "tls" and first.fingerprint() == again.fingerprint()
    assert (first.key.stat().st_mode & 0o777) == 0o600
    assert server_tls(parse(add_worker_tls_args, "--no-tls")) is None


def test_a_coordinator_pins_on_first_use_unless_told_whom_to_trust(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWIRE_STATE_DIR", str(tmp_path))
    default = client_tls(parse(add_client_tls_args))
    assert default.known_hosts.path == tmp_path / "known_hosts" and not default.pins and default.ca is None
    pinned = client_tls(parse(add_client_tls_args, "--tls-pin", A))
    assert pinned.pins == {A} and pinned.known_hosts is None
    assert client_tls(parse(add_client_tls_args, "--no-tls")) is None


@pytest.mark.parametrize(
    "add, argv",
    [
        (add_worker_tls_args, ("--no-tls", "--tls-cert", "c.pem", "--tls-key", "k.pem")),
        (add_worker_tls_args, ("--no-tls", "--tls-ca", "ca.pem")),
        (add_client_tls_args, ("--no-tls", "--tls-pin", A)),
    ],
)
def test_no_tls_beside_tls_options_is_an_error(add, argv):
    with pytest.raises(ValueError, match="contradict"):
        (server_tls if add is add_worker_tls_args else client_tls)(parse(add, *argv))


def test_known_hosts_pin_the_first_certificate_and_refuse_another(tmp_path):
    hosts = KnownHosts(tmp_path / "state" / "known_hosts")
    hosts.check("10.0.0.2:50052", A)
    hosts.check("10.0.0.2:50052", A)
    hosts.check("10.0.0.3:50052", B)  # another address is another worker
    with pytest.raises(TLSError, match=r"remove the line for 10\.0\.0\.2:50052") as refused:
        hosts.check("10.0.0.2:50052", B)
    assert f"--tls-pin {B}" in str(refused.value)
    assert hosts.path.read_text() == f"10.0.0.2:50052 {A}\n10.0.0.3:50052 {B}\n"


def test_a_worker_certificate_given_by_hand_is_used_as_given(tmp_path):
    cert, key, fingerprint = generate_certificate(tmp_path, ["127.0.0.1"])
    tls = server_tls(parse(add_worker_tls_args, "--tls-cert", str(cert), "--tls-key", str(key)))
    assert tls.fingerprint() == fingerprint
