"""Every command the docs give, run as written against a real API server with jitckpt installed.

The pages are read by tests/support/doccommands.py; each command they hold is
in ``HOW`` with the way it runs here, so a command added to a page or changed
fails ``test_every_command_in_the_docs_is_run_or_said_where_it_is`` until it
is. The commands run in bash (``<(...)`` and ``>`` as the page writes them),
one page after another, in a cluster of their own: a fresh control plane with
the webhook installed from deploy/ (local/controlplane/install.py), so
``kubectl create namespace team-a`` creates it, and a store (moto) for ``jitckpt
ls``. The kubeconfig is an administrator's whose context namespace is
``team-a``, as a user's context is their namespace.

Three things differ from a reader's cluster, each said where it applies:

- a command that would replace the suite's own install (apply or delete of
  the overlay, the webhook configuration) runs as a server-side dry run, or is
  said to be checked where its objects are;
- there is no kube-controller-manager: the ``default`` ServiceAccount of a new
  namespace is created after each command, as its controller would;
- there is no node: a pod stays Pending, so what needs a running pod
  (``kubectl exec``) is said to be checked elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client, config

from local.controlplane.binaries import MODULES, MissingBinary, binary, pinned_version
from local.controlplane.cluster import ControlPlane
from local.controlplane.install import InstalledWebhook
from local.s3server import LocalS3
from tests.controlplane.kube import Kube
from tests.support.doccommands import ROOT, DocCommand, every_command
from tests.support.tools import unavailable
from tests.webhook.server_support import fixture

pytestmark = [pytest.mark.xdist_group("controlplane")]

FIRST_INSTALL = "docs/platform/first-install.md"
# The job the ML and platform pages look at: the fixture's PyTorchJob master pod.
JOB_POD = "bert-ft-master-0"
TEAM_NAMESPACES = ("team-a", "team-b")
PLACEHOLDERS = {"<pod>": JOB_POD}
BUCKET = "ml-checkpoints"
# helm template renders for a cluster of this version (the chart needs native sidecars).
KUBE_VERSION = pinned_version(*MODULES["kube-apiserver"])
# What the security page's `jitckpt inject` reads: a PyTorchJob and its namespace.
CLI_INPUT = ROOT / "tests" / "webhook" / "testdata" / "cli" / "pytorchjob.in.yaml"


@dataclass(frozen=True)
class Run:
    """Run here as written, its stdout holding ``expect`` (``""``: printing nothing at all).

    ``dry_run``: with ``--dry-run=server`` added, since it would replace the suite's
    install. ``replace``: one word of the command changed, with why in ``why``."""

    expect: str | None = None
    dry_run: bool = False
    status: int = 0  # the exit status it must end with
    replace: tuple[str, str] | None = None
    why: str = ""


@dataclass(frozen=True)
class Elsewhere:
    """Not run here: ``test`` (``path::function``) runs it, or the objects it sends."""

    test: str
    why: str


DRY_RUN = Run(dry_run=True, why="it would take down the suite's own install")
CERT_MANAGER = Elsewhere(
    "tests/controlplane/test_deploy.py::test_cert_manager_overlay_is_accepted_by_the_api_server",
    "no cert-manager runs here: the overlay's other objects are sent to the API server there",
)
SELF_SIGNED = Elsewhere(
    "tests/controlplane/test_deploy.py::test_every_object_of_the_self_signed_overlay_is_stored",
    "it points the webhook at its Service, and this machine has no Service network: the "
    "install applies the same overlay with only that address made a URL, and every object "
    "is checked stored",
)
SUITE = Elsewhere(
    "tests/e2e/test_readme.py::test_every_make_target_the_readme_and_the_docs_name_exists",
    "the suite runs inside make test (CI runs make setup, then make test)",
)
DEMO = Elsewhere(
    "tests/e2e/test_demo_scripts.py::test_unchanged_script_is_preempted_at_the_step_and_resumes",
    "train.py is the reader's script: the demo runs the project's scripts with these flags",
)
# No node runs the job here, so the store holds none of its checkpoints: ls says so, exit 1
# (what it lists is tests/sidecar's and the demo's).
ML_LS = Run(expect="no checkpoints under s3://ml-checkpoints/team-a/team-a/bert-ft", status=1)
DESCRIBE = Run(expect="jitckpt-agent")
EVENTS = Run()

# The observability page's command that writes the ConfigMap's config.yaml to a file, which
# the security page's audit reads: that page's state runs it too (pages may run in any order).
CONFIG_COMMAND = (
    "kubectl -n jitckpt-system get configmap jitckpt-webhook-config "
    "-o jsonpath='{.data.config\\.yaml}' > webhook-config.yaml"
)
HOW: dict[str, Run | Elsewhere] = {
    # --- make, the demo -----------------------------------------------------------------
    "make setup": SUITE,
    "make demo": Elsewhere(
        "tests/e2e/test_demo.py::test_default_demo_reports_ok", "the same story"
    ),
    "make test": SUITE,
    "make docs": Elsewhere(
        "tests/docs/test_site.py::test_the_site_builds_strict_with_every_page", "the same build"
    ),
    "make test-quick": SUITE,
    "make images REGISTRY=registry.example.com/ml": Elsewhere(
        "tests/test_make_images.py::test_the_pushed_digests_are_pinned_in_the_install",
        "no registry here: make images runs there with a stand-in for the engine and registry, "
        "and make test builds the images themselves (make images-check)",
    ),
    "jitckpt demo --script train.py --nnodes 2 --preempt-at-step 50 --compare -- --epochs 1": DEMO,
    "jitckpt demo --script train.py --kind trainjob": DEMO,
    "jitckpt demo --json": Elsewhere(
        "tests/e2e/test_demo.py::test_default_demo_reports_ok", "minutes of training"
    ),
    "jitckpt demo --cluster": Elsewhere(
        "tests/controlplane/test_preemption_flow.py::"
        "test_kueue_preempts_a_job_and_it_resumes_bitwise_when_admitted_again[pytorchjob]",
        "it starts a cluster of its own: run there, with --json",
    ),
    "jitckpt demo --cluster --kind trainjob": Elsewhere(
        "tests/controlplane/test_preemption_flow.py::"
        "test_kueue_preempts_a_job_and_it_resumes_bitwise_when_admitted_again[trainjob]",
        "it starts a cluster of its own: run there, with --json",
    ),
    # --- installing -----------------------------------------------------------------------
    "kubectl apply -k deploy/overlays/cert-manager": CERT_MANAGER,
    "kubectl apply -k deploy/overlays/self-signed": SELF_SIGNED,
    "kubectl get mutatingwebhookconfiguration jitckpt-webhook": Run(expect="jitckpt-webhook"),
    "kubectl create namespace jitckpt-system": Elsewhere(
        "tests/controlplane/test_deploy.py::test_the_helm_chart_is_accepted_by_the_api_server",
        "the install made it: the chart's namespace and all else are sent to the API server there",
    ),
    "kubectl label namespace jitckpt-system pod-security.kubernetes.io/enforce=restricted "
    "pod-security.kubernetes.io/enforce-version=latest": Run(
        dry_run=True, why="the install's namespace already has these labels"
    ),
    "helm install jitckpt deploy/helm/jitckpt --namespace jitckpt-system "
    "--set config.defaults.destination=s3://my-bucket/checkpoints "
    "--set config.defaults.s3-secret=checkpoint-bucket": Run(
        expect="destination: s3://my-bucket/checkpoints",
        replace=("install", f"template --kube-version={KUBE_VERSION}"),
        why="one release per cluster, and the suite's install is there: what it would "
        "install, with these values, is rendered (and the chart's render is sent to the API "
        "server by test_deploy)",
    ),
    # --- a namespace opted in -------------------------------------------------------------
    "kubectl create namespace team-a": Run(expect="namespace/team-a created"),
    "kubectl create namespace team-b": Run(expect="namespace/team-b created"),
    (
        "kubectl -n team-a create secret generic team-a-s3 "
        "--from-literal=AWS_ACCESS_KEY_ID=AKIAEXAMPLE "
        "--from-literal=AWS_SECRET_ACCESS_KEY=example-secret "
        "--from-literal=AWS_DEFAULT_REGION=us-east-1"
    ): Run(expect="secret/team-a-s3 created"),
    (
        "kubectl -n team-a create secret generic checkpoint-bucket "
        "--from-literal=AWS_ACCESS_KEY_ID=... --from-literal=AWS_SECRET_ACCESS_KEY=... "
        "--from-literal=AWS_DEFAULT_REGION=us-east-1"
    ): Run(expect="secret/checkpoint-bucket created"),
    "kubectl annotate namespace team-a jitckpt.io/destination=s3://ml-checkpoints/team-a "
    "jitckpt.io/s3-secret=team-a-s3 jitckpt.io/grace-period-seconds=600": Run(expect="annotated"),
    "kubectl annotate namespace team-a jitckpt.io/destination=s3://my-bucket/checkpoints "
    "jitckpt.io/s3-secret=checkpoint-bucket": Run(expect="annotated"),
    "kubectl label namespace team-a jitckpt.io/injection=enabled": Run(expect="labeled"),
    "kubectl -n team-a create rolebinding jitckpt-reporter --clusterrole=jitckpt-reporter "
    "--serviceaccount=team-a:default": Run(
        expect="rolebinding.rbac.authorization.k8s.io/jitckpt-reporter created"
    ),
    "kubectl -n team-b apply -f deploy/examples/checkpoint-claim.yaml": Run(
        expect="persistentvolumeclaim/team-b-checkpoints created"
    ),
    (
        "kubectl annotate namespace team-b jitckpt.io/destination=pvc://team-b-checkpoints/jitckpt"
    ): Run(expect="annotated"),
    "kubectl label namespace team-b jitckpt.io/injection=enabled": Run(expect="labeled"),
    "kubectl -n team-a create --dry-run=server -f deploy/examples/check-pod.yaml "
    "-o jsonpath='{.metadata.annotations.jitckpt\\.io/status}'": Run(
        expect='"destination":"s3://ml-checkpoints/team-a/team-a/jitckpt-check"'
    ),
    "kubectl -n team-a create --dry-run=server -f deploy/examples/check-pod.yaml "
    "-o jsonpath='{.metadata.annotations.jitckpt\\.io/reason}'": Run(expect=""),
    # --- uninstalling ---------------------------------------------------------------------
    "kubectl label namespace team-a jitckpt.io/injection-": Run(expect="unlabeled"),
    "kubectl delete mutatingwebhookconfiguration jitckpt-webhook": DRY_RUN,
    "kubectl delete -k deploy/overlays/self-signed --ignore-not-found": DRY_RUN,
    # --- a job ----------------------------------------------------------------------------
    f"kubectl get pod {JOB_POD} -o jsonpath='{{.metadata.annotations}}'": Run(
        expect="jitckpt.io/status"
    ),
    (
        f"kubectl exec {JOB_POD} -c jitckpt-agent -- python -c "
        '"import json,os,urllib.request as u; '
        "print(json.load(u.urlopen('http://%s:8471/status' "
        "% os.environ['JITCKPT_POD_IP']))['phase'])\""
    ): Elsewhere(
        "tests/sidecar/test_agent.py::test_lifecycle_restore_upload_status_and_stop",
        "no node runs the pod here: the sidecar's /status and its phase are checked there",
    ),
    "jitckpt ls s3://ml-checkpoints/team-a/team-a/bert-ft": ML_LS,
    f"kubectl describe pod {JOB_POD}": DESCRIBE,
    f"kubectl get events --field-selector involvedObject.name={JOB_POD}": EVENTS,
    "kubectl get pod <pod> -o jsonpath='{.metadata.annotations.jitckpt\\.io/reason}'": Run(
        expect=""
    ),
    CONFIG_COMMAND: Run(expect=""),
    "jitckpt audit -f <(kubectl get namespaces,pods -A -o yaml) --config webhook-config.yaml": Run(
        expect=JOB_POD
    ),
    "jitckpt inject -f pytorchjob.yaml --namespace-file ns.yaml > injected.yaml": Run(expect=""),
}


def _by_page() -> dict[str, list[DocCommand]]:
    """The commands, page by page: the first install first (it creates the namespaces)."""
    pages: dict[str, list[DocCommand]] = {FIRST_INSTALL: []}
    for command in every_command():
        pages.setdefault(command.page, []).append(command)
    return pages


def test_every_command_in_the_docs_is_run_or_said_where_it_is() -> None:
    texts = {command.text for command in every_command()}
    unknown = sorted(texts - HOW.keys())
    assert unknown == [], "commands in the docs this test does not run or place: " + repr(unknown)
    assert sorted(HOW.keys() - texts) == [], "commands no page gives any more"


@pytest.mark.parametrize(
    "place", sorted({h.test for h in HOW.values() if isinstance(h, Elsewhere)})
)
def test_each_command_run_elsewhere_names_a_test_that_exists(place: str) -> None:
    path, _, function = place.partition("::")
    function, _, case = function.partition("[")  # a parametrized test's case: its id
    source = (ROOT / path).read_text()
    assert f"def {function}(" in source, place
    assert not case or f'"{case.removesuffix("]")}"' in source, place


@dataclass
class DocsCluster:
    """The cluster, store and shell the pages' commands run in."""

    cluster: ControlPlane
    kube: Kube
    env: dict[str, str]
    cwd: Path

    def run(self, command: DocCommand) -> subprocess.CompletedProcess[str]:
        how = HOW[command.text]
        assert isinstance(how, Run)
        text = command.text
        for placeholder, value in PLACEHOLDERS.items():
            text = text.replace(placeholder, value)
        if how.replace is not None:
            old, new = how.replace
            text = text.replace(f" {old} ", f" {new} ", 1)
        if how.dry_run:
            text += " --dry-run=server"
        done = subprocess.run(
            ["bash", "-c", text], cwd=self.cwd, env=self.env, capture_output=True, text=True,
            timeout=120, check=False,
        )  # fmt: skip
        self.controller_manager()
        return done

    def controller_manager(self) -> None:
        """What kube-controller-manager's ServiceAccount controller does for a new namespace."""
        for namespace in self.kube.core.list_namespace().items:
            name = namespace.metadata.name
            accounts = self.kube.core.list_namespaced_service_account(name).items
            if "default" not in {a.metadata.name for a in accounts}:
                self.kube.core.create_namespaced_service_account(
                    name, {"metadata": {"name": "default"}}
                )

    def reset(self) -> None:
        """The team namespaces as an earlier page left them, but with nothing of jitckpt's:
        no jitckpt.io label or annotation, no Secret, pod or RoleBinding."""
        existing = {n.metadata.name for n in self.kube.core.list_namespace().items}
        for name in TEAM_NAMESPACES:
            if name not in existing:  # a page run alone: the first install made them
                self.kube.ensure_namespace({"metadata": {"name": name}})
            namespace = self.kube.core.read_namespace(name).metadata
            ours = {
                key: None
                for key in {**(namespace.labels or {}), **(namespace.annotations or {})}
                if key.startswith("jitckpt.io/")
            }
            self.kube.core.patch_namespace(
                name, {"metadata": {"labels": ours, "annotations": ours}}
            )
            self.kube.core.delete_collection_namespaced_secret(name)
            self.kube.core.delete_collection_namespaced_pod(name, grace_period_seconds=0)
            client.RbacAuthorizationV1Api(self.kube.api).delete_collection_namespaced_role_binding(
                name
            )

    def running_job_and_its_config(self) -> None:
        """``running_job``, and the webhook's config.yaml written as the docs write it."""
        self.running_job()
        subprocess.run(["bash", "-c", CONFIG_COMMAND], cwd=self.cwd, env=self.env, check=True)

    def running_job(self) -> None:
        """team-a opted in as the README says, and its job's master pod admitted."""
        self.reset()
        namespace = fixture("namespace-team-a.yaml")["metadata"]
        self.kube.core.create_namespaced_secret(
            "team-a", {"metadata": {"name": "team-a-s3"}, "stringData": {"AWS_ACCESS_KEY_ID": "x"}}
        )
        self.kube.core.patch_namespace(
            "team-a",
            {"metadata": {"labels": namespace["labels"], "annotations": namespace["annotations"]}},
        )
        pod = fixture("pytorchjob-master.yaml")
        assert pod["metadata"]["name"] == JOB_POD
        self.kube.create_pod(pod)


