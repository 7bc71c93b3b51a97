"""What the whole suite relies on: a test's ``xdist_group`` holds.

Tests that share an expensive fixture (a reference training run, a scan) carry
one ``xdist_group``, and ``make test`` runs ``--dist loadgroup``, so one
worker runs them all and builds the fixture once. pytest-xdist marks a grouped
test on the worker by appending ``@<group>`` to its node id; pytest 9.2.0 keeps
the id where xdist 3.8.0 does not write it, so every group was silently spread
over both workers and each built the fixture again (in one full run: torchtitan's
reference 34 s more, the plain loops' 17 s, the checkov scan 12 s). A grouped
test whose group did not hold fails, saying why, instead of the run being slow
without a word.

The shared fixtures of a group are session fixtures, not module ones: a worker
may run other modules' tests between a group's, and pytest tears a module
fixture down at each switch.
"""

from __future__ import annotations

import pytest

GROUP_LOST = pytest.StashKey[str]()


def _group(mark: pytest.Mark) -> str:
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        group = _group(mark) if mark is not None else None
        if group is not None and not item.nodeid.endswith(f"@{group}"):
            item.stash[GROUP_LOST] = group


@pytest.fixture(autouse=True)
def _xdist_group_holds(request: pytest.FixtureRequest) -> None:
    group = request.node.stash.get(GROUP_LOST, None)
    if group is not None:
        pytest.fail(
            f"--dist loadgroup: this test lost its xdist_group {group!r} (its node id has no "
            f"@{group}): this pytest and pytest-xdist do not work together (constraints.txt)"
        )
