"""The webhook follows its ConfigMap: a changed file is read at the next admission, an
invalid one leaves the configuration in use as it was and is reported once.

The file is swapped as the kubelet swaps a mounted ConfigMap: ``config.yaml`` is a
symlink through ``..data`` to a directory of the version, and a new version is a
new directory and an atomic rename of ``..data``."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.webhook.server_support import TEAM_A, cache_with, fixture, metric, patched, post
from webhook.config import ConfigError
from webhook.configfile import ConfigFile
from webhook.server import create_app

IMAGE = "registry.example.com/ml/jitckpt-sidecar:%s"


class MountedConfigMap:
    """A ConfigMap volume as the kubelet writes it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.version = 0

    @property
    def path(self) -> Path:
        return self.root / "config.yaml"

    def write(self, text: str) -> None:
        self.version += 1
        version = self.root / f"..2026_12_02_{self.version:02d}"
        version.mkdir()
        (version / "config.yaml").write_text(text)
        (self.root / "..data_tmp").symlink_to(version.name)
        os.replace(self.root / "..data_tmp", self.root / "..data")
        if not self.path.is_symlink():
            self.path.symlink_to("..data/config.yaml")


def sidecar_image(pod: dict, answer: dict) -> str:
    spec = patched(pod, answer)["spec"]
    containers = spec.get("initContainers", []) + spec["containers"]
    return next(c["image"] for c in containers if c["name"] == "jitckpt-agent")


def test_a_changed_configmap_is_served_at_the_next_admission_and_a_broken_one_never(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mounted = MountedConfigMap(tmp_path)
    mounted.write(f"sidecar_image: {IMAGE % 'v1'}\n")
    config = ConfigFile(mounted.path, check_seconds=0)
    first_digest = config.digest
    pod = fixture("pytorchjob-master.yaml")
    with TestClient(create_app(config, cache_with(TEAM_A))) as client:
        assert sidecar_image(pod, post(client, pod)) == IMAGE % "v1"

        mounted.write(f"sidecar_image: {IMAGE % 'v2'}\n")
        assert sidecar_image(pod, post(client, pod)) == IMAGE % "v2"
        assert config.digest != first_digest
        assert metric(client, "jitckpt_webhook_config_reloads_total", result="ok") == 1

        caplog.set_level(logging.ERROR, logger="webhook.configfile")
        mounted.write("sidecar_image: [not, an, image]\ndefaults: {jit: maybe}\n")
        for _ in range(3):  # the previous configuration stays; the error is told once
            assert sidecar_image(pod, post(client, pod)) == IMAGE % "v2"
        refused = [r for r in caplog.records if "is invalid" in r.getMessage()]
        assert len(refused) == 1
        assert "sidecar_image" in refused[0].__dict__["fields"]["error"]
        assert metric(client, "jitckpt_webhook_config_reloads_total", result="invalid") == 1

        mounted.write(f"sidecar_image: {IMAGE % 'v3'}\n")  # fixed: taken again
        assert sidecar_image(pod, post(client, pod)) == IMAGE % "v3"
        assert metric(client, "jitckpt_webhook_config_reloads_total", result="ok") == 2


def test_the_file_is_looked_at_no_more_than_once_a_check_interval(tmp_path: Path) -> None:
    mounted = MountedConfigMap(tmp_path)
    mounted.write(f"sidecar_image: {IMAGE % 'v1'}\n")
    config = ConfigFile(mounted.path, check_seconds=3600)
    mounted.write(f"sidecar_image: {IMAGE % 'v2'}\n")
    assert config.current().sidecar_image == IMAGE % "v1"  # within the interval: as read


def test_a_first_file_that_does_not_validate_stops_the_server_there(tmp_path: Path) -> None:
    mounted = MountedConfigMap(tmp_path)
    mounted.write("defaults: {jit: maybe}\n")
    with pytest.raises(ConfigError, match="jit"):
        ConfigFile(mounted.path)
