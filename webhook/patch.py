"""RFC 6902 patches made by diffing two pods, and the digest the status records.

The mutation builds the wanted pod and diffs it with the input, so the HTTP
path and the offline path cannot disagree on what changed. The digest is over
a canonical form, so the same change always hashes alike.

The injection copies only what it changes and shares every other part of the
pod with its input, so the diff walks the two pods together and never looks
into a value that *is* the same object on both sides (on an admission, most
of the pod). What differs goes to jsonpatch's public ``JsonPatch.from_diff``
one subtree at a time, its paths prefixed with the subtree's: the members of
an object that only one side has, and the part of an array after the items
both share. The operations are ``jsonpatch.make_patch``'s with its move detection off:
a value it would ``move`` is removed and added instead (the same result; an
injection moves nothing). tests/webhook/test_patch.py holds it to that.

Where one side of such a subtree is empty (what an injection mostly is: members
and array items added), the ``add`` operations jsonpatch would make are written
here directly, their values copied as the JSON data they are: jsonpatch's
general diff and its ``copy.deepcopy`` were most of an admission's CPU.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import jsonpatch

Patch = list[dict[str, Any]]


def pointer(parts: Sequence[str]) -> str:
    """The JSON Pointer (RFC 6901) of ``parts``: ``~`` and ``/`` escaped in each."""
    return "".join("/" + part.replace("~", "~0").replace("/", "~1") for part in parts)


def _operations(path: tuple[str, ...], src: Any, dst: Any, first_index: int = 0) -> Patch:
    """jsonpatch's operations from ``src`` to ``dst`` (copied), at ``path``.

    For arrays that are the tail of longer ones, ``first_index`` is where they
    start: the index each operation begins with is shifted by it. Move
    detection is off: it keys every value added or removed by its
    serialization, the bulk of the cost, to find moves an injection never makes.
    """
    prefix = pointer(path)
    if not src and type(src) is type(dst) and isinstance(dst, (dict, list)):
        return _additions(prefix, dst, first_index)
    operations: Patch = jsonpatch.JsonPatch.from_diff(src, dst, optimization=False).patch
    for operation in operations:
        relative = operation["path"]
        if first_index:
            index, slash, rest = relative[1:].partition("/")
            relative = f"/{int(index) + first_index}{slash}{rest}"
        operation["path"] = prefix + relative
    return operations


def _additions(prefix: str, dst: dict[str, Any] | list[Any], first_index: int) -> Patch:
    """jsonpatch's operations from an empty object or array to ``dst``: one ``add`` per
    member, in order (array items at their index, shifted by ``first_index``)."""
    if isinstance(dst, dict):
        members = [(pointer((str(key),)), value) for key, value in dst.items()]
    else:
        members = [(f"/{first_index + index}", value) for index, value in enumerate(dst)]
    return [
        {"op": "add", "path": prefix + relative, "value": _copied(value)}
        for relative, value in members
    ]


def _copied(value: Any) -> Any:
    """A deep copy of JSON data (objects, arrays, scalars), as ``copy.deepcopy`` makes
    it but without its memo of every object seen."""
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copied(item) for item in value]
    return value


def _diff_values(path: tuple[str, ...], src: Any, dst: Any, out: Patch) -> None:
    if src is dst:
        return
    if isinstance(src, dict) and isinstance(dst, dict):
        # As jsonpatch orders them: the members only one side has, then the shared ones.
        only_src = {key: src[key] for key in src if key not in dst}
        only_dst = {key: dst[key] for key in dst if key not in src}
        if only_src or only_dst:
            out += _operations(path, only_src, only_dst)
        for key in src:
            if key in dst:
                _diff_values((*path, key), src[key], dst[key], out)
    elif isinstance(src, list) and isinstance(dst, list):
        _diff_lists(path, src, dst, out)
    else:
        out += _operations(path, src, dst)


def _diff_lists(path: tuple[str, ...], src: list[Any], dst: list[Any], out: Patch) -> None:
    # jsonpatch leaves the items at the start that serialize alike; the same
    # objects do, so they are left without serializing them.
    shared = 0
    while shared < min(len(src), len(dst)) and src[shared] is dst[shared]:
        shared += 1
    rest_src, rest_dst = src[shared:], dst[shared:]
    if len(rest_src) == len(rest_dst) == 1:
        # One item against one: jsonpatch compares them in place (the edited container).
        _diff_values((*path, str(shared)), rest_src[0], rest_dst[0], out)
    elif rest_src or rest_dst:
        out += _operations(path, rest_src, rest_dst, first_index=shared)


def diff(before: dict[str, Any], after: dict[str, Any]) -> Patch:
    """The operations that turn ``before`` into ``after``; [] when they are equal.

    Those of ``jsonpatch.make_patch(before, after)`` with its move detection off
    (see the module's docstring), copied: changing either document afterwards
    leaves the patch alone.
    """
    if before == after:
        return []
    operations: Patch = []
    _diff_values((), before, after, operations)
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


def annotate(pod: dict[str, Any], entries: dict[str, str]) -> tuple[dict[str, Any], Patch]:
    """``pod`` with ``entries`` set among its annotations (a new pod sharing all else with
    ``pod``), and the operations that make that change; none when every entry is there, or
    when the pod's metadata has no shape to write them into (a damaged pod is left alone)."""
    metadata = pod.get("metadata")
    if not isinstance(metadata, dict):
        return pod, []
    annotations = metadata.get("annotations")
    if annotations is not None and not isinstance(annotations, dict):
        return pod, []
    if isinstance(annotations, dict):
        changed = {k: v for k, v in entries.items() if annotations.get(k) != v}
        ops: Patch = [
            {"op": "add", "path": pointer(["metadata", "annotations", k]), "value": v}
            for k, v in changed.items()
        ]
        merged = {**annotations, **changed}
    else:
        merged = dict(entries)
        ops = [{"op": "add", "path": "/metadata/annotations", "value": dict(entries)}]
    if not ops:
        return pod, []
    return {**pod, "metadata": {**metadata, "annotations": merged}}, ops
