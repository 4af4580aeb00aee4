"""TLS for KVSync: the DraftServer's certificate and what the SpecEngine trusts.

Owns: ``KVSyncTLS`` — the server's PEM certificate chain and key, the CA bundle the client
verifies the server with (default: the server certificate itself, i.e. a self-signed one), and the
name the client expects in the certificate (the server is dialled by pod/node IP, which changes;
the certificate names a stable host name instead); with ``mutual`` also the SpecEngine's own
certificate and the CA the DraftServer checks it against (mutual TLS: only holders of a trusted
client certificate get a connection at all, before the bearer token is read) — and turning them
into gRPC credentials.
Files are read when credentials are built (at server start / client connect), so a rotated
certificate is picked up by the next (re)connect.
Ignores: bearer tokens (``cluster.api.auth``), limits.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"KVSync TLS {what} {path!r} cannot be read: {exc.strerror or exc}") from None


def _read_first(*candidates: tuple[str, str | None]) -> bytes:
    """The first configured file of ``(option name, path)`` candidates (a default falls back to
    the next), read; the name is what an unreadable file's error says."""
    what, path = next((w, p) for w, p in candidates if p is not None)
    return _read(path, what)


@dataclass(frozen=True)
class KVSyncTLS:
    cert_file: str | None = None  # the DraftServer's certificate chain (PEM); None: no TLS
    key_file: str | None = None  # its private key (PEM)
    ca_file: str | None = None  # CA bundle the SpecEngine trusts; None: the server certificate
    server_name: str | None = None  # name checked in the certificate; None: the dialled host
    mutual: bool = False  # the DraftServer demands a client certificate
    client_cert_file: str | None = None  # the SpecEngine's certificate; None: cert_file (one identity)
    client_key_file: str | None = None  # its key; None: key_file
    client_ca_file: str | None = None  # CA the DraftServer trusts clients by; None: ca_file, else cert_file

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("KVSync TLS needs both cert_file and key_file (or neither)")
        if (self.client_cert_file is None) != (self.client_key_file is None):
            raise ValueError("KVSync mutual TLS needs both client_cert_file and client_key_file (or neither)")
        client_files = (self.client_cert_file, self.client_ca_file)
        if any(f is not None for f in client_files) and not self.mutual:
            raise ValueError("KVSync client_cert_file/client_key_file/client_ca_file are set but "
                             "mutual is off: set mutual (or drop them)")
        if self.mutual and not self.enabled:
            raise ValueError("KVSync mutual TLS needs cert_file and key_file (TLS itself) too")
        if self.ca_file is not None and self.cert_file is None:
            raise ValueError("KVSync TLS ca_file is set but cert_file/key_file are not: the server "
                             "would listen without TLS and the client would refuse it")

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        pair = [(_read(self.key_file, "key_file"), _read(self.cert_file, "cert_file"))]
        if not self.mutual:
            return grpc.ssl_server_credentials(pair)
        clients_ca = _read_first(("client_ca_file", self.client_ca_file), ("ca_file", self.ca_file),
                                 ("cert_file", self.cert_file))
        return grpc.ssl_server_credentials(pair, root_certificates=clients_ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        roots = _read_first(("ca_file", self.ca_file), ("cert_file", self.cert_file))
        if not self.mutual:
            return grpc.ssl_channel_credentials(root_certificates=roots)
        return grpc.ssl_channel_credentials(
            root_certificates=roots,
            private_key=_read_first(("client_key_file", self.client_key_file), ("key_file", self.key_file)),
            certificate_chain=_read_first(("client_cert_file", self.client_cert_file), ("cert_file", self.cert_file)))

    def open_channel(self, address: str, options: list | tuple = ()) -> grpc.Channel:
        """A client channel to ``address``: TLS (verifying the server) when enabled."""
        if not self.enabled:
            return grpc.insecure_channel(address, options=list(options))
        name = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return grpc.secure_channel(address, self.channel_credentials(), options=list(options) + name)
