"""The job controllers beside the control plane: Kueue, the Kubeflow training-operator
(PyTorchJob), the Kubeflow Trainer (TrainJob) and the JobSet controller it needs.

Each runs as a local process, built by ``make controlplane`` from its own Go
module, with its CRDs applied from the YAML its module ships (copied into the
binary's cache entry at build time: nothing is read from the network or a Go
module cache here). Their admission webhooks are their own, served over TLS on
127.0.0.1 and registered by URL with a CA bundle, since there is no Service
network: the webhook configurations are the modules' own, with only
``clientConfig`` replaced and the webhooks of frameworks not run dropped.

Some binaries read certificate files from fixed paths whatever their flags say
(Kueue its metrics certificate under ``/etc/kueue``, the training-operator's
certificate rotator and the Trainer's webhook server their serving certificate
under ``/tmp/k8s-webhook-server``); each runs in a mount namespace of its own
where those paths hold this cluster's files, so the machine's ``/etc`` is never
written and two clusters on one machine do not share them. All act with the
administrator's credential of the cluster.
"""

from __future__ import annotations

import base64
import os
import shlex
import ssl
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from local.controlplane.binaries import binary
from local.controlplane.cluster import ControlPlaneError
from local.controlplane.install import run_kubectl
from local.controlplane.pki import HOST
from local.controlplane.service import LocalService
from local.ports import free_port
from webhook.certs import CA_FILE, CERT_FILE, KEY_FILE, generate, write_bundle

KUEUE_NAMESPACE = "kueue-system"
CRD_SECONDS = 60
OPERATOR_NAMESPACE = "kubeflow"
# The Secret the training-operator's certificate rotator fills (its --webhook-secret-name).
OPERATOR_CERT_SECRET = "training-operator-webhook-cert"
# What Kueue's webhooks are kept for: its own kinds, and the frameworks it manages.
KUEUE_WEBHOOKS = ("clusterqueue", "cohort", "resourceflavor", "workload", "pytorchjob", "trainjob")
KUEUE_FRAMEWORKS = ("kubeflow.org/pytorchjob", "trainer.kubeflow.org/trainjob")
# Where controller-runtime's webhook server (the training-operator's, the Trainer's) reads
# its serving certificate, whatever the configuration says.
SERVING_CERTS = "/tmp/k8s-webhook-server/serving-certs"
# The Trainer's runtimes the cluster offers, from its manifests (a platform installs these).
TRAINER_RUNTIMES = ("torch_distributed.yaml",)


def manifests(component: str, *parts: str) -> Path:
    """A folder of ``component``'s own YAML, beside its binary in the cache."""
    return binary(component).parent.joinpath("manifests", *parts)


def url_webhooks(
    path: Path,
    url: str,
    ca: bytes,
    keep: Iterable[str],
    prefix: str,
    *,
    patches: dict[str, Path] | None = None,
) -> list[dict[str, Any]]:
    """The webhook configurations of ``path`` reached at ``url`` + each webhook's path,
    trusting ``ca``; only the webhooks whose names contain one of ``keep``; each
    configuration renamed with ``prefix`` (as the component's kustomization does), and
    the kustomization's JSON patches of ``patches`` (kind -> file) applied to it."""
    kept = tuple(keep)
    configurations = []
    for doc in yaml.safe_load_all(path.read_text()):
        if not doc or not doc.get("kind", "").endswith("WebhookConfiguration"):
            continue
        if patches and doc["kind"] in patches:
            _replace(doc, yaml.safe_load(patches[doc["kind"]].read_text()))
        hooks = []
        for hook in doc.get("webhooks") or []:
            if not any(word in hook["name"] for word in kept):
                continue
            hook["clientConfig"] = {
                "url": url + hook["clientConfig"]["service"]["path"],
                "caBundle": base64.b64encode(ca).decode(),
            }
            hooks.append(hook)
        doc["metadata"]["name"] = prefix + doc["metadata"]["name"]
        doc["webhooks"] = hooks
        configurations.append(doc)
    return configurations


def _replace(doc: dict[str, Any], operations: list[dict[str, Any]]) -> None:
    """A kustomization's JSON patch of ``replace`` operations applied to ``doc``: the only
    operation the components' webhook patches use; any other is refused, never skipped."""
    for operation in operations:
        if operation.get("op") != "replace":
            raise ControlPlaneError(f"unsupported webhook patch operation {operation!r}")
        *parents, last = operation["path"].strip("/").split("/")
        holder: Any = doc
        for key in parents:
            holder = holder[int(key)] if isinstance(holder, list) else holder[key]
        if isinstance(holder, list):
            holder[int(last)] = operation["value"]
        else:
            holder[last] = operation["value"]


def in_private_mounts(argv: list[str], setup: str) -> list[str]:
    """``argv`` run in a mount namespace of its own, after the shell lines ``setup``."""
    return [
        "unshare", "--mount", "--propagation", "private", "sh", "-ec",
        f'{setup}\nexec "$@"', "sh", *argv,
    ]  # fmt: skip


