"""The generated pages explain everything the code defines, and nothing it no longer does.

Each check is the one the docs build makes (``tools/docsgen/hook.py``), run
here so that a failure names what is missing; the second half of each pair
shows that the check does catch a missing or stale entry.
"""

from __future__ import annotations

from typing import Any

import pytest

from tools.docsgen import matrix, messages, messages_page, metrics_page, settings_page
from webhook.settings import SETTINGS


def test_every_setting_label_configmap_key_and_trainer_variable_is_explained() -> None:
    assert settings_page.missing() == {}


def test_the_settings_page_has_a_row_per_setting_with_its_default() -> None:
    page = settings_page.render()
    for name, setting in SETTINGS.items():
        default = "unset" if setting.default is None else f"`{setting.default}`"
        assert f"| `{name}` | {default} |" in page, name


def test_every_message_of_the_shim_and_the_sidecar_is_explained() -> None:
    assert messages_page.missing() == []


def test_every_metric_is_explained() -> None:
    assert metrics_page.missing() == []


def test_every_test_the_matrix_links_exists_and_every_package_is_pinned() -> None:
    assert matrix.missing_tests() == []


def test_the_extractors_find_messages_at_their_call_sites() -> None:
    shim = messages.shim_messages()
    assert "shim/channel.py" in shim["no-socket"].sites[0]
    assert "env:*" in shim  # a key built at run time: its literal beginning
    lines = messages.shim_lines()
    assert any(key.startswith("trainrun.exit_after_jit: JIT checkpoint-") for key in lines)
    sidecar = messages.sidecar_messages()
    assert any(key.startswith("restore.skip: skipping checkpoint-%d") for key in sidecar)
    names = {m.name for m in metrics_page.all_metrics()}
    assert {"jitckpt_upload_seconds", "jitckpt_webhook_skipped"} <= names


def test_a_message_without_an_entry_or_an_entry_without_a_message_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = messages_page.explanations

    def without_no_socket(name: str) -> Any:
        data = original(name)
        return {**data, "shim": {k: v for k, v in data["shim"].items() if k != "no-socket"}}

    monkeypatch.setattr(messages_page, "explanations", without_no_socket)
    assert messages_page.missing() == ["shim: no-socket"]
    monkeypatch.undo()
    real = messages.shim_messages()
    monkeypatch.setattr(
        messages, "shim_messages", lambda: {k: v for k, v in real.items() if k != "no-socket"}
    )
    assert messages_page.missing() == ["stale shim: no-socket"]


def test_a_metric_without_an_entry_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    original = metrics_page.explanations
    monkeypatch.setattr(
        metrics_page,
        "explanations",
        lambda name: {k: v for k, v in original(name).items() if k != "jitckpt_ready"},
    )
    assert metrics_page.missing() == ["jitckpt_ready"]


def test_a_linked_test_that_does_not_exist_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    row = {
        "name": "x",
        "packages": ["torch"],
        **{column: {"untested": {"note": "n"}} for column in matrix.COLUMNS},
        "jit": {matrix.PROVEN: {"tests": ["tests/docs/test_site.py::test_gone"]}},
    }
    monkeypatch.setattr(matrix, "rows", lambda: [row])
    assert matrix.missing_tests() == ["no test tests/docs/test_site.py::test_gone"]


def test_a_yes_without_a_test_is_refused() -> None:
    with pytest.raises(ValueError, match="yes without a test"):
        matrix.cell_of({"name": "x", "jit": {matrix.PROVEN: {}}}, "jit")
