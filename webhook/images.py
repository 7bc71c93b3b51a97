"""Image references and pull policies: the sidecar is pulled as strictly as the pod's own.

A security team pins trainer images by digest and pulls them ``Always`` so a
node never runs a stale or planted copy; an injected sidecar pulled less
strictly would be the pod's weakest container. The kubelet's own default is
the rule here: no ``imagePullPolicy`` means ``Always`` for ``:latest`` or an
untagged name, ``IfNotPresent`` otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

# name[:tag][@sha256:<64 hex>], the name's path components lowercase (distribution's grammar,
# simplified to what a pull can take).
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REFERENCE = re.compile(
    rf"^(?P<name>(?:[A-Za-z0-9.-]+(?::[0-9]+)?/)?{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
    r"(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)
REFERENCE_RULE = "must be an image reference: name[:tag][@sha256:<64 hex digits>]"
# Strictest last.
POLICIES = ("Never", "IfNotPresent", "Always")


def parse(reference: str) -> re.Match[str] | None:
    return _REFERENCE.match(reference)


def is_pinned(reference: str) -> bool:
    """Whether ``reference`` names an image by digest (immutable)."""
    match = parse(reference)
    return match is not None and match.group("digest") is not None


def effective_policy(container: Mapping[str, Any]) -> str:
    """The pull policy the kubelet applies to ``container``."""
    policy = container.get("imagePullPolicy")
    if policy in POLICIES:
        return str(policy)
    image = str(container.get("image") or "")
    match = parse(image)
    if match is None:
        return "IfNotPresent"
    if match.group("digest") is None and match.group("tag") in (None, "latest"):
        return "Always"
    return "IfNotPresent"


def strictest(configured: str, containers: Iterable[Mapping[str, Any]]) -> str:
    """``configured``, raised to the strictest policy among the pod's ``containers``."""
    found = [effective_policy(c) for c in containers if isinstance(c, dict)]
    return max([configured, *found], key=POLICIES.index)
