"""TLS for every link, with the standard library's ssl: a CA, or pinned certificate
fingerprints for people without one."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import logging
import os
import shutil
import socket
import ssl
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..state import state_dir

log = logging.getLogger("shardwire.tls")


class TLSError(ConnectionError):
    """A peer whose certificate is not trusted, or a TLS set-up that cannot work."""


def fingerprint(der: bytes) -> str:
    return "sha256:" + hashlib.sha256(der).hexdigest()


def normalize_pin(pin: str) -> str:
    value = pin.strip().lower().removeprefix("sha256:").replace(":", "")
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise ValueError(f"'{pin}' is not a sha256 certificate fingerprint (64 hex digits)")
    return "sha256:" + value


@dataclass
class ServerTLS:
    """A worker's side: its certificate, and optionally the CA its clients must present a
    certificate from (mutual TLS)."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        if self.client_ca is not None:
            ctx.load_verify_locations(self.client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def fingerprint(self) -> str:
        return fingerprint(ssl.PEM_cert_to_DER_cert(Path(self.cert).read_text()))


@dataclass
class ClientTLS:
    """A connecting side (coordinator, or a worker reaching the next stage): trust a CA, or
    exactly the pinned fingerprints, or else (with `known_hosts`) what each address showed on
    first contact; present a certificate of its own for mutual TLS."""

    ca: Path | None = None
    pins: set[str] = field(default_factory=set)
    cert: Path | None = None
    key: Path | None = None
    known_hosts: KnownHosts | None = None

    def context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.ca is not None:
            ctx.load_verify_locations(self.ca)
        else:
            # Trust comes from the pinned fingerprint, checked right after the handshake.
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.cert is not None:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def check(self, sock: ssl.SSLSocket, peer: str, pin: str | None = None) -> str:
        """The peer's fingerprint, after making sure it is one we trust."""
        der = sock.getpeercert(binary_form=True)
        if der is None:
            raise TLSError(f"{peer}: presented no certificate")
        seen = fingerprint(der)
        allowed = set(self.pins) | ({pin} if pin else set())
        if self.ca is None and not allowed and self.known_hosts is not None:
            self.known_hosts.check(peer, seen)
            return seen
        if self.ca is None and seen not in allowed:
            raise TLSError(f"{peer}: certificate {seen} is not trusted (not a pinned fingerprint)")
        if self.ca is not None and pin and seen != pin:
            raise TLSError(f"{peer}: certificate {seen} is not the one the plan names")
        return seen


def generate_certificate(
    out_dir: Path, hosts: list[str], days: int = 3650, name: str = "shardwire"
) -> tuple[Path, Path, str]:
    """A self-signed certificate and key for `hosts` (names and IP addresses);
    returns (cert path, key path, fingerprint)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    alt = []
    for h in hosts or ["localhost", "127.0.0.1"]:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            alt.append(x509.DNSName(h))
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out_dir / f"{name}.crt", out_dir / f"{name}.key"
    key_path.touch(mode=0o600)
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path, fingerprint(cert.public_bytes(serialization.Encoding.DER))


class KnownHosts:
    """Worker certificates pinned on first contact, one `host:port sha256:...` per line, as ssh's
    known_hosts: a worker seen before must present the same certificate again."""

    def __init__(self, path: Path | None = None):
        self._path = path

    @property
    def path(self) -> Path:
        return Path(self._path) if self._path is not None else state_dir() / "known_hosts"

    def _entries(self, address: str) -> set[str]:
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return set()
        return {fp for name, _, fp in (line.partition(" ") for line in lines) if name == address}

    def check(self, address: str, seen: str) -> None:
        """Accept `seen` for `address` if it was pinned before, or pin it now if nothing was."""
        known = self._entries(address)
        if seen in known:
            return
        if known:
            raise TLSError(
                f"{address} presented certificate {seen}, but {', '.join(sorted(known))} was pinned for it on "
                f"first contact ({self.path}). Someone may be intercepting this link. If the worker's "
                f"certificate changed on purpose (a new state folder or machine), remove the line for {address} "
                f"from {self.path}, or pass --tls-pin {seen}"
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:  # one short append: concurrent coordinators cannot interleave it
            f.write(f"{address} {seen}\n")
        log.warning("%s: pinned its certificate %s on first contact (%s)", address, seen, self.path)


def own_certificate(folder: Path) -> ServerTLS:
    """This machine's worker certificate in `folder`, made on first use. Several workers starting
    at once race to create it; exactly one folder wins and all use that one."""
    final = Path(folder) / "tls"
    if not (final / "worker.crt").exists():
        final.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="tls-", dir=final.parent))
        _, _, fp = generate_certificate(scratch, [socket.gethostname(), "localhost", "127.0.0.1"], name="worker")
        try:
            os.rename(scratch, final)
            log.info("made this worker's TLS certificate %s in %s", fp, final)  # its start line shows it
        except OSError:  # another worker made it first
            shutil.rmtree(scratch, ignore_errors=True)
    return ServerTLS(final / "worker.crt", final / "worker.key")


# Coordinators' default: each worker's certificate pinned on first contact, as ssh does.
TRUST_ON_FIRST_USE = ClientTLS(known_hosts=KnownHosts())