@dataclass
class _Operator(LocalService):
    """A job controller: its serving certificate, its CRDs and webhooks applied."""

    startup_timeout: float = 90.0

    def _certified_workdir(self, name: str) -> Path:
        work = self._workdir(name)
        write_bundle(generate([HOST]), work / "certs")
        return work

    def _ca(self, work: Path) -> bytes:
        return (work / "certs" / CA_FILE).read_bytes()

    def _apply_crds(self, path: Path) -> None:
        """The CRDs of ``path`` (a file, or a folder's YAML but its kustomization), once the
        API server serves them."""
        files = (
            [path]
            if path.is_file()
            else sorted(p for p in path.glob("*.yaml") if p.name != "kustomization.yaml")
        )
        sources = [arg for file in files for arg in ("-f", str(file))]
        applied = run_kubectl(self.cluster, "apply", "--server-side", "-o", "name", *sources)
        # Polled, not `kubectl wait`: that fails on a CRD whose status has no conditions yet.
        deadline = time.monotonic() + CRD_SECONDS
        for name in applied.split():
            while True:
                established = run_kubectl(
                    self.cluster, "get", name, "-o",
                    "jsonpath={.status.conditions[?(@.type=='Established')].status}",
                    check=False,
                )  # fmt: skip
                if established.strip() == "True":
                    break
                if time.monotonic() > deadline:
                    raise ControlPlaneError(f"{name} not established within {CRD_SECONDS} s")
                time.sleep(0.2)

    def _apply(self, docs: list[dict[str, Any]]) -> None:
        run_kubectl(self.cluster, "apply", "--server-side", "-f", "-",
                    stdin=yaml.safe_dump_all(docs))  # fmt: skip

    def _run(self, argv: list[str], name: str, health_port: int, **env: str) -> None:
        """``argv`` until its health port says ready (plain HTTP on 127.0.0.1)."""
        ready = f"http://{HOST}:{health_port}/readyz"
        self._run_until_ready(
            argv, name, ready, ssl.create_default_context(), {**os.environ, **env}
        )


@dataclass
class Kueue(_Operator):
    """Kueue's controller manager, managing PyTorchJobs and TrainJobs that name a
    LocalQueue. Started after the Trainer and JobSet: Kueue sets up an integration only
    if its kinds are served when it starts."""

    def start(self) -> Kueue:
        work = self._certified_workdir("kueue")
        webhook_port, health_port = free_port(HOST), free_port(HOST)
        run_kubectl(self.cluster, "create", "namespace", KUEUE_NAMESPACE)
        self._apply_crds(manifests("kueue", "config", "components", "crd", "bases"))
        config = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": KUEUE_NAMESPACE,
            "manageJobsWithoutQueueName": False,
            "internalCertManagement": {"enable": False},
            "webhook": {"host": HOST, "port": webhook_port, "certDir": str(work / "certs")},
            "health": {"healthProbeBindAddress": f"{HOST}:{health_port}"},
            "metrics": {"bindAddress": "0"},
            "leaderElection": {"leaderElect": False},
            # On by default, it serves its API on a fixed port of every interface.
            "featureGates": {"VisibilityOnDemand": False},
            "integrations": {"frameworks": list(KUEUE_FRAMEWORKS)},
        }
        (work / "config.yaml").write_text(yaml.safe_dump(config))
        certs, upper = work / "certs", work / "etc"
        (upper / "upper").mkdir(parents=True)
        (upper / "work").mkdir()
        # Kueue reads its metrics certificate from /etc/kueue/metrics/certs whatever its
        # configuration says: /etc overlaid in its own mount namespace holds this one.
        setup = "\n".join([
            f"mount -t overlay overlay -o lowerdir=/etc,upperdir={upper}/upper,"
            f"workdir={upper}/work /etc",
            "mkdir -p /etc/kueue/metrics/certs",
            f"cp {certs}/{CERT_FILE} {certs}/{KEY_FILE} /etc/kueue/metrics/certs/",
        ])  # fmt: skip
        argv = [str(binary("kueue")), f"--config={work / 'config.yaml'}",
                f"--kubeconfig={self.cluster.kubeconfig}"]  # fmt: skip
        self._run(in_private_mounts(argv, setup), "kueue", health_port)
        self._apply(
            url_webhooks(
                manifests("kueue", "config", "components", "webhook", "manifests.yaml"),
                f"https://{HOST}:{webhook_port}",
                self._ca(work),
                KUEUE_WEBHOOKS,
                "kueue-",
            )
        )
        return self


