"""Hostile YAML given to ``jitckpt inject`` / ``audit``: refused early, in little memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.webhook.cli_support import JITCKPT, jitckpt
from webhook import safeyaml
from webhook.config import ConfigError, load_config

# Far above the jitckpt command's own footprint; far below what the expanded bomb needs.
RSS_LIMIT_KB = 200 * 1024


def billion_laughs(levels: int = 9) -> str:
    """A trainer pod whose annotation is 10**levels strings through nested aliases (< 1 KB)."""
    lines = [
        "apiVersion: v1",
        "kind: Pod",
        "metadata:",
        "  name: lol",
        "  namespace: team-a",
        "  labels:",
        "    training.kubeflow.org/job-name: lol",
        "  annotations:",
        "    a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]",
    ]
    for i in range(1, levels):
        lines.append(f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]")
    lines += [
        "spec:",
        "  containers:",
        "  - name: pytorch",
        "    image: x",
        "    env: [{name: PET_NNODES, value: '1'}, {name: RANK, value: '0'}]",
    ]
    return "\n".join(lines) + "\n"


def run_measured(*args: str) -> tuple[subprocess.CompletedProcess[str], int]:
    """``jitckpt ARGS`` and its peak RSS in KB (measured by a parent of its own)."""
    probe = (
        "import json, resource, subprocess, sys\n"
        "done = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=120)\n"
        "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
        "print(json.dumps([done.returncode, done.stdout, done.stderr, peak]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, JITCKPT, *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    code, stdout, stderr, peak = json.loads(out.stdout)
    return subprocess.CompletedProcess(args, code, stdout, stderr), int(peak)


@pytest.mark.parametrize("command", ["inject", "audit"])
def test_a_billion_laughs_file_is_refused_in_little_memory(command: str, tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(billion_laughs())
    assert bomb.stat().st_size < 1024
    run, peak_kb = run_measured(command, "-f", str(bomb))
    assert run.returncode == 2, run.stderr
    assert "aliases expand to more than" in run.stderr
    assert "Traceback" not in run.stderr and run.stdout == ""
    assert peak_kb < RSS_LIMIT_KB, f"peak RSS {peak_kb} KB"


def test_an_alias_inside_its_own_anchor_is_refused() -> None:
    run = jitckpt("inject", "-f", "-", stdin="kind: Pod\nmetadata: &m {labels: [*m]}\n")
    assert run.returncode == 2
    assert "alias *m inside its own anchor" in run.stderr and "Traceback" not in run.stderr


def test_deep_nesting_is_refused_without_a_traceback() -> None:
    run = jitckpt("inject", "-f", "-", stdin="a: " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert run.returncode == 2
    assert "not valid YAML" in run.stderr and "Traceback" not in run.stderr


def test_ordinary_anchors_and_merge_keys_still_load(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (
        "base: &base {image: x, env: [{name: A, value: '1'}]}\n"
        "one: {<<: *base, name: a}\n"
        "two: {<<: *base, name: b}\n"
    )
    (doc,) = safeyaml.load_all(text)
    assert doc["one"]["image"] == doc["two"]["image"] == "x"
    assert doc == yaml.safe_load(text)
    # Without aliases the bound never applies, however large the document.
    monkeypatch.setattr(safeyaml, "MAX_ALIASED_NODES", 100)
    items = "".join(f"- {{name: n{i}, value: '{i}'}}\n" for i in range(1000))
    assert len(safeyaml.load("items:\n" + items)["items"]) == 1000
    reused = "items: &b\n" + items + "again: [*b]\n"
    with pytest.raises(yaml.YAMLError, match="more than 100 nodes"):
        safeyaml.load(reused)


def test_the_bound_counts_what_aliases_stand_for() -> None:
    # 10**5 nodes through aliases (just over the bound) in a few lines.
    with pytest.raises(yaml.YAMLError, match="aliases expand"):
        safeyaml.load(billion_laughs(levels=6))
    assert safeyaml.load(billion_laughs(levels=3))["metadata"]["annotations"]["a2"]


def test_a_config_file_bomb_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(billion_laughs().replace("apiVersion: v1\n", "", 1))
    with pytest.raises(ConfigError, match="aliases expand"):
        load_config(path)
