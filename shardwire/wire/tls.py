"""TLS for every link, with the standard library's ssl: a CA, or pinned certificate
fingerprints for people without one."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import ssl
from dataclasses import dataclass, field
from pathlib import Path


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
    exactly the pinned fingerprints; present a certificate of its own for mutual TLS."""

    ca: Path | None = None
    pins: set[str] = field(default_factory=set)
    cert: Path | None = None
    key: Path | None = None

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
        if self.ca is None and seen not in allowed:
            raise TLSError(f"{peer}: certificate {seen} is not trusted (not a pinned fingerprint)")
        if self.ca is not None and pin and seen != pin:
            raise TLSError(f"{peer}: certificate {seen} is not the one the plan names")
        return seen

    def with_pin(self, pin: str | None) -> "ClientTLS":
        return ClientTLS(self.ca, set(self.pins) | ({pin} if pin else set()), self.cert, self.key)


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
