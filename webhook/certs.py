"""A self-signed CA and a serving certificate for the admission server.

Used by ``jitckpt webhook certs`` (development, and installs without
cert-manager) and by the self-signed install mode of ``jitckpt webhook serve``.
Files are named as cert-manager names them (``ca.crt``, ``tls.crt``,
``tls.key``) so the server reads both kinds of install the same way. The CA's
private key is never written: a new certificate means a new CA, whose bundle
the installer publishes again.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_FILE = "ca.crt"
CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"

# Serving certificates live a year; the CA ten. Both start five minutes in the
# past so that a node whose clock is slightly behind still accepts them.
SERVING_VALIDITY = dt.timedelta(days=365)
CA_VALIDITY = dt.timedelta(days=3650)
CLOCK_SKEW = dt.timedelta(minutes=5)
# The arguments of x509.KeyUsage: a certificate names the few it allows (_key_usage).
_KEY_USAGES = (
    "digital_signature",
    "content_commitment",
    "key_encipherment",
    "data_encipherment",
    "key_agreement",
    "key_cert_sign",
    "crl_sign",
    "encipher_only",
    "decipher_only",
)


@dataclass(frozen=True)
class CertBundle:
    """PEM bytes of the CA certificate, the serving certificate and its key."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "jitckpt"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64]),
        ]
    )


def _san(names: Sequence[str]) -> x509.SubjectAlternativeName:
    """DNS names, and IP addresses for entries that parse as one."""
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _key_usage(*allowed: str) -> x509.KeyUsage:
    """A KeyUsage that allows ``allowed`` and nothing else."""
    unknown = set(allowed) - set(_KEY_USAGES)
    if unknown:
        raise ValueError(f"not a key usage: {sorted(unknown)}")
    return x509.KeyUsage(**{use: use in allowed for use in _KEY_USAGES})


def generate(
    names: Sequence[str],
    *,
    validity: dt.timedelta = SERVING_VALIDITY,
    now: dt.datetime | None = None,
) -> CertBundle:
    """A fresh CA (P-256) and a serving certificate for ``names`` signed by it."""
    if not names:
        raise ValueError("at least one DNS name (or IP address) is required")
    start = (now or dt.datetime.now(dt.UTC)) - CLOCK_SKEW
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("jitckpt-webhook-ca")
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            _key_usage("key_cert_sign", "crl_sign"),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(names[0]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + validity)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            # ECDSA keys sign; key_encipherment applies to RSA key exchange only.
            _key_usage("digital_signature"),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(_san(names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return CertBundle(
        ca_pem=ca_cert.public_bytes(serialization.Encoding.PEM),
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write via a temp file in the same directory and rename over the target.

    A server re-reading the directory never sees a half-written file.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_bundle(bundle: CertBundle, out_dir: Path) -> None:
    """Write ``ca.crt``, ``tls.key`` (mode 0600) and ``tls.crt``, key first.

    The certificate goes last so that a reloading server that notices the new
    certificate finds the matching key already in place.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(out_dir / CA_FILE, bundle.ca_pem, 0o644)
    _write_atomic(out_dir / KEY_FILE, bundle.key_pem, 0o600)
    _write_atomic(out_dir / CERT_FILE, bundle.cert_pem, 0o644)


def read_bundle(cert_dir: Path) -> CertBundle | None:
    """The three files of ``cert_dir``, or None when any is missing."""
    try:
        return CertBundle(
            ca_pem=(cert_dir / CA_FILE).read_bytes(),
            cert_pem=(cert_dir / CERT_FILE).read_bytes(),
            key_pem=(cert_dir / KEY_FILE).read_bytes(),
        )
    except FileNotFoundError:
        return None
