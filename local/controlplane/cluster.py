"""A Kubernetes control plane on 127.0.0.1: etcd and kube-apiserver, TLS throughout.

What a production cluster's API server is, in the parts admission depends on:
client-certificate and service-account-token authentication, RBAC, a
service-account issuer with its own signing key, and the admission plugins an
installer enables (Pod Security and the webhooks among them, NodeRestriction
added to the defaults as kubeadm does). There is no Service network: an
admission webhook is reached by URL. With ``controllers`` set,
kube-controller-manager (service accounts, the CA ConfigMap, Jobs, garbage
collection, namespaces, node lifecycle) and kube-scheduler run beside it; the
nodes are ``local/kubelet`` processes, each given its credential here. Without,
pods stay Pending.

etcd runs without fsync: its data lives in a temporary directory that dies
with the cluster, and the fsyncs would cost seconds on a loaded disk.
"""

from __future__ import annotations

import ssl
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from local.background import Background
from local.controlplane.binaries import binary
from local.controlplane.pki import HOST, ClusterPKI, KeyPair, make_pki
from local.ports import free_port

SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
SERVICE_CIDR = "10.96.0.0/12"
# Enabled on top of the API server's defaults, which already hold NamespaceLifecycle,
# LimitRanger, ServiceAccount, Priority, DefaultTolerationSeconds, PodSecurity,
# MutatingAdmissionWebhook, ValidatingAdmissionPolicy, ValidatingAdmissionWebhook
# and ResourceQuota; named here too, so that a reader sees the chain they meet.
ADMISSION_PLUGINS = (
    "NodeRestriction",
    "NamespaceLifecycle",
    "LimitRanger",
    "ServiceAccount",
    "Priority",
    "PodSecurity",
    "MutatingAdmissionWebhook",
    "ValidatingAdmissionWebhook",
    "ResourceQuota",
)


class ControlPlaneError(RuntimeError):
    """The control plane did not come up; the message carries its processes' last words."""


def still_running(*processes: Background) -> None:
    """Raises ``ControlPlaneError`` once one of ``processes`` has exited."""
    for process in processes:
        code = process.exited()
        if code is not None:
            raise ControlPlaneError(f"{process.name} exited with {code}")


