"""Self-signed install mode: the webhook makes its own certificate and publishes its CA.

Without cert-manager something must create the serving certificate and put
its CA into the MutatingWebhookConfiguration's ``caBundle``. With two
replicas, each generating its own CA would leave one of them untrusted, so the
certificate is shared through one Secret: the first replica to start creates
it, every other replica (and every restart) reads it back. Each replica then
writes the files into its cert directory and patches ``caBundle`` with the
shared CA (the same value from every replica, so the patches agree).
RBAC: ``create`` Secrets in the webhook's namespace, ``get`` only this Secret,
``get``/``patch`` only this MutatingWebhookConfiguration.
"""

from __future__ import annotations

import base64
import logging
from pathlib import Path
from typing import Any

from webhook.certs import CA_FILE, CERT_FILE, KEY_FILE, CertBundle, generate, write_bundle

log = logging.getLogger(__name__)


def service_dns_names(service: str) -> list[str]:
    """The names a Service ``name.namespace`` is reached by from the API server."""
    name, _, namespace = service.partition(".")
    if not name or not namespace or "." in namespace:
        raise ValueError(f"--service must be NAME.NAMESPACE, got {service!r}")
    base = f"{name}.{namespace}"
    return [name, base, f"{base}.svc", f"{base}.svc.cluster.local"]


def _bundle_from_secret(secret: Any) -> CertBundle | None:
    data = secret.data or {}
    try:
        return CertBundle(
            ca_pem=base64.b64decode(data[CA_FILE]),
            cert_pem=base64.b64decode(data[CERT_FILE]),
            key_pem=base64.b64decode(data[KEY_FILE]),
        )
    except KeyError:
        return None


def shared_bundle(
    api_client: Any, namespace: str, secret_name: str, names: list[str]
) -> CertBundle:
    """The certificate in Secret ``secret_name``, created first when absent."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core = client.CoreV1Api(api_client)
    try:
        found = _bundle_from_secret(core.read_namespaced_secret(secret_name, namespace))
        if found is not None:
            return found
        raise RuntimeError(f"Secret {namespace}/{secret_name} lacks ca.crt, tls.crt or tls.key")
    except ApiException as exc:
        if exc.status != 404:
            raise
    bundle = generate(names)
    body = client.V1Secret(
        metadata=client.V1ObjectMeta(
            name=secret_name,
            namespace=namespace,
            labels={"app.kubernetes.io/name": "jitckpt-webhook"},
        ),
        type="kubernetes.io/tls",
        data={
            CA_FILE: base64.b64encode(bundle.ca_pem).decode(),
            CERT_FILE: base64.b64encode(bundle.cert_pem).decode(),
            KEY_FILE: base64.b64encode(bundle.key_pem).decode(),
        },
    )
    try:
        core.create_namespaced_secret(namespace, body)
        log.info("created serving certificate", extra={"fields": {"secret": secret_name}})
        return bundle
    except ApiException as exc:
        if exc.status != 409:
            raise
    # Another replica won the race: use its certificate.
    found = _bundle_from_secret(core.read_namespaced_secret(secret_name, namespace))
    if found is None:
        raise RuntimeError(f"Secret {namespace}/{secret_name} lacks ca.crt, tls.crt or tls.key")
    return found


def patch_ca_bundle(api_client: Any, webhook_config_name: str, ca_pem: bytes) -> int:
    """Set ``caBundle`` on every webhook of the configuration; the number changed."""
    from kubernetes import client

    api = client.AdmissionregistrationV1Api(api_client)
    current = api.read_mutating_webhook_configuration(webhook_config_name)
    encoded = base64.b64encode(ca_pem).decode()
    ops: list[dict[str, Any]] = []
    for i, hook in enumerate(current.webhooks or []):
        if hook.client_config.ca_bundle == encoded:
            continue
        # "test" guards against the list having changed between read and patch.
        ops.append({"op": "test", "path": f"/webhooks/{i}/name", "value": hook.name})
        ops.append({"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": encoded})
    if ops:
        api.patch_mutating_webhook_configuration(webhook_config_name, ops)
    changed = len(ops) // 2
    log.info(
        "caBundle published",
        extra={
            "fields": {"webhookconfiguration": webhook_config_name, "webhooks_changed": changed}
        },
    )
    return changed


def install(
    api_client: Any,
    cert_dir: Path,
    *,
    service: str,
    secret_name: str,
    webhook_config_name: str,
) -> CertBundle:
    """Make sure ``cert_dir`` holds the shared certificate and the API server trusts its CA."""
    namespace = service.partition(".")[2]
    bundle = shared_bundle(api_client, namespace, secret_name, service_dns_names(service))
    write_bundle(bundle, cert_dir)
    patch_ca_bundle(api_client, webhook_config_name, bundle.ca_pem)
    return bundle
