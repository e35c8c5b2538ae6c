"""TLS for a cluster's brokers: one certificate authority per cluster, a server certificate per broker and,
for nodes that log in with a certificate instead of a password, client certificates.

Layout (``edgeswarm certs --dir DIR``)::

    DIR/tls/ca.crt                   the cluster's CA: every node trusts it (EDGESWARM_TLS_CA_FILE)
    DIR/tls/ca.key                   its key (mode 600): keep it off the devices
    DIR/tls/brokers/<name>.crt|.key  a broker's certificate for the host names and addresses it is reached at
    DIR/tls/clients/<name>.crt|.key  a member's client certificate (common name = its node id)

Keys are ECDSA P-256; certificates are signed with SHA-256.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from edgeswarm.errors import ConfigError
from edgeswarm.security.credentials import write_private

DEFAULT_DAYS = 825  # the longest validity common TLS clients accept for a server certificate
LOCAL_NAMES = ("broker", "localhost")  # the compose service name and the container's own loopback


class CertsDir:
    """The TLS files under ``path / "tls"``."""

    def __init__(self, path: Path) -> None:
        self.root = path / "tls"

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    def broker(self, name: str) -> tuple[Path, Path]:
        """(certificate, key) of broker ``name``."""
        return self.root / "brokers" / f"{name}.crt", self.root / "brokers" / f"{name}.key"

    def client(self, name: str) -> tuple[Path, Path]:
        """(certificate, key) of member ``name``'s client certificate."""
        return self.root / "clients" / f"{name}.crt", self.root / "clients" / f"{name}.key"

    def ensure_ca(self, days: int = 3650) -> bool:
        """Make the CA unless it exists; True when it was made now."""
        if self.ca_cert.exists() and self.ca_key.exists():
            return False
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edgeswarm cluster CA")])
        now = dt.datetime.now(dt.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        write_private(self.ca_key, _pem_key(key))
        write_private(self.ca_cert, _pem_cert(cert), mode=0o644)
        return True

    def issue_broker(self, name: str, hosts: list[str], days: int = DEFAULT_DAYS) -> tuple[Path, Path]:
        """A server certificate for broker ``name``, valid for every host name and IP address in ``hosts`` and for
        ``broker`` and ``localhost`` (how the node's own services and its healthcheck reach it in compose)."""
        if not hosts:
            raise ConfigError(f"broker {name}: give the host names or addresses the nodes reach it at")
        return self._issue(self.broker(name), name, list(dict.fromkeys([*hosts, *LOCAL_NAMES])), server=True,
                           days=days)

    def issue_client(self, name: str, days: int = DEFAULT_DAYS) -> tuple[Path, Path]:
        """A client certificate whose common name is ``name`` (the broker maps it to that user)."""
        return self._issue(self.client(name), name, [], server=False, days=days)

    def _issue(self, paths: tuple[Path, Path], name: str, hosts: list[str], *, server: bool,
               days: int) -> tuple[Path, Path]:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        if not (self.ca_cert.exists() and self.ca_key.exists()):
            raise ConfigError(f"no CA in {self.root}: make one first (`edgeswarm certs --dir ...`)")
        ca_cert = x509.load_pem_x509_certificate(self.ca_cert.read_bytes())
        ca_key = serialization.load_pem_private_key(self.ca_key.read_bytes(), password=None)
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.timezone.utc)
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                   .issuer_name(ca_cert.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
                   .not_valid_after(now + dt.timedelta(days=days))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                         else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
        if hosts:
            builder = builder.add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
        cert_path, key_path = paths
        write_private(key_path, _pem_key(key))
        write_private(cert_path, _pem_cert(cert), mode=0o644)
        return cert_path, key_path


def _san(host: str):  # type: ignore[no-untyped-def]
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _pem_key(key) -> str:  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def _pem_cert(cert) -> str:  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM).decode()
