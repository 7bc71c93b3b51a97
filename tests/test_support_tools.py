"""What a test does when a tool it needs is missing: skip here, fail under CI=true."""

from __future__ import annotations

import subprocess

import pytest

from tests.support import tools


def test_a_missing_tool_skips_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"python3\.9"):
        tools.unavailable("python3.9 is not installed here")


@pytest.mark.parametrize("value", ["true", "True", "1"])
def test_a_missing_tool_fails_under_ci(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception, match=r"python3\.9"):
        tools.unavailable("python3.9 is not installed here")


def test_make_setup_provides_kubectl_with_kustomize() -> None:
    kubectl = tools.kubectl()
    done = subprocess.run(
        [kubectl, "version", "--client"], capture_output=True, text=True, check=True, timeout=60
    )
    assert "Kustomize Version" in done.stdout
