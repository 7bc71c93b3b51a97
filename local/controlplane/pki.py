"""The control plane's certificates and keys, made fresh for each cluster.

One CA signs every certificate (etcd's and the API server's serving
certificates, the clients' certificates), as kubeadm's does for a small
cluster; the service-account signing key is a separate RSA key, the only kind
every token verifier accepts. Nothing is written but the PEM files the
processes are pointed at: the CA's key stays in memory, so no certificate can
be issued for this cluster once it is made.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=1)  # a test cluster's lifetime, with room
CLOCK_SKEW = dt.timedelta(minutes=5)
HOST = "127.0.0.1"


@dataclass(frozen=True)
class KeyPair:
    """Paths of one certificate and its private key."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class ClusterPKI:
    """Every file the processes and clients of one cluster are given."""

    ca: Path
    etcd_server: KeyPair
    apiserver_etcd_client: KeyPair
    apiserver: KeyPair
    admin: KeyPair
    controller_manager: KeyPair
    scheduler: KeyPair
    # node name -> its kubelet's client credential (system:node:NAME in system:nodes,
    # what the Node authorizer and NodeRestriction recognize)
    nodes: Mapping[str, KeyPair]
    service_account_key: Path
    service_account_pub: Path


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def _pem_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes, mode: int = 0o644) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    return path


class _Authority:
    """The CA: its key, and the certificates it signs."""

    def __init__(self, now: dt.datetime) -> None:
        self.start = now - CLOCK_SKEW
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = _name("jitckpt-controlplane-ca")
        self.cert = (
            self._builder(self.name, self.key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )

    def _builder(
        self, subject: x509.Name, public_key: ec.EllipticCurvePublicKey
    ) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(self.start)
            .not_valid_after(self.start + VALIDITY)
        )

    def issue(
        self,
        directory: Path,
        stem: str,
        common_name: str,
        *,
        organization: str | None = None,
        server: bool = False,
        client: bool = False,
        dns: tuple[str, ...] = (),
    ) -> KeyPair:
        """A certificate for ``common_name`` (a user, when a client), written as STEM.crt/.key."""
        key = ec.generate_private_key(ec.SECP256R1())
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
            [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
        )
        builder = (
            self._builder(_name(common_name, organization), key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        if server:
            names: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(HOST))]
            names += [x509.DNSName(name) for name in ("localhost", *dns)]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return KeyPair(
            cert=_write(directory / f"{stem}.crt", cert.public_bytes(serialization.Encoding.PEM)),
            key=_write(directory / f"{stem}.key", _pem_key(key), 0o600),
        )


# The names the API server's certificate answers to: in-cluster clients reach it
# as the `kubernetes` Service.
APISERVER_NAMES = (
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


def make_pki(
    directory: Path, now: dt.datetime | None = None, nodes: tuple[str, ...] = ()
) -> ClusterPKI:
    """Write a new cluster's certificates and keys into ``directory``, with a kubelet's
    credential for each of ``nodes`` (made now: the CA's key is not kept)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = _Authority(now or dt.datetime.now(dt.UTC))
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    sa_pub = sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return ClusterPKI(
        ca=_write(directory / "ca.crt", ca.cert.public_bytes(serialization.Encoding.PEM)),
        etcd_server=ca.issue(directory, "etcd-server", "etcd", server=True, client=True),
        apiserver_etcd_client=ca.issue(
            directory, "apiserver-etcd-client", "kube-apiserver-etcd-client", client=True
        ),
        apiserver=ca.issue(
            directory, "apiserver", "kube-apiserver", server=True, dns=APISERVER_NAMES
        ),
        # system:masters: the group the API server authorizes for everything, as an
        # installer's first admin credential is.
        admin=ca.issue(directory, "admin", "admin", organization="system:masters", client=True),
        # The users the bootstrap RBAC roles of the two controllers are bound to.
        controller_manager=ca.issue(
            directory, "controller-manager", "system:kube-controller-manager", client=True
        ),
        scheduler=ca.issue(directory, "scheduler", "system:kube-scheduler", client=True),
        nodes={
            node: ca.issue(
                directory,
                f"node-{node}",
                f"system:node:{node}",
                organization="system:nodes",
                client=True,
            )
            for node in nodes
        },
        service_account_key=_write(directory / "sa.key", _pem_key(sa_key), 0o600),
        service_account_pub=_write(directory / "sa.pub", sa_pub),
    )
