"""``webhook.patch.diff`` gives ``jsonpatch.make_patch``'s operations, its move detection off.

Where make_patch would move a value, the diff removes and adds it (the same result);
where its move detection pairs equal items and drops the pair, the diff replaces
them instead (the same result too). The diff skips what two documents
share by identity, so it is checked against jsonpatch on documents that share
most of their parts the way an injected pod shares them with its input, and
on the golden cases themselves, where the operations must be make_patch's.
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.webhook.golden import discover
from webhook import patch as patches
from webhook.mutate import mutate

scalars = st.none() | st.booleans() | st.integers(0, 2) | st.sampled_from(["a", "", "1"])
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(["a", "b", "d/e", "f~g"]), inner, max_size=3)
    ),
    max_leaves=20,
)


def edited(draw: st.DrawFn, node: Any, depth: int = 0) -> Any:
    """A changed ``node``: copies along the changes, every untouched part shared."""
    choice = draw(st.integers(0, 7))
    if choice < 3 or depth > 4:
        return node  # shared
    if choice < 4:
        return draw(json_values)  # replaced
    if choice < 5:
        return copy.deepcopy(node)  # equal, but not shared
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if not draw(st.booleans()) or draw(st.booleans()):
                out[key] = edited(draw, value, depth + 1)
        for key in draw(st.lists(st.sampled_from(["a", "x", "y/z"]), max_size=2)):
            out[key] = draw(json_values) if draw(st.booleans()) else node.get(key, 0)
        return out
    if isinstance(node, list):
        items = [edited(draw, item, depth + 1) for item in node]
        for _ in range(draw(st.integers(0, 3))):
            at = draw(st.integers(0, len(items)))
            if items and draw(st.booleans()):
                del items[min(at, len(items) - 1)]
            else:
                # often an item already there: equal items are what matching up is about
                pick = draw(st.sampled_from(node)) if node and draw(st.booleans()) else None
                items.insert(at, pick if pick is not None else draw(json_values))
        return items
    return draw(json_values)


def check_against_make_patch(before: dict[str, Any], after: dict[str, Any]) -> None:
    """The diff applies to ``after`` and is make_patch's with its move detection off.

    Not make_patch's itself wherever that shows no ``move``: its move detection pairs a
    removed item with an equal one added elsewhere and may drop the pair, leaving other
    operations than a diff without it would (before ``[a, [], a, None]``, after
    ``[[], {}, [None], a, False]``: a remove and adds instead of replaces)."""
    src, dst = copy.deepcopy(before), copy.deepcopy(after)
    reference = jsonpatch.JsonPatch.from_diff(src, dst, optimization=False).patch
    operations = patches.diff(before, after)
    assert patches.apply(before, operations) == after
    assert not any(op["op"] == "move" for op in operations)
    if before == after:
        assert operations == []
    else:
        assert operations == reference


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_diff_is_jsonpatch_make_patch(data: st.DataObject) -> None:
    before = {"spec": data.draw(json_values)}
    after = edited(data.draw, before)
    if not isinstance(after, dict):
        after = {"spec": after}
    check_against_make_patch(before, after)


def test_diff_where_make_patch_pairs_equal_items_is_the_diff_without_moves() -> None:
    """Found by the property above: make_patch removes item 0 and drops the add of the
    equal item at 3; without move detection the same items are replaced."""
    before: dict[str, Any] = {"spec": [{"d/e": 0}, [], {"d/e": 0}, None]}
    after: dict[str, Any] = {"spec": [[], {}, [None], {"d/e": 0}, False]}
    check_against_make_patch(before, after)
    assert [op["op"] for op in patches.diff(before, after)] == ["replace"] * 4 + ["add"]


def test_diff_is_a_copy() -> None:
    before: dict[str, Any] = {"spec": {"env": [{"name": "A"}]}}
    after: dict[str, Any] = {"spec": {"env": [{"name": "A"}, {"name": "B", "v": [1]}]}}
    operations = patches.diff(before, after)
    after["spec"]["env"][1]["v"].append(2)
    assert operations == [{"op": "add", "path": "/spec/env/1", "value": {"name": "B", "v": [1]}}]


def test_pointer_escapes_each_part() -> None:
    assert patches.pointer(["metadata", "annotations", "jitckpt.io/status"]) == (
        "/metadata/annotations/jitckpt.io~1status"
    )
    assert patches.pointer(["a~b", ""]) == "/a~0b/"
    assert patches.pointer([]) == ""


@pytest.mark.parametrize("case", discover(), ids=lambda c: c.name)
def test_injection_diff_is_jsonpatch_make_patch(case: Any) -> None:
    result = mutate(case.pod, case.namespace, case.config)
    before, after = {"spec": case.pod["spec"]}, {"spec": result.pod["spec"]}
    reference = jsonpatch.make_patch(copy.deepcopy(before), copy.deepcopy(after)).patch
    # An injection moves nothing: its patch is make_patch's, so its digest is too.
    assert patches.diff(before, after) == ([] if before == after else reference)
    if result.injected:
        assert patches.apply(case.pod, result.patch) == result.pod


@st.composite
def shared_lists(draw: st.DrawFn) -> tuple[list[Any], list[Any]]:
    """A list of objects and a changed copy: items shared, copied, replaced, added again."""
    items = st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 1), max_size=2)
    before = draw(st.lists(items, max_size=5))
    after: list[Any] = []
    for item in before:
        how = draw(st.sampled_from(["shared", "copied", "replaced", "dropped"]))
        if how == "shared":
            after.append(item)
        elif how == "copied":
            after.append(copy.deepcopy(item))
        elif how == "replaced":
            after.append(draw(items))
    for _ in range(draw(st.integers(0, 3))):
        again = draw(st.sampled_from(before)) if before and draw(st.booleans()) else draw(items)
        after.insert(draw(st.integers(0, len(after))), again)
    return before, after


@settings(max_examples=1000, deadline=None)
@given(shared_lists())
def test_list_diff_is_jsonpatch_make_patch(lists: tuple[list[Any], list[Any]]) -> None:
    before, after = {"spec": {"containers": lists[0]}}, {"spec": {"containers": lists[1]}}
    check_against_make_patch(before, after)


def test_only_public_jsonpatch_names_and_no_subclass() -> None:
    """webhook/patch.py uses jsonpatch's public API only (a private one breaks on upgrade)."""
    source = Path(patches.__file__).read_text()
    tree = ast.parse(source)
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "jsonpatch"
    }
    assert used and not [name for name in used if name.startswith("_")]
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            assert not any("jsonpatch" in ast.unparse(base) for base in node.bases), node.name
    assert "_compare_values" not in source and "_differing_runs" not in source
