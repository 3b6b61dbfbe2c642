"""Certificates for the API server stand-in over TLS: a cluster CA, a serving certificate for
names and addresses given, and client certificates, written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


class Authority:
    """A CA whose files are under ``directory``; :meth:`issue` signs leaf certificates."""

    def __init__(self, directory: Path, name: str = "cluster-ca") -> None:
        self.directory = directory
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._cert = (self._builder(self._name, self._key.public_key())
                      .add_extension(x509.BasicConstraints(ca=True, path_length=None),
                                     critical=True)
                      .sign(self._key, hashes.SHA256()))
        self.files = self._write(name, self._cert, self._key)

    def _builder(self, subject: x509.Name, public: ec.EllipticCurvePublicKey
                 ) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.UTC)
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(self._name)
                .public_key(public).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1)))

    def _write(self, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pair:
        pair = Pair(self.directory / f"{name}.crt", self.directory / f"{name}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pair.key.write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        return pair

    def issue(self, name: str, *, hosts: tuple[str, ...] = (), client: bool = False) -> Pair:
        """A certificate for ``name`` (its common name), valid for ``hosts`` (DNS names or IP
        addresses) when serving, or as a client's."""
        key = ec.generate_private_key(ec.SECP256R1())
        builder = self._builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]),
                                key.public_key())
        if hosts:
            builder = builder.add_extension(x509.SubjectAlternativeName([_general(h)
                                                                         for h in hosts]),
                                            critical=False)
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        cert = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False) \
            .sign(self._key, hashes.SHA256())
        return self._write(name, cert, key)

    def server_context(self, serving: Pair, *, require_client: bool = False) -> ssl.SSLContext:
        """The server side: ``serving``'s certificate, and clients' checked against this CA
        (required or optional)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(serving.cert, serving.key)
        context.load_verify_locations(self.files.cert)
        context.verify_mode = ssl.CERT_REQUIRED if require_client else ssl.CERT_OPTIONAL
        return context


def _general(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)