@dataclass
class ControlPlane:
    """etcd and kube-apiserver as child processes; use as a context manager.

    ``kubeconfig`` is an administrator's (group system:masters), for the
    installer and the tests; workloads get service-account tokens.
    """

    startup_timeout: float = 120.0
    workdir: Path | None = None
    apiserver_port: int = 0
    controllers: bool = False
    # the nodes a kubelet may register as: each gets a credential (node_kubeconfig)
    nodes: tuple[str, ...] = ()
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, init=False, repr=False)
    _processes: list[Background] = field(default_factory=list, init=False, repr=False)
    pki: ClusterPKI | None = field(default=None, init=False)
    kubeconfig: Path | None = field(default=None, init=False)

    @property
    def server(self) -> str:
        return f"https://{HOST}:{self.apiserver_port}"

    def start(self) -> ControlPlane:
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="jitckpt-controlplane-")
            self.workdir = Path(self._tmp.name)
        pki = self.pki = make_pki(self.workdir / "pki", nodes=self.nodes)
        etcd_port, peer_port = free_port(HOST), free_port(HOST)
        self.apiserver_port = self.apiserver_port or free_port(HOST)
        etcd_url = f"https://{HOST}:{etcd_port}"
        peer_url = f"http://{HOST}:{peer_port}"
        etcd = Background(
            [
                str(binary("etcd")),
                "--name=controlplane",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=controlplane={peer_url}",
                f"--cert-file={pki.etcd_server.cert}",
                f"--key-file={pki.etcd_server.key}",
                f"--trusted-ca-file={pki.ca}",
                "--client-cert-auth=true",
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
            log=self.workdir / "etcd.log",
            name="etcd",
        )
        apiserver = Background(
            [
                str(binary("kube-apiserver")),
                f"--etcd-servers={etcd_url}",
                f"--etcd-cafile={pki.ca}",
                f"--etcd-certfile={pki.apiserver_etcd_client.cert}",
                f"--etcd-keyfile={pki.apiserver_etcd_client.key}",
                f"--bind-address={HOST}",
                f"--advertise-address={HOST}",
                f"--secure-port={self.apiserver_port}",
                f"--tls-cert-file={pki.apiserver.cert}",
                f"--tls-private-key-file={pki.apiserver.key}",
                f"--client-ca-file={pki.ca}",
                "--authorization-mode=Node,RBAC",
                f"--enable-admission-plugins={','.join(ADMISSION_PLUGINS)}",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={pki.service_account_pub}",
                f"--service-account-signing-key-file={pki.service_account_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--allow-privileged=true",
                "--profiling=false",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                "--v=1",
            ],
            log=self.workdir / "kube-apiserver.log",
            name="kube-apiserver",
        )
        self._processes = [etcd, apiserver]
        self.kubeconfig = self._write_kubeconfig()
        try:
            etcd.start()
            apiserver.start()
            self._wait_ready()
            if self.controllers:
                self._start_controllers()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_controllers(self) -> None:
        """kube-controller-manager and kube-scheduler, each as its own bootstrap user.

        Leader election is off (one replica of each). The controller manager signs
        nothing but service-account tokens for its controllers
        (``--use-service-account-credentials``, as kubeadm runs it) and publishes the
        CA as ``kube-root-ca.crt`` in every namespace."""
        assert self.pki is not None and self.workdir is not None
        pki, ports = self.pki, (free_port(HOST), free_port(HOST))
        manager = self._client_kubeconfig("controller-manager", pki.controller_manager)
        scheduler = self._client_kubeconfig("scheduler", pki.scheduler)
        common = ["--bind-address=" + HOST, "--leader-elect=false", "--v=1"]
        started = [
            Background(
                [
                    str(binary("kube-controller-manager")),
                    *common,
                    f"--secure-port={ports[0]}",
                    *_authenticated_by(manager),
                    f"--root-ca-file={pki.ca}",
                    f"--service-account-private-key-file={pki.service_account_key}",
                    "--use-service-account-credentials=true",
                    f"--cert-dir={self.workdir / 'controller-manager-certs'}",
                ],
                log=self.workdir / "kube-controller-manager.log",
                name="kube-controller-manager",
            ),
            Background(
                [
                    str(binary("kube-scheduler")),
                    *common,
                    f"--secure-port={ports[1]}",
                    *_authenticated_by(scheduler),
                ],
                log=self.workdir / "kube-scheduler.log",
                name="kube-scheduler",
            ),
        ]
        self._processes += started
        for process in started:
            process.start()
        # Their health endpoints are served with certificates of their own making.
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        for port in ports:
            self._wait_for(f"https://{HOST}:{port}/healthz", context)

    def node_kubeconfig(self, node: str) -> Path:
        """The kubelet's kubeconfig for ``node`` (one of ``nodes``)."""
        assert self.pki is not None
        return self._client_kubeconfig(f"node-{node}", self.pki.nodes[node])

    def _client_kubeconfig(self, stem: str, pair: KeyPair) -> Path:
        assert self.pki is not None and self.workdir is not None
        path = self.workdir / f"{stem}.kubeconfig"
        path.write_text(
            kubeconfig(
                self.server,
                self.pki.ca,
                user={"client-certificate": str(pair.cert), "client-key": str(pair.key)},
            )
        )
        path.chmod(0o600)
        return path

    def _write_kubeconfig(self) -> Path:
        assert self.pki is not None
        return self._client_kubeconfig("admin", self.pki.admin)

    def _wait_ready(self) -> None:
        """Until /readyz answers ok: storage, RBAC's bootstrap roles, the default namespaces."""
        assert self.pki is not None
        context = ssl.create_default_context(cafile=str(self.pki.ca))
        context.load_cert_chain(str(self.pki.admin.cert), str(self.pki.admin.key))

        self._wait_for(f"{self.server}/readyz", context)

    def _wait_for(self, url: str, context: ssl.SSLContext) -> None:
        """Until ``url`` answers 200; any server exiting first fails with every log's tail."""
        processes = self._processes
        try:
            wait_ready(url, context, self.startup_timeout, lambda: still_running(*processes))
        except ControlPlaneError as exc:
            raise ControlPlaneError(f"{exc}\n{self.logs()}") from None

    def logs(self) -> str:
        """The last lines of every server's log, for a failure's message."""
        return "\n".join(p.tail() for p in self._processes)

    def stop(self) -> None:
        """The API server first, then its storage; then the files."""
        for process in reversed(self._processes):
            process.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _authenticated_by(kubeconfig: Path) -> list[str]:
    """A controller's own client, and the delegated authentication and authorization of
    its secure port, all as one user."""
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
    ]


def wait_ready(
    url: str, context: ssl.SSLContext, timeout: float, running: Callable[[], None]
) -> None:
    """Until GET ``url`` answers 200; ``running`` raises once the server has exited."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        running()
        try:
            with urllib.request.urlopen(url, context=context, timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.2)
    raise ControlPlaneError(f"{url} not ready within {timeout:.0f}s ({last})")


def kubeconfig(server: str, ca: Path, user: dict[str, str], name: str = "controlplane") -> str:
    """A kubeconfig for one cluster and one user (a client certificate or a token)."""
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": name, "cluster": {"server": server, "certificate-authority": str(ca)}}
            ],
            "users": [{"name": name, "user": user}],
            "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
            "current-context": name,
        }
    )
