"""TLS and mutual TLS on the gRPC hops (gateway -> control plane -> worker), and who may listen
without it.

Every service takes vLLM's three flags with vLLM's meaning:
- `--ssl-certfile` / `--ssl-keyfile`: the service's own certificate chain and key, served on its
  port and presented to the services it calls;
- `--ssl-ca-certs`: the CA (PEM bundle) peers must be signed by. On a server it makes TLS mutual:
  a client without a certificate it signed fails the handshake. On a client it is what the
  server's certificate is verified against, so a service calls its peers over TLS exactly when
  it has `--ssl-ca-certs`, and plaintext otherwise.

Plaintext is the default only on loopback: a gRPC service bound to any other address without
mutual TLS refuses to start (exit status 2) unless `--insecure` accepts the risk (a warning).

The files are read and checked once at start-up (`load_tls`), so a bad path or a key that does
not match its certificate is one line and exit 2, never a failed handshake later.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import grpc

log = logging.getLogger(__name__)


class TlsConfigError(ValueError):
    """The TLS flags cannot be used as given; the message names the flag and the fix."""


def add_arguments(group: argparse._ArgumentGroup | argparse.ArgumentParser, *, role: str) -> None:
    """vLLM's --ssl-certfile/--ssl-keyfile/--ssl-ca-certs and ttserve's --insecure; `role` says in
    the help what this service's certificate is shown to."""
    group.add_argument("--ssl-certfile", default=None, metavar="PEM",
                       help=f"this service's certificate (chain), served on its port and presented "
                            f"to {role}")
    group.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="the key of --ssl-certfile")
    group.add_argument("--ssl-ca-certs", default=None, metavar="PEM",
                       help="the CA peers must be signed by: clients of this service must present a "
                            "certificate it signed (mutual TLS), and services this one calls are "
                            "verified against it (calls are TLS exactly when this is set)")
    group.add_argument("--insecure", action="store_true",
                       help="allow listening on a non-loopback address without TLS and keys "
                            "(refused otherwise); anyone who can reach the port can then use it")


@dataclass(slots=True, frozen=True)
class Tls:
    """PEM material of one service, read at start-up. All None: plaintext both ways."""
    cert_chain: bytes | None = None
    private_key: bytes | None = None
    root_certs: bytes | None = None      # the CA of --ssl-ca-certs

    @property
    def serves_tls(self) -> bool:
        return self.cert_chain is not None

    @property
    def mutual(self) -> bool:
        """A server that requires client certificates signed by its CA."""
        return self.serves_tls and self.root_certs is not None

    @property
    def calls_tls(self) -> bool:
        return self.root_certs is not None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """None: listen in plaintext."""
        if not self.serves_tls:
            return None
        assert self.private_key is not None
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)],
                                           root_certificates=self.root_certs,
                                           require_client_auth=self.root_certs is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """None: call in plaintext."""
        if not self.calls_tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.root_certs,
                                            private_key=self.private_key,
                                            certificate_chain=self.cert_chain)


PLAINTEXT = Tls()


def _read(flag: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TlsConfigError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    if b"-----BEGIN " not in data:
        raise TlsConfigError(f"{flag} {path}: not a PEM file (no -----BEGIN line)")
    return data


def load_tls(certfile: str | None, keyfile: str | None, ca_certs: str | None) -> Tls:
    """The files of the three flags, checked: both halves of the certificate or neither, each
    file readable PEM, the key matching the certificate, the CA loadable."""
    if bool(certfile) != bool(keyfile):
        given, missing = ("--ssl-certfile", "--ssl-keyfile") if certfile else ("--ssl-keyfile", "--ssl-certfile")
        raise TlsConfigError(f"{given} needs {missing}: a certificate is served with its key")
    cert = _read("--ssl-certfile", certfile) if certfile else None
    key = _read("--ssl-keyfile", keyfile) if keyfile else None
    ca = _read("--ssl-ca-certs", ca_certs) if ca_certs else None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if certfile:
        try:
            context.load_cert_chain(certfile, keyfile)
        except ssl.SSLError as e:
            raise TlsConfigError(f"--ssl-certfile {certfile} with --ssl-keyfile {keyfile}: not a "
                                 f"certificate and its matching key ({e.reason or e})") from None
    if ca_certs:
        try:
            context.load_verify_locations(ca_certs)
        except ssl.SSLError as e:
            raise TlsConfigError(f"--ssl-ca-certs {ca_certs}: no CA certificate in it "
                                 f"({e.reason or e})") from None
    return Tls(cert, key, ca)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def check_exposure(host: str, secured: bool, insecure: bool, what: str, needs: str) -> None:
    """Refuse (TlsConfigError) to listen on a non-loopback `host` unless `secured` or the operator
    passed --insecure, which only logs a warning. `needs` names the flags that secure it."""
    if secured or is_loopback(host):
        return
    risk = f"{what} on {host} without {needs}: anyone who can reach the port can use it"
    if not insecure:
        raise TlsConfigError(f"refusing to serve {risk}; pass {needs}, or --insecure to accept that")
    log.warning("serving %s (--insecure)", risk)


GRPC_NEEDS = "mutual TLS (--ssl-certfile, --ssl-keyfile and --ssl-ca-certs)"


def grpc_server_tls(args: argparse.Namespace, what: str) -> Tls:
    """A gRPC service's TLS from its flags, with the exposure rule applied."""
    tls = load_tls(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs)
    if tls.root_certs is not None and not tls.serves_tls:
        raise TlsConfigError(f"--ssl-ca-certs on the {what} needs --ssl-certfile and --ssl-keyfile: "
                             "it requires client certificates, which only a TLS port can ask for")
    check_exposure(args.host, tls.mutual, args.insecure, f"the {what}'s gRPC port", GRPC_NEEDS)
    return tls


def open_channel(target: str, tls: Tls, options: Sequence[tuple[str, object]]) -> grpc.aio.Channel:
    """An asyncio channel to a peer: TLS (verified against our CA, our certificate presented)
    when `tls.calls_tls`, plaintext otherwise."""
    credentials = tls.channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, credentials, options=options)


def open_blocking_channel(target: str, tls: Tls, options: Sequence[tuple[str, object]]) -> grpc.Channel:
    """open_channel for blocking (thread-based) clients."""
    credentials = tls.channel_credentials()
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)


def handshake_hint(details: str | None, tls: Tls) -> str:
    """A sentence to append to a failed call's details when TLS is the likely cause. A server that
    refuses our certificate (or our lack of one) just closes the connection, so over TLS a closed
    socket gets the hint too."""
    if not tls.calls_tls:
        return ""
    text = (details or "").lower()
    if not any(word in text for word in ("handshake", "ssl", "certificate", "socket closed")):
        return ""
    presented = ("this side presented its --ssl-certfile" if tls.serves_tls else
                 "this side presented no certificate (--ssl-certfile/--ssl-keyfile)")
    return (f" (TLS: {presented}; a peer with --ssl-ca-certs refuses one its CA did not sign, and this "
            "side's --ssl-ca-certs must have signed the peer's certificate, which must name the "
            "address dialled)")


def peer_names(context: grpc.aio.ServicerContext) -> list[str]:
    """The names the caller's verified certificate carries (subject CN and SANs); empty for a
    plaintext caller or one that presented no certificate."""
    auth = context.auth_context()
    names = auth.get("x509_common_name", []) + auth.get("x509_subject_alternative_name", [])
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]
