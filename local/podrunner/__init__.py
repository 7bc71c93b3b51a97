"""Run an injected Pod on this machine as a kubelet would (for `jitckpt demo` and tests)."""

from local.podrunner.image import ImageRoot
from local.podrunner.node import NoAddress, Node
from local.podrunner.pod import Pod, PodEvent, PodResult
from local.podrunner.spec import ObjectStore, SpecError

__all__ = [
    "ImageRoot",
    "NoAddress",
    "Node",
    "ObjectStore",
    "Pod",
    "PodEvent",
    "PodResult",
    "SpecError",
]
