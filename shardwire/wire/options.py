"""Command-line options for tokens and TLS, shared by the worker and the coordinator commands."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from ..state import STATE_ENV, state_dir
from .tls import TRUST_ON_FIRST_USE, ClientTLS, KnownHosts, ServerTLS, normalize_pin, own_certificate

log = logging.getLogger("shardwire.wire.options")

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
    g.add_argument(
        "--tls-cert",
        default=None,
        help=f"serve TLS with this certificate (PEM; default: one made on first start in env {STATE_ENV}, "
        "else ~/.local/state/shardwire)",
    )
    g.add_argument("--tls-key", default=None, help="private key of --tls-cert (PEM)")
    g.add_argument(
        "--tls-ca",
        default=None,
        help="require clients to present a certificate from this CA (mutual TLS); also used to verify the next worker",
    )
    g.add_argument("--no-tls", action="store_true", help="plain TCP: links to this worker are not encrypted")


def add_client_tls_args(g) -> None:
    add_token_args(g)
    g.add_argument(
        "--no-tls", action="store_true", help="plain TCP to workers started with --no-tls (links are not encrypted)"
    )
    g.add_argument("--tls-ca", default=None, help="trust workers whose certificate this CA signed")
    g.add_argument(
        "--tls-pin",
        default=None,
        help="trust exactly these worker certificate fingerprints (comma-separated sha256:..., as workers "
        f"print them; default: each worker's certificate is pinned on first contact in the state folder's "
        f"known_hosts, env {STATE_ENV})",
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


def _plain(args, *conflicting: str) -> bool:
    if not args.no_tls:
        return False
    given = [f"--{name.replace('_', '-')}" for name in conflicting if getattr(args, name, None)]
    if given:
        raise ValueError(f"--no-tls and {', '.join(given)} contradict each other")
    return True


def server_tls(args: argparse.Namespace) -> ServerTLS | None:
    """The worker's TLS: its own certificate, else this machine's (made on first start); None
    with --no-tls."""
    if _plain(args, "tls_cert", "tls_key", "tls_ca"):
        return None
    cert, key = _pair(args, "worker")
    ca = Path(args.tls_ca) if args.tls_ca else None
    if cert is None:
        if ca is not None:
            raise ValueError("--tls-ca on a worker needs --tls-cert/--tls-key: mutual TLS runs over TLS")
        return own_certificate(state_dir())
    return ServerTLS(cert, key, ca)


def client_tls(args: argparse.Namespace) -> ClientTLS | None:
    """The coordinator's TLS: trust a CA, pinned fingerprints, or else the known hosts; None with
    --no-tls."""
    if _plain(args, "tls_cert", "tls_key", "tls_ca", "tls_pin"):
        return None
    cert, key = _pair(args, "coordinator")
    pins = {normalize_pin(p) for p in (args.tls_pin or "").split(",") if p.strip()}
    if not args.tls_ca and not pins:
        return TRUST_ON_FIRST_USE if cert is None else ClientTLS(cert=cert, key=key, known_hosts=KnownHosts())
    return ClientTLS(Path(args.tls_ca) if args.tls_ca else None, pins, cert, key)
