"""Run an injected Pod on this machine as a kubelet would (for `jitckpt demo` and tests)."""

from sidecar.podrunner.node import Node
from sidecar.podrunner.pod import Pod, PodEvent, PodResult
from sidecar.podrunner.spec import ObjectStore, SpecError

__all__ = ["Node", "ObjectStore", "Pod", "PodEvent", "PodResult", "SpecError"]
