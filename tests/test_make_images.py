"""``make images``: both images built, then pushed, with docker or else podman.

No container engine runs on this project's machines (``docker info`` finds no
daemon, and base images could not be pulled), so the engine is a shell script
on a PATH of the test's own that records how it is called; make, the Makefile
and the shell are the real ones.
"""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PROJECT_VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
REGISTRY = "registry.example.com/ml"
# What the Makefile's recipe needs from PATH besides the engine.
TOOLS = ("sed", "cat")
PIN_FILES = ("kustomization.yaml", "configmap.yaml")
CHART_VALUES = ROOT / "deploy" / "helm" / "jitckpt" / "values.yaml"

# `image inspect` answers as a registry would after a push: name@digest, the digest
# derived from the image's name so each image gets its own.
ENGINE = """#!/bin/sh
echo "${0##*/} $* (in $(pwd))" >> "$RECORD"
case "$1 $3" in "build $FAIL_ON") exit 1 ;; esac
if [ "$1 $2" = "image inspect" ]; then
    case "$5" in *sidecar*) d=$SIDECAR_DIGEST ;; *) d=$WEBHOOK_DIGEST ;; esac
    echo "${5%:*}@$d"
fi
exit 0
"""
# The build script under buildah: records its call, and writes the digest files a
# push with ``--digestfile`` leaves beside the exports (``--out``).
BUILDER = """#!/bin/sh
echo "${0##*/} $* (in $(pwd))" >> "$RECORD"
echo "$SIDECAR_DIGEST" > "$IMAGES_OUT/sidecar.digest"
echo "$WEBHOOK_DIGEST" > "$IMAGES_OUT/webhook.digest"
"""
SIDECAR_DIGEST = "sha256:" + "5" * 64
WEBHOOK_DIGEST = "sha256:" + "7" * 64


@dataclass
class Run:
    returncode: int
    stderr: str
    calls: list[str]


