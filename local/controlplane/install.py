"""The jitckpt webhook installed on a control plane from ``deploy/``, as a platform team would.

The self-signed overlay is applied with ``kubectl apply --server-side -k``
through one more kustomize layer that changes the only thing this machine
cannot have: no Service network exists, so the webhook's ``clientConfig`` is
made a URL on 127.0.0.1 and its ``caBundle`` the CA of a certificate for that
address. Everything else (the MutatingWebhookConfiguration's selectors, CEL
conditions and policies, the RBAC, the ConfigMap) is the overlay's own. The
webhook is then served by ``jitckpt webhook serve`` as a local process, with
the configuration the ConfigMap holds and the credentials its Deployment's
pod would have: a token of the ``jitckpt-webhook`` ServiceAccount, so its
RBAC is the one exercised.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from local.controlplane.binaries import MODULES, binary, pinned_version
from local.controlplane.cluster import (
    ControlPlane,
    ControlPlaneError,
    kubeconfig,
)
from local.controlplane.pki import HOST
from local.controlplane.service import LocalService
from local.ports import free_port
from webhook.certs import CA_FILE, generate, write_bundle

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
OVERLAY = DEPLOY / "overlays" / "self-signed"
CHART = DEPLOY / "helm" / "jitckpt"
NAMESPACE = "jitckpt-system"
SERVICE_ACCOUNT = "jitckpt-webhook"
CONFIG_MAP = "jitckpt-webhook-config"
WEBHOOK_CONFIG = "jitckpt-webhook"
DEPLOYMENT = "jitckpt-webhook"
TOKEN_SECONDS = 24 * 3600


def kubectl() -> str:
    """kubectl beside this Python (``make setup`` installs it there), else on PATH."""
    beside = Path(sys.executable).with_name("kubectl")
    if os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("kubectl")
    if found is None:
        raise FileNotFoundError("kubectl is not installed (make setup puts it beside python)")
    return found


def run_kubectl(
    cluster: ControlPlane, *args: str, stdin: str | None = None, check: bool = True
) -> str:
    """``kubectl ARGS`` as the cluster's administrator; its stdout (``check``: a failure
    raised; without it, the stdout of a command whose exit status is its answer, as
    ``auth can-i``'s)."""
    argv = [kubectl(), f"--kubeconfig={cluster.kubeconfig}", *args]
    done = subprocess.run(
        argv, check=False, input=stdin, capture_output=True, text=True, timeout=120
    )
    if check and done.returncode != 0:
        raise ControlPlaneError(f"{' '.join(argv[1:])} failed: {done.stderr.strip()}")
    return done.stdout


def local_overlay(directory: Path, url: str, ca_bundle: bytes, overlay: Path = OVERLAY) -> Path:
    """A kustomization over ``overlay``: the webhook's clientConfig is ``url``, trusted by CA.

    The Deployment is kept at zero replicas: the local process that ``url`` reaches
    serves in its place (a pod of it could be reached only through the Service
    network), and on a cluster with nodes a pod of it would run, and in self-signed
    mode put its own CA into the webhook configuration."""
    directory.mkdir(parents=True, exist_ok=True)
    patch = [
        {"op": "remove", "path": "/webhooks/0/clientConfig/service"},
        {"op": "add", "path": "/webhooks/0/clientConfig/url", "value": url},
        {
            "op": "add",
            "path": "/webhooks/0/clientConfig/caBundle",
            "value": base64.b64encode(ca_bundle).decode(),
        },
    ]
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(overlay, directory)],
        "patches": [
            {
                "patch": json.dumps(patch),
                "target": {"kind": "MutatingWebhookConfiguration", "name": WEBHOOK_CONFIG},
            },
            {
                "patch": json.dumps([{"op": "replace", "path": "/spec/replicas", "value": 0}]),
                "target": {"kind": "Deployment", "name": DEPLOYMENT},
            },
        ],
    }
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return directory


def render(overlay: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize OVERLAY``: the objects ``apply -k`` sends."""
    return _documents([kubectl(), "kustomize", str(overlay)])


def _documents(argv: list[str]) -> list[dict[str, Any]]:
    """The YAML documents ``argv`` prints (its error, in ``stderr``, raised)."""
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def render_chart(
    values: dict[str, str] | None = None, namespace: str = NAMESPACE, chart: Path = CHART
) -> list[dict[str, Any]]:
    """``helm template`` of the chart with ``values`` (``--set``), as ``helm install`` sends it
    to a cluster of the control plane's version (the chart requires native sidecars).

    Raises ``subprocess.CalledProcessError`` (with helm's message in ``stderr``) for values
    the chart's schema refuses."""
    sets = [f"--set={key}={value}" for key, value in (values or {}).items()]
    version = pinned_version(*MODULES["kube-apiserver"])
    argv = [str(binary("helm")), "template", "jitckpt", str(chart), f"--namespace={namespace}"]
    return _documents([*argv, f"--kube-version={version}", *sets])


@dataclass
class InstalledWebhook(LocalService):
    """deploy/ applied to ``cluster`` and the webhook served for it; a context manager."""

    port: int = 0
    objects: list[dict[str, Any]] = field(default_factory=list, init=False)
    _context: ssl.SSLContext | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"https://{HOST}:{self.port}"

    def start(self) -> InstalledWebhook:
        work = self._workdir("webhook-install")
        self.port = self.port or free_port(HOST)
        certs = work / "certs"
        write_bundle(generate([HOST]), certs)
        overlay = local_overlay(
            work / "overlay", f"{self.url}/mutate", (certs / CA_FILE).read_bytes()
        )
        self.objects = render(overlay)
        run_kubectl(self.cluster, "apply", "--server-side", "-k", str(overlay))
        try:
            self._serve(work, certs)
        except BaseException:
            self.stop()
            raise
        return self

    def _serve(self, work: Path, certs: Path) -> None:
        """``jitckpt webhook serve`` with the ConfigMap's config and the ServiceAccount's token."""
        config_map = json.loads(
            run_kubectl(self.cluster, "get", "configmap", CONFIG_MAP, "-n", NAMESPACE, "-o", "json")
        )
        config = work / "config.yaml"
        config.write_text(config_map["data"]["config.yaml"])
        token = run_kubectl(
            self.cluster, "create", "token", SERVICE_ACCOUNT, "-n", NAMESPACE,
            f"--duration={TOKEN_SECONDS}s",
        ).strip()  # fmt: skip
        assert self.cluster.pki is not None
        identity = work / "webhook.kubeconfig"
        identity.write_text(
            kubeconfig(self.cluster.server, self.cluster.pki.ca, user={"token": token})
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env["KUBECONFIG"] = str(identity)
        argv = [
            str(Path(sys.executable).with_name("jitckpt")), "webhook", "serve",
            f"--cert-dir={certs}", f"--config={config}", f"--host={HOST}", f"--port={self.port}",
        ]  # fmt: skip
        # Ready: TLS loaded and the namespace watch synced through the token's RBAC.
        context = ssl.create_default_context(cafile=str(certs / CA_FILE))
        self._run_until_ready(argv, "jitckpt webhook serve", f"{self.url}/readyz", context, env)
        self._context = context

    def objects_of(self, kind: str) -> list[dict[str, Any]]:
        """The applied objects of ``kind``."""
        return [doc for doc in self.objects if doc["kind"] == kind]

    def metrics(self) -> str:
        """The webhook's /metrics text (Prometheus exposition)."""
        with urllib.request.urlopen(f"{self.url}/metrics", context=self._context, timeout=10) as r:
            text: str = r.read().decode()
        return text
