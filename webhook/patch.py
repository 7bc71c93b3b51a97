"""RFC 6902 patches made by diffing two pods, and the digest the status records.

The mutation builds the wanted pod and lets ``jsonpatch`` find the operations,
so the HTTP path and the offline path cannot disagree on what changed. The
digest is over a canonical form, so the same change always hashes alike.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jsonpatch

Patch = list[dict[str, Any]]


def diff(before: dict[str, Any], after: dict[str, Any]) -> Patch:
    """The operations that turn ``before`` into ``after``; [] when they are equal."""
    if before == after:
        return []
    operations: Patch = jsonpatch.make_patch(before, after).patch
    return operations


def apply(document: dict[str, Any], patch: Patch) -> dict[str, Any]:
    """``document`` with ``patch`` applied (a new object)."""
    result: dict[str, Any] = jsonpatch.apply_patch(document, patch, in_place=False)
    return result


def canonical_json(value: Any) -> str:
    """Sorted keys, no spaces: one text per value."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def digest(patch: Patch) -> str:
    """SHA-256 (hex) of the patch's operations as a set of canonical JSON lines.

    A fingerprint, not instructions: the operations are sorted so that two
    equal pods whose keys merely come in another order hash alike.
    """
    lines = sorted(canonical_json(op) for op in patch)
    return hashlib.sha256("\n".join(lines).encode("ascii")).hexdigest()


def spec_digest(before: dict[str, Any], after: dict[str, Any]) -> str:
    """Digest of the operations that change the pod's spec.

    Everything an injection adds lives in the spec; its one metadata change is
    the status annotation, which records this digest and so cannot be part of it.
    """
    return digest(diff({"spec": before.get("spec")}, {"spec": after.get("spec")}))
