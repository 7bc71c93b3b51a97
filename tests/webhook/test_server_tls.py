"""Real TLS round trips against a running ``jitckpt webhook serve``.

Certificates come from ``jitckpt webhook certs``; the client trusts only the
CA it wrote. The certificate swap writes new files into the served directory
and checks that the next connection presents them, with no restart.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import ssl
import stat
import time
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from tests.webhook.server_support import (
    admission_review,
    check_answer,
    fixture,
    jitckpt,
    marked_reason,
    patched,
    serve,
)

HOST = "127.0.0.1"


def peer_fingerprint(url: str, ca_file: Path) -> str:
    """SHA-256 of the certificate the server presents, verified against ``ca_file``."""
    host, port = url.removeprefix("https://").split(":")
    ctx = ssl.create_default_context(cafile=str(ca_file))
    with (
        socket.create_connection((host, int(port)), timeout=5) as sock,
        ctx.wrap_socket(sock, server_hostname=host) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return hashlib.sha256(der).hexdigest()


def sha256_of(cert_file: Path) -> str:
    from cryptography.hazmat.primitives import hashes

    return x509.load_pem_x509_certificate(cert_file.read_bytes()).fingerprint(hashes.SHA256()).hex()


def test_certs_command_writes_a_ca_and_a_serving_certificate(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    jitckpt("webhook", "certs", "--out", str(out), "--dns", "hook.example.svc", "--dns", HOST)
    assert stat.S_IMODE((out / "tls.key").stat().st_mode) == 0o600
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    leaf = x509.load_pem_x509_certificate((out / "tls.crt").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usage = leaf.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical and usage.value.digital_signature and not usage.value.key_cert_sign
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["hook.example.svc"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == [HOST]
    assert leaf.issuer == ca.subject
    leaf.verify_directly_issued_by(ca)
    lifetime = leaf.not_valid_after_utc - leaf.not_valid_before_utc
    assert 300 <= lifetime.days <= 400

    # Without --dns: the names the in-cluster Service is reached by.
    jitckpt("webhook", "certs", "--out", str(tmp_path / "default"))
    leaf = x509.load_pem_x509_certificate((tmp_path / "default" / "tls.crt").read_bytes())
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "jitckpt-webhook.jitckpt-system.svc" in san.get_values_for_type(x509.DNSName)


def test_tls_round_trip_and_certificate_swap_without_restart(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    jitckpt("webhook", "certs", "--out", str(certs), "--dns", HOST)
    first_ca = tmp_path / "first-ca.crt"
    first_ca.write_bytes((certs / "ca.crt").read_bytes())
    first = sha256_of(certs / "tls.crt")

    with serve(certs, tmp_path) as server:
        verify = ssl.create_default_context(cafile=str(first_ca))
        with httpx.Client(base_url=server.url, verify=verify, timeout=10) as client:
            assert client.get("/healthz").json() == {"ok": True}
            # No Kubernetes API: ready as soon as the certificate is loaded.
            assert client.get("/readyz").status_code == 200

            pod = fixture("pytorchjob-master.yaml")
            review = admission_review(pod)
            answer = client.post("/mutate", json=review)
            assert answer.status_code == 200
            response = check_answer(answer.json(), review["request"]["uid"])
            assert response["allowed"] is True
            # Without the API the namespace's annotations are unknown; the pod's own
            # settings lack a destination, so it is admitted unchanged but for its reason.
            assert marked_reason(pod, response) == "no-destination"
            assert any("destination" in w for w in response["warnings"])

            # Same server, pod that names its own destination: injected over TLS.
            pod["metadata"]["annotations"]["jitckpt.io/destination"] = "s3://bucket/prefix"
            review = admission_review(pod)
            response = check_answer(
                client.post("/mutate", json=review).json(), review["request"]["uid"]
            )
            assert "patch" in response and response["auditAnnotations"]
            names = [c["name"] for c in patched(pod, response)["spec"]["initContainers"]]
            assert "jitckpt-agent" in names

            # Oversized (4 MiB > 3 MiB): cut off while streaming, still answered for its uid.
            pod["metadata"]["annotations"]["padding"] = "x" * (4 * 1024 * 1024)
            big = client.post("/mutate", json=admission_review(pod, uid="big"))
            response = check_answer(big.json(), "big")
            assert "patch" not in response and "exceeds" in response["warnings"][0]

        assert peer_fingerprint(server.url, first_ca) == first

        # Rotation: a new CA and certificate written into the served directory.
        jitckpt("webhook", "certs", "--out", str(certs), "--dns", HOST)
        second = sha256_of(certs / "tls.crt")
        assert second != first
        assert peer_fingerprint(server.url, certs / "ca.crt") == second
        with pytest.raises(ssl.SSLCertVerificationError):
            peer_fingerprint(server.url, first_ca)
        with httpx.Client(
            base_url=server.url, verify=ssl.create_default_context(cafile=str(certs / "ca.crt"))
        ) as client:
            assert client.get("/healthz").status_code == 200
        assert server.proc.poll() is None  # the same process throughout

        # A half-finished rotation (a key that does not match) keeps the last good pair.
        (certs / "tls.key").write_bytes(_other_key_pem())
        assert peer_fingerprint(server.url, certs / "ca.crt") == second

        metrics = httpx.get(
            server.url + "/metrics", verify=ssl.create_default_context(cafile=str(certs / "ca.crt"))
        ).text
        assert "jitckpt_webhook_requests_total 3.0" in metrics
        assert 'jitckpt_webhook_failed_total{reason="too-large"} 1.0' in metrics

    logs = server.log_lines()  # every line is JSON
    messages = [line["msg"] for line in logs]
    assert sum("no Kubernetes API" in m for m in messages) == 1
    loaded = [line for line in logs if line["msg"] == "serving certificate loaded"]
    assert [line["sha256"] for line in loaded] == [first, second]
    assert any("do not load yet" in m for m in messages)


def _other_key_pem() -> bytes:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def test_serve_refuses_to_start_without_certificates(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match="cannot load"), serve(tmp_path / "empty", tmp_path):
        pass
    assert time.monotonic() - started < 30


def test_serve_refuses_an_invalid_config_file(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    jitckpt("webhook", "certs", "--out", str(certs), "--dns", HOST)
    config = tmp_path / "config.yaml"
    config.write_text("defaults:\n  grace-period-seconds: soon\n")
    with (
        pytest.raises(AssertionError, match="invalid configuration"),
        serve(certs, tmp_path, "--config", str(config)),
    ):
        pass


def _handshake(server_ctx: ssl.SSLContext, ca_pem: bytes) -> str:
    """SHA-256 of the certificate ``server_ctx`` presents, over in-memory TLS."""
    client_ctx = ssl.create_default_context(cadata=ca_pem.decode())
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=HOST)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        for side in (client, server):
            with contextlib.suppress(ssl.SSLWantReadError):
                side.do_handshake()
        s_in.write(c_out.read())
        c_in.write(s_out.read())
    der = client.getpeercert(binary_form=True)
    assert der is not None
    return hashlib.sha256(der).hexdigest()


def test_reload_follows_a_kubelet_style_symlink_flip(tmp_path: Path) -> None:
    """Secret volumes: tls.crt -> ..data/tls.crt, and ..data is swapped atomically."""
    from webhook.certs import generate, write_bundle
    from webhook.tls import ReloadingTLS

    def publish(version: str) -> bytes:
        bundle = generate([HOST])
        write_bundle(bundle, tmp_path / version)
        (tmp_path / "..data_tmp").symlink_to(version)
        (tmp_path / "..data_tmp").replace(tmp_path / "..data")  # rename(2): atomic
        return bundle.ca_pem

    first_ca = publish("..2026_01")
    for name in ("tls.crt", "tls.key", "ca.crt"):
        (tmp_path / name).symlink_to(f"..data/{name}")
    tls = ReloadingTLS(tmp_path)
    tls.load()
    assert _handshake(tls.context, first_ca) == tls.fingerprint
    first = tls.fingerprint

    second_ca = publish("..2026_02")
    assert _handshake(tls.context, second_ca) == tls.fingerprint != first
