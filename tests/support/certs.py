"""Certificates made at test time: one CA that signs a server and a client certificate, and a second CA for refusals.

Every certificate is ECDSA P-256, valid from five minutes ago for a day. The server certificate names localhost and
127.0.0.1, so a client may dial either without a server-name override.
"""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    """PEM files in one directory; read one as bytes with ``.read_bytes()``."""

    ca: Path
    server_cert: Path  # signed by ca, for localhost and 127.0.0.1
    server_key: Path
    client_cert: Path  # signed by ca, client auth (the mutual-TLS half)
    client_key: Path
    other_ca: Path  # a CA that signed neither: the server's certificate does not verify with it
    rogue_cert: Path  # a client certificate signed by other_ca: a server trusting only ca refuses it
    rogue_key: Path

    def server_credentials(self, *, mutual: bool) -> grpc.ServerCredentials:
        """Credentials for a gRPC server with the server certificate; `mutual` requires a client one signed by ca."""
        return grpc.ssl_server_credentials([(self.server_key.read_bytes(), self.server_cert.read_bytes())],
                                           root_certificates=self.ca.read_bytes() if mutual else None,
                                           require_client_auth=mutual)


@dataclass(frozen=True)
class _Issued:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _issue(name: str, issuer: _Issued | None, usage: x509.ObjectIdentifier | None = None) -> _Issued:
    """A self-signed CA when issuer is None, else a leaf signed by issuer for `usage` (server or client auth)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject).public_key(key.public_key())
               .issuer_name(issuer.cert.subject if issuer else subject)
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True))
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if usage == ExtendedKeyUsageOID.SERVER_AUTH:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return _Issued(builder.sign(issuer.key if issuer else key, hashes.SHA256()), key)


def _write_cert(path: Path, issued: _Issued) -> Path:
    path.write_bytes(issued.cert.public_bytes(serialization.Encoding.PEM))
    return path


def _write_key(path: Path, issued: _Issued) -> Path:
    path.write_bytes(issued.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
    return path


def make_pki(directory: Path) -> Pki:
    """Issue the certificates and write them to `directory` (ca.pem, server_cert.pem, server_key.pem, ...)."""
    ca, other_ca = _issue("glmimage test CA", None), _issue("other CA", None)
    server = _issue("localhost", ca, ExtendedKeyUsageOID.SERVER_AUTH)
    client = _issue("test client", ca, ExtendedKeyUsageOID.CLIENT_AUTH)
    rogue = _issue("rogue client", other_ca, ExtendedKeyUsageOID.CLIENT_AUTH)
    return Pki(ca=_write_cert(directory / "ca.pem", ca),
               server_cert=_write_cert(directory / "server_cert.pem", server),
               server_key=_write_key(directory / "server_key.pem", server),
               client_cert=_write_cert(directory / "client_cert.pem", client),
               client_key=_write_key(directory / "client_key.pem", client),
               other_ca=_write_cert(directory / "other_ca.pem", other_ca),
               rogue_cert=_write_cert(directory / "rogue_cert.pem", rogue),
               rogue_key=_write_key(directory / "rogue_key.pem", rogue))
