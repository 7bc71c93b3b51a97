"""RFC 6902 patches made by diffing two pods, and the digest the status records.

The mutation builds the wanted pod and lets ``jsonpatch`` find the operations,
so the HTTP path and the offline path cannot disagree on what changed. The
digest is over a canonical form, so the same change always hashes alike.

The injection copies only what it changes and shares every other part of the
pod with its input, so the diff skips a value that *is* the same object on
both sides instead of walking it: on an admission that is most of the pod.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

import jsonpatch

Patch = list[dict[str, Any]]


class _SharingDiff(jsonpatch.DiffBuilder):
    """``jsonpatch``'s diff, minus the work that cannot change its operations.

    The operations are exactly those of ``jsonpatch.make_patch``: an object
    compared with itself yields none there either, lists that jsonpatch would
    match up item by item are only matched up where it could matter, and a
    value is serialized for move detection only once a move is possible.
    It overrides private methods of the jsonpatch pinned in constraints.txt;
    tests/webhook/test_patch.py holds it to ``make_patch`` on every upgrade.
    """

    def __init__(self, src: Any, dst: Any) -> None:
        super().__init__(src, dst, jsonpatch.JsonPatch.json_dumper)
        # (value, index) stored for move detection but not yet keyed, per storage
        self._unkeyed: tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]] = ([], [])

    def _compare_values(self, path: Any, key: Any, src: Any, dst: Any) -> None:
        if src is dst:
            return
        super()._compare_values(path, key, src, dst)  # type: ignore[misc]

    def _differing_runs(self, src: list[Any], dst: list[Any]) -> list[tuple[int, ...]]:
        # jsonpatch first skips the items at the start that serialize alike;
        # the same objects do, so they are skipped without serializing them.
        shared = 0
        shorter = min(len(src), len(dst))
        while shared < shorter and src[shared] is dst[shared]:
            shared += 1
        rest_src, rest_dst = len(src) - shared, len(dst) - shared
        runs: list[tuple[int, ...]]
        if rest_src == 0 and rest_dst == 0:
            runs = []
        elif rest_src == 0 or rest_dst == 0 or (rest_src == 1 and rest_dst == 1):
            # Nothing to match up: all added, all removed, or one item compared
            # with one (which yields no operation where the two are equal).
            runs = [(shared, len(src), shared, len(dst))]
        else:
            runs = [
                tuple(index + shared for index in run)
                for run in super()._differing_runs(src[shared:], dst[shared:])  # type: ignore[misc]
            ]
        return runs

    def store_index(self, value: Any, index: Any, st: int) -> None:
        if self.optimization:
            self._unkeyed[st].append((value, index))

    def take_index(self, value: Any, st: int) -> Any:
        unkeyed = self._unkeyed[st]
        for stored, index in unkeyed:
            super().store_index(stored, index, st)
        unkeyed.clear()
        if not self.index_storage[st]:  # type: ignore[attr-defined]
            return None  # nothing stored to move: no need to key ``value``
        return super().take_index(value, st)


def _copied(value: Any) -> Any:
    """A deep copy of a JSON value (objects and arrays copied, scalars kept)."""
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v) for v in value]
    if value is None or isinstance(value, (str, int, float)):
        return value
    return copy.deepcopy(value)


def diff(before: dict[str, Any], after: dict[str, Any]) -> Patch:
    """The operations that turn ``before`` into ``after``; [] when they are equal.

    The same operations as ``jsonpatch.make_patch(before, after)``, and like
    them copied, so changing either document afterwards leaves the patch alone.
    """
    if before == after:
        return []
    builder = _SharingDiff(before, after)
    builder._compare_values((), None, before, after)
    operations: Patch = [_copied(op) for op in builder.execute()]
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
