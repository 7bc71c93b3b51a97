"""Shared options for the webhook tests."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite the golden files under tests/webhook/testdata from the current output",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that compares with a golden file (it takes ``update_golden``) is marked
    ``golden``: ``make golden`` rewrites them all, webhook and CLI, in one run."""
    for item in items:
        if "update_golden" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.golden)


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    """True when the run should rewrite goldens instead of comparing with them."""
    return bool(request.config.getoption("--update-golden"))