# The state each page's commands start from (the first install: the bare cluster).
PAGE_STATE: dict[str, Callable[[DocsCluster], None]] = {
    "docs/ml/index.md": DocsCluster.running_job,
    "docs/platform/observability.md": DocsCluster.running_job,
    "docs/troubleshooting.md": DocsCluster.running_job,
    "docs/security/index.md": DocsCluster.running_job_and_its_config,
}


@pytest.fixture(scope="module")
def docs_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DocsCluster]:
    try:
        binary("etcd"), binary("kube-apiserver"), binary("helm")
    except MissingBinary as exc:
        unavailable(str(exc))
    cwd = tmp_path_factory.mktemp("reader")
    shutil.copytree(ROOT / "deploy", cwd / "deploy")
    shutil.copy(CLI_INPUT, cwd / "pytorchjob.yaml")
    shutil.copy(
        ROOT / "tests" / "webhook" / "testdata" / "fixtures" / "namespace-team-a.yaml",
        cwd / "ns.yaml",
    )
    with ControlPlane() as cluster, InstalledWebhook(cluster), LocalS3() as store:
        assert cluster.kubeconfig is not None
        reader = cwd / "kubeconfig"
        shutil.copy(cluster.kubeconfig, reader)
        configuration = client.Configuration()
        config.load_kube_config(str(reader), client_configuration=configuration)
        kube = Kube(client.ApiClient(configuration))
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "AWS_"))},
            **store.credentials_env(),
            "KUBECONFIG": str(reader),
            "PATH": os.pathsep.join(
                [str(Path(sys.executable).parent), str(binary("helm").parent), os.environ["PATH"]]
            ),
        }
        subprocess.run(
            ["kubectl", "config", "set-context", "--current", "--namespace=team-a"],
            env=env, check=True, capture_output=True,
        )  # fmt: skip
        store.client().create_bucket(Bucket=BUCKET)
        yield DocsCluster(cluster, kube, env, cwd)


@pytest.mark.parametrize("page", list(_by_page()))
def test_the_commands_of_a_page_run_as_written(page: str, docs_cluster: DocsCluster) -> None:
    """In page order, each page from its state; a page's commands in their own order."""
    PAGE_STATE.get(page, DocsCluster.reset if page != FIRST_INSTALL else lambda _: None)(
        docs_cluster
    )
    commands = _by_page()[page]
    for command in commands:
        how = HOW[command.text]
        if isinstance(how, Elsewhere):
            continue
        done = docs_cluster.run(command)
        where = f"{command.page}:{command.line}: {command.text}"
        assert done.returncode == how.status, f"{where}\n{done.stdout}\n{done.stderr}"
        if how.expect == "":
            assert done.stdout.strip() == "", f"{where} printed {done.stdout!r}"
        elif how.expect is not None:
            assert how.expect in done.stdout, f"{where} printed {done.stdout!r}"
