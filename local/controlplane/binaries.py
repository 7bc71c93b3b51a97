"""Where the control plane's binaries are: the per-machine cache tools/controlplane builds.

The versions are the ones tools/controlplane/go.mod pins (helm's, in its own
module: tools/controlplane/helm/go.mod), read from it, so the build and the
cluster can never disagree on which binary to take. Nothing
is built or downloaded here: a missing binary is reported with the command
that builds it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GO_MOD = REPO / "tools" / "controlplane" / "go.mod"
# helm's dependencies are Kubernetes libraries at versions of their own: a module of its own.
HELM_GO_MOD = REPO / "tools" / "controlplane" / "helm" / "go.mod"
KUEUE_GO_MOD = REPO / "tools" / "controlplane" / "kueue" / "go.mod"
OPERATOR_GO_MOD = REPO / "tools" / "controlplane" / "training-operator" / "go.mod"
TRAINER_GO_MOD = REPO / "tools" / "controlplane" / "trainer" / "go.mod"
JOBSET_GO_MOD = REPO / "tools" / "controlplane" / "jobset" / "go.mod"
CACHE_ENV = "JITCKPT_CONTROLPLANE_CACHE"
DEFAULT_CACHE = Path("/var/cache/jitckpt/controlplane")
# component -> the module whose version names its build, and the go.mod that pins it
MODULES = {
    "etcd": ("go.etcd.io/etcd/server/v3", GO_MOD),
    "kube-apiserver": ("k8s.io/kubernetes", GO_MOD),
    "kube-controller-manager": ("k8s.io/kubernetes", GO_MOD),
    "kube-scheduler": ("k8s.io/kubernetes", GO_MOD),
    "helm": ("helm.sh/helm/v3", HELM_GO_MOD),
    "kueue": ("sigs.k8s.io/kueue", KUEUE_GO_MOD),
    "training-operator": ("github.com/kubeflow/training-operator", OPERATOR_GO_MOD),
    "trainer": ("github.com/kubeflow/trainer/v2", TRAINER_GO_MOD),
    "jobset": ("sigs.k8s.io/jobset", JOBSET_GO_MOD),
}


class MissingBinary(RuntimeError):
    """A control-plane binary the cache does not hold."""


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def pinned_version(module: str, go_mod: Path = GO_MOD) -> str:
    """The version of ``module`` in go.mod's requirements (direct or indirect)."""
    match = re.search(rf"^\s*(?:require\s+)?{re.escape(module)}\s+(v\S+)", go_mod.read_text(), re.M)
    if match is None:
        raise MissingBinary(f"{go_mod} pins no version of {module}")
    return match.group(1)


def binary(component: str) -> Path:
    """The cached binary of ``component`` at its pinned version."""
    version = pinned_version(*MODULES[component])
    path = cache_root() / f"{component}-{version}" / component
    if not os.access(path, os.X_OK):
        raise MissingBinary(
            f"{component} {version} is not built at {path}: run `make controlplane` "
            f"(once per machine; {CACHE_ENV} moves the cache)"
        )
    return path