def make_images(tmp_path: Path, engines: tuple[str, ...], *args: str, fail_on: str = "") -> Run:
    """``make images ARGS`` with only ``engines`` (fakes) and the recipe's tools on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, f"{tool} is needed to run make images"
        (bin_dir / tool).symlink_to(found)
    for engine in engines:
        (bin_dir / engine).write_text(BUILDER if engine == "builder" else ENGINE)
        (bin_dir / engine).chmod(0o755)
    record = tmp_path / "calls"
    record.touch()
    pins = tmp_path / "base"
    pins.mkdir()
    for name in PIN_FILES:
        shutil.copy(ROOT / "deploy" / "base" / name, pins / name)
    chart = tmp_path / "chart"
    chart.mkdir()
    shutil.copy(CHART_VALUES, chart / CHART_VALUES.name)
    env = {
        "PATH": str(bin_dir),
        "RECORD": str(record),
        "FAIL_ON": fail_on,
        "HOME": str(tmp_path),
        "SIDECAR_DIGEST": SIDECAR_DIGEST,
        "WEBHOOK_DIGEST": WEBHOOK_DIGEST,
        "IMAGES_OUT": str(tmp_path),
    }
    make = shutil.which("make")
    assert make, "make is needed"
    pin_dirs = (f"PIN_DIR={pins}", f"CHART_PIN_DIR={chart}")
    done = subprocess.run(
        [make, "--no-print-directory", "-C", str(ROOT), "images", *pin_dirs, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return Run(done.returncode, done.stderr, record.read_text().splitlines())


def expected(engine: str, version: str = PROJECT_VERSION) -> list[str]:
    webhook, sidecar = (f"{REGISTRY}/jitckpt-{part}:{version}" for part in ("webhook", "sidecar"))
    where = f"(in {ROOT})"
    inspect = f"{engine} image inspect --format {{{{index .RepoDigests 0}}}}"
    return [
        f"{engine} build -f Dockerfile.webhook -t {webhook} . {where}",
        f"{engine} build -f Dockerfile.sidecar -t {sidecar} . {where}",
        f"{engine} push {sidecar} {where}",
        f"{engine} push {webhook} {where}",
        f"{inspect} {sidecar} {where}",
        f"{inspect} {webhook} {where}",
    ]


def test_builds_both_then_pushes_the_sidecar_first(tmp_path: Path) -> None:
    run = make_images(tmp_path, ("docker",), f"REGISTRY={REGISTRY}/")
    assert run.returncode == 0, run.stderr
    assert run.calls == expected("docker")


def test_the_pushed_digests_are_pinned_in_the_install(tmp_path: Path) -> None:
    """What was pushed is what the install names: both images by the digest the
    registry gave them (a tag can be moved; a digest cannot)."""
    run = make_images(tmp_path, ("docker",), f"REGISTRY={REGISTRY}", "VERSION=1.2.3")
    assert run.returncode == 0, run.stderr
    base = tmp_path / "base"
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    assert kustomization["images"] == [
        {
            "name": "jitckpt-webhook",
            "newName": f"{REGISTRY}/jitckpt-webhook",
            "newTag": "1.2.3",
            "digest": WEBHOOK_DIGEST,
        }
    ]
    configmap = yaml.safe_load((base / "configmap.yaml").read_text())
    config = yaml.safe_load(configmap["data"]["config.yaml"])
    assert config["sidecar_image"] == f"{REGISTRY}/jitckpt-sidecar:1.2.3@{SIDECAR_DIGEST}"
    # The Helm chart names the same two (tests/webhook/test_helm.py holds its render
    # equal to the overlays').
    values = yaml.safe_load((tmp_path / "chart" / CHART_VALUES.name).read_text())
    assert values["webhookImage"] == {
        "repository": f"{REGISTRY}/jitckpt-webhook",
        "tag": "1.2.3",
        "digest": WEBHOOK_DIGEST,
    }
    assert values["sidecarImage"] == config["sidecar_image"]
    # Everything else in the three files is as it was.
    for before_path, after_path in [
        *((ROOT / "deploy" / "base" / name, base / name) for name in PIN_FILES),
        (CHART_VALUES, tmp_path / "chart" / CHART_VALUES.name),
    ]:
        before = before_path.read_text().splitlines()
        after = after_path.read_text().splitlines()
        assert len(before) == len(after)
        assert sum(a != b for a, b in zip(before, after, strict=True)) <= 4


def test_podman_where_there_is_no_docker_and_docker_where_both_are(tmp_path: Path) -> None:
    run = make_images(tmp_path / "podman", ("podman",), f"REGISTRY={REGISTRY}", "VERSION=1.2.3")
    assert run.returncode == 0, run.stderr
    assert run.calls == expected("podman", "1.2.3")
    both = make_images(tmp_path / "both", ("docker", "podman"), f"REGISTRY={REGISTRY}")
    assert both.calls == expected("docker")


def test_a_failed_build_pushes_nothing(tmp_path: Path) -> None:
    run = make_images(tmp_path, ("docker",), f"REGISTRY={REGISTRY}", fail_on="Dockerfile.sidecar")
    assert run.returncode != 0
    assert [call.split()[1] for call in run.calls] == ["build", "build"]
    assert (tmp_path / "base" / "configmap.yaml").read_text() == (
        ROOT / "deploy" / "base" / "configmap.yaml"
    ).read_text()


def test_without_a_registry_it_says_so_and_runs_nothing(tmp_path: Path) -> None:
    run = make_images(tmp_path, ("docker",))
    assert run.returncode != 0
    assert "set REGISTRY" in run.stderr
    assert run.calls == []


def test_without_docker_or_podman_it_says_so(tmp_path: Path) -> None:
    run = make_images(tmp_path, (), f"REGISTRY={REGISTRY}")
    assert run.returncode != 0
    assert "none of docker, podman or buildah" in run.stderr
    assert run.calls == []


def test_buildah_where_there_is_neither_docker_nor_podman(tmp_path: Path) -> None:
    """buildah needs no daemon: the build script builds both (a base from Debian's
    packages, see tools/images) and pushes them, sidecar first; here it is a fake too."""
    run = make_images(tmp_path, ("buildah", "builder"), f"REGISTRY={REGISTRY}", "PYTHON=builder")
    assert run.returncode == 0, run.stderr
    prefix = f"{REGISTRY}/jitckpt"
    assert run.calls == [
        f"builder -m tools.images --out {tmp_path} --cache /var/cache/jitckpt "
        f"--push-prefix {prefix} --version {PROJECT_VERSION} (in {ROOT})"
    ]
    pinned = yaml.safe_load((tmp_path / "base" / "configmap.yaml").read_text())
    assert f"jitckpt-sidecar:{PROJECT_VERSION}@{SIDECAR_DIGEST}" in str(pinned)
    kustomization = yaml.safe_load((tmp_path / "base" / "kustomization.yaml").read_text())
    assert any(image.get("digest") == WEBHOOK_DIGEST for image in kustomization["images"])
