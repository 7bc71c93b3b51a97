"""The docs site builds with ``mkdocs build --strict``, as ``make docs`` builds it.

Strict turns every warning into a failure: a page missing from the nav, a
broken link or anchor, and (through the hook) a setting, message or metric
the code defines that no page explains. A few seconds: no torch, no pod.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tools.docsgen import flow

ROOT = Path(__file__).parents[2]


def test_the_site_builds_strict_with_every_page(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for page in (
        "quickstart",
        "platform/install",
        "platform/observability",
        "ml/hf-trainer",
        "ml/deepspeed",
        "security/threat-model",
        "troubleshooting",
        "internals",
        "compatibility",
        "reference/settings",
        "reference/messages",
        "reference/metrics",
    ):
        assert (site / page / "index.html").is_file(), page
    quickstart = (site / "quickstart" / "index.html").read_text()
    assert "--preempt-at-step" in quickstart  # the flag table, filled in from the demo's parser
    # The drawing of the flow, made at the build (never stored in docs/), shown by two pages.
    assert (site / "assets" / "flow.svg").read_text() == flow.render()
    assert not (ROOT / "docs" / "assets" / "flow.svg").exists()
    internals = (site / "internals" / "index.html").read_text()
    assert 'src="../assets/flow.svg"' in internals
    assert 'src="assets/flow.svg"' in (site / "index.html").read_text()


def test_troubleshooting_names_every_skip_reason_as_the_code_spells_it() -> None:
    """The skip reasons the metrics label, each listed as `reason` on the page."""
    from webhook import mutate

    text = (Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md").read_text()
    reasons = (*mutate.SKIP_REASONS, mutate.SKIP_NOT_CREATE, mutate.SKIP_NAMESPACE_UNKNOWN)
    missing = [r for r in reasons if f"- `{r}`:" not in text]
    assert missing == [], f"docs/troubleshooting.md does not list {missing}"