@dataclass
class TrainingOperator(_Operator):
    """The Kubeflow training-operator (v1), running PyTorchJobs only."""

    def start(self) -> TrainingOperator:
        work = self._certified_workdir("training-operator")
        webhook_port, health_port = free_port(HOST), free_port(HOST)
        run_kubectl(self.cluster, "create", "namespace", OPERATOR_NAMESPACE)
        run_kubectl(self.cluster, "create", "secret", "generic", OPERATOR_CERT_SECRET,
                    "-n", OPERATOR_NAMESPACE)  # fmt: skip
        crds = manifests("training-operator", "manifests", "base", "crds")
        self._apply_crds(crds / "kubeflow.org_pytorchjobs.yaml")
        # Its certificate rotator waits for a serving certificate at this fixed path
        # (and its webhook server serves from there): this cluster's, in its namespace.
        setup = _serving_certs(work)
        argv = [
            str(binary("training-operator")),
            f"--kubeconfig={self.cluster.kubeconfig}",
            "--enable-scheme=pytorchjob",
            f"--webhook-server-port={webhook_port}",
            "--metrics-bind-address=0",
            f"--health-probe-bind-address={HOST}:{health_port}",
            f"--webhook-secret-name={OPERATOR_CERT_SECRET}",
        ]
        self._run(
            in_private_mounts(argv, setup), "training-operator", health_port,
            MY_POD_NAMESPACE=OPERATOR_NAMESPACE,
        )  # fmt: skip
        # Its PyTorchJob validation, under a name of its own: the rotator rewrites the CA
        # bundle of the configuration of the upstream name with a CA of its making.
        webhooks = url_webhooks(
            manifests("training-operator", "manifests", "base", "webhook", "manifests.yaml"),
            f"https://{HOST}:{webhook_port}",
            self._ca(work),
            ("pytorchjob",),
            "training-operator-",
        )
        self._apply(webhooks)
        return self


def _serving_certs(work: Path) -> str:
    """The shell lines that put ``work``'s certificates at controller-runtime's fixed path."""
    certs = shlex.quote(str(work / "certs"))
    return f"mkdir -p {SERVING_CERTS}\nmount --bind {certs} {SERVING_CERTS}"


@dataclass
class JobSet(_Operator):
    """The JobSet controller: the Trainer runs each TrainJob as a JobSet, whose Jobs
    kube-controller-manager's Job controller runs as pods."""

    def start(self) -> JobSet:
        work = self._certified_workdir("jobset")
        webhook_port, health_port = free_port(HOST), free_port(HOST)
        self._apply_crds(manifests("jobset", "config", "components", "crd", "bases"))
        config = {
            "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "webhook": {"host": HOST, "port": webhook_port, "certDir": str(work / "certs")},
            "health": {"healthProbeBindAddress": f"{HOST}:{health_port}"},
            "metrics": {"bindAddress": "0"},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
        }
        (work / "config.yaml").write_text(yaml.safe_dump(config))
        self._run(
            [str(binary("jobset")), f"--config={work / 'config.yaml'}",
             f"--kubeconfig={self.cluster.kubeconfig}"],
            "jobset", health_port,
        )  # fmt: skip
        # Its pod webhooks only for JobSet pods: the objectSelector its kustomization's
        # patches add, applied as they are.
        webhook = manifests("jobset", "config", "components", "webhook")
        patches = {
            "MutatingWebhookConfiguration": webhook / "patches" / "mutating-patch.yaml",
            "ValidatingWebhookConfiguration": webhook / "patches" / "validating-patch.yaml",
        }
        self._apply(
            url_webhooks(webhook / "manifests.yaml", f"https://{HOST}:{webhook_port}",
                         self._ca(work), ("kb.io",), "jobset-", patches=patches)
        )  # fmt: skip
        return self


@dataclass
class Trainer(_Operator):
    """The Kubeflow Trainer's controller manager (v2): TrainJobs run as JobSets from the
    cluster's training runtimes (its own ``torch-distributed`` applied)."""

    def start(self) -> Trainer:
        work = self._certified_workdir("trainer")
        webhook_port, health_port = free_port(HOST), free_port(HOST)
        base = manifests("trainer", "manifests", "base")
        self._apply_crds(base / "crds")
        config = {
            "apiVersion": "config.trainer.kubeflow.org/v1alpha1",
            "kind": "Configuration",
            "webhook": {"host": HOST, "port": webhook_port},
            "health": {"healthProbeBindAddress": f"{HOST}:{health_port}"},
            "metrics": {"bindAddress": "0"},
            "leaderElection": {"leaderElect": False},
            "certManagement": {"enable": False},
        }
        (work / "config.yaml").write_text(yaml.safe_dump(config))
        argv = [str(binary("trainer")), f"--config={work / 'config.yaml'}",
                f"--kubeconfig={self.cluster.kubeconfig}"]  # fmt: skip
        self._run(in_private_mounts(argv, _serving_certs(work)), "trainer", health_port)
        self._apply(
            url_webhooks(base / "webhook" / "manifests.yaml", f"https://{HOST}:{webhook_port}",
                         self._ca(work), ("trainer.kubeflow.org",), "trainer-")
        )  # fmt: skip
        for runtime in TRAINER_RUNTIMES:
            self._apply(list(yaml.safe_load_all((base / "runtimes" / runtime).read_text())))
        return self
