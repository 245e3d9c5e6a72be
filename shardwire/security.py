"""Command-line options for tokens and TLS, shared by the worker and the coordinator commands."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from .wire.tls import ClientTLS, ServerTLS, normalize_pin

log = logging.getLogger("shardwire.security")

TOKEN_ENV = "SHARDWIRE_TOKEN"


def add_token_args(g) -> None:
    g.add_argument("--token-file", default=None, help=f"file holding the shared token (or set env {TOKEN_ENV})")
    g.add_argument(
        "--token",
        default=None,
        help="the shared token itself; visible to other users in the "
        f"process list, prefer --token-file or env {TOKEN_ENV}",
    )


def add_worker_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security")
    add_token_args(g)
    g.add_argument(
        "--insecure", action="store_true", help="allow listening beyond loopback without a token (not recommended)"
    )
    g.add_argument("--tls-cert", default=None, help="serve TLS with this certificate (PEM); see `shardwire certs`")
    g.add_argument("--tls-key", default=None, help="private key of --tls-cert (PEM)")
    g.add_argument(
        "--tls-ca",
        default=None,
        help="require clients to present a certificate from this CA (mutual TLS); also used to verify the next worker",
    )


def add_client_tls_args(g) -> None:
    add_token_args(g)
    g.add_argument("--tls-ca", default=None, help="connect with TLS, trusting workers whose certificate this CA signed")
    g.add_argument(
        "--tls-pin",
        default=None,
        help="connect with TLS, trusting exactly these worker certificate fingerprints "
        "(comma-separated sha256:..., as `shardwire certs` prints them)",
    )
    g.add_argument("--tls-cert", default=None, help="this side's certificate, for workers that require mutual TLS")
    g.add_argument("--tls-key", default=None, help="private key of --tls-cert")


def resolve_token(args: argparse.Namespace) -> str | None:
    """--token-file, then env, then --token. The token is never logged or printed."""
    if getattr(args, "token_file", None):
        token = Path(args.token_file).read_text().strip()
        if not token:
            raise ValueError(f"{args.token_file}: the token file is empty")
        return token
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    if getattr(args, "token", None):
        log.warning(
            "--token on the command line is visible to other users of this machine; prefer --token-file or env %s",
            TOKEN_ENV,
        )
        return args.token
    return None


def _pair(args, what: str) -> tuple[Path | None, Path | None]:
    cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
    if bool(cert) != bool(key):
        raise ValueError(f"{what}: --tls-cert and --tls-key go together")
    return (Path(cert), Path(key)) if cert else (None, None)


def server_tls(args: argparse.Namespace) -> ServerTLS | None:
    cert, key = _pair(args, "worker")
    if cert is None:
        if args.tls_ca:
            raise ValueError("--tls-ca on a worker needs --tls-cert/--tls-key: mutual TLS runs over TLS")
        return None
    return ServerTLS(cert, key, Path(args.tls_ca) if args.tls_ca else None)


def client_tls(args: argparse.Namespace) -> ClientTLS | None:
    cert, key = _pair(args, "coordinator")
    pins = {normalize_pin(p) for p in (args.tls_pin or "").split(",") if p.strip()}
    if not args.tls_ca and not pins:
        if cert is not None:
            raise ValueError("--tls-cert needs --tls-ca or --tls-pin to say which workers to trust")
        return None
    return ClientTLS(Path(args.tls_ca) if args.tls_ca else None, pins, cert, key)
