"""The runner's image roots: the kubelet's rules for command, user and paths in an image.

The containers themselves run in tests/images (they need the built images);
here the rules, on a made-up image config and root.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from local.podrunner.image import ImageConfig, ImageRoot
from local.podrunner.launch import _in_root
from local.podrunner.spec import SpecError, container_argv

CONFIG = ImageConfig(
    env={"PATH": "/app/bin:/usr/bin"},
    entrypoint=["jitckpt"],
    cmd=["agent"],
    user="65532:65532",
    working_dir="/",
    exposed_ports=["8471/tcp"],
    labels={},
)


def test_command_replaces_the_entrypoint_and_args_the_cmd() -> None:
    env = {"WHERE": "/x"}
    run = container_argv
    assert run({"name": "c"}, env, CONFIG.entrypoint, CONFIG.cmd) == ["jitckpt", "agent"]
    assert run({"args": ["ls", "$(WHERE)"]}, env, ["jitckpt"], ["agent"]) == ["jitckpt", "ls", "/x"]
    assert run({"command": ["sh"]}, env, ["jitckpt"], ["agent"]) == ["sh"]
    assert run({"command": ["sh"], "args": ["-c", "true"]}, env, ["e"], ["c"]) == [
        "sh",
        "-c",
        "true",
    ]
    with pytest.raises(SpecError, match="no command"):
        run({"name": "c"}, env)


def test_the_security_context_user_comes_first_then_the_image_s() -> None:
    image = ImageRoot(Path("/nonexistent"), CONFIG)
    assert image.user({}, {}) == (65532, 65532)
    assert image.user({}, {"securityContext": {"runAsUser": 1000}}) == (1000, 65532)
    own = {"securityContext": {"runAsUser": 7, "runAsGroup": 8}}
    assert image.user(own, {"securityContext": {"runAsUser": 1000}}) == (7, 8)
    as_root = ImageRoot(Path("/nonexistent"), replace(CONFIG, user=""))
    assert as_root.user({}, {}) == (0, 0)
    with pytest.raises(SpecError, match="runAsNonRoot"):
        as_root.user({"securityContext": {"runAsNonRoot": True}}, {})
    with pytest.raises(SpecError, match="not numeric"):
        ImageRoot(Path("/x"), replace(CONFIG, user="nobody")).user({}, {})


def test_paths_in_the_image_resolve_inside_it(tmp_path: Path) -> None:
    """Debian's /var/run -> /run is followed inside the image, and nothing leads out."""
    top = tmp_path / "root"
    (top / "var").mkdir(parents=True)
    (top / "run").mkdir()
    os.symlink("/run", top / "var" / "run")
    os.symlink("../../../..", top / "var" / "up")
    os.symlink("/", top / "var" / "slash")
    root = str(top)
    assert _in_root(root, "/var/run/jitckpt") == f"{root}/run/jitckpt"
    assert _in_root(root, "/var/up/etc/passwd") == f"{root}/etc/passwd"
    assert _in_root(root, "/../../etc") == f"{root}/etc"
    assert _in_root(root, "/var/slash/var/run/x") == f"{root}/run/x"
    os.symlink("loop", top / "loop")
    with pytest.raises(OSError, match="too many symbolic links"):
        _in_root(root, "/loop/x")
