"""What each built image holds: its part's code and exactly the dependencies it imports.

The checks of ``tests/test_images.py``, made on the image's own virtualenv (its
site-packages as pip left them) instead of the Dockerfile's text, and the
image's config as the engine committed it.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from local.podrunner.image import ImageRoot
from shim import layout
from tests.test_images import FIRST_PARTY, PROJECT, SHARED_PARTS, USER_STACK, closure, imports
from webhook.config import WebhookConfig

PARTS = ("webhook", "sidecar")
TRAINING_STACK = frozenset(
    {"torch", "transformers", "accelerate", "lightning", "numpy", "deepspeed"}
)


@pytest.fixture(params=PARTS)
def part(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def image(part: str, request: pytest.FixtureRequest) -> ImageRoot:
    built: ImageRoot = request.getfixturevalue(f"{part}_image")
    return built


def site_packages(image: ImageRoot) -> Path:
    """The site-packages of the virtualenv whose ``jitckpt`` the image's PATH finds."""
    for directory in image.config.env["PATH"].split(":"):
        if (image.rootfs / directory.lstrip("/") / "jitckpt").is_file():
            venv = image.rootfs / directory.lstrip("/") / ".."
            (found,) = venv.resolve().glob("lib/python3*/site-packages")
            return found
    raise AssertionError(f"no jitckpt on the image's PATH {image.config.env['PATH']}")


def distributions(image: ImageRoot) -> dict[str, md.Distribution]:
    found = md.distributions(path=[str(site_packages(image))])
    return {canonicalize_name(d.metadata["Name"]): d for d in found}


def owners(dists: dict[str, md.Distribution]) -> dict[str, set[str]]:
    """Top-level module -> the image's distributions that install it."""
    found: dict[str, set[str]] = {}
    for name, dist in dists.items():
        for file in dist.files or []:
            top = file.parts[0].removesuffix(".py")
            if not top.endswith((".dist-info", ".data")) and top not in ("..", "__pycache__"):
                found.setdefault(top, set()).add(name)
    return found


def requirements(dists: dict[str, md.Distribution], part: str) -> list[Requirement]:
    """jitckpt's requirements with the image's extra, as the wheel in the image declares them."""
    declared = [Requirement(raw) for raw in dists[PROJECT].requires or []]
    return [r for r in declared if r.marker is None or r.marker.evaluate({"extra": part})]


def installed_closure(dists: dict[str, md.Distribution], reqs: list[Requirement]) -> set[str]:
    """Every distribution ``reqs`` pull in, by the image's own metadata."""

    def requires(name: str) -> tuple[str, ...]:
        assert name in dists, f"{name} is required but not installed in the image"
        return tuple(dists[name].requires or ())

    return closure(reqs, requires)


def third_party_imports(image: ImageRoot) -> dict[str, list[str]]:
    """Third-party top-level imports of the image's first-party modules -> where."""
    root = site_packages(image)
    found: dict[str, list[str]] = {}
    for part in sorted(FIRST_PARTY):
        for path in sorted((root / part).rglob("*.py")):
            in_shim = part == "shim"
            for imp in imports(path, root):
                if imp.top in FIRST_PARTY or imp.top in sys.stdlib_module_names:
                    continue
                if not (in_shim and imp.top in USER_STACK):
                    found.setdefault(imp.top, []).append(imp.where)
    return found


def test_the_image_holds_its_part_and_the_shared_ones_only(image: ImageRoot, part: str) -> None:
    root = site_packages(image)
    held = {p for p in FIRST_PARTY if (root / p).is_dir()}
    assert held == SHARED_PARTS | {part}
    assert (root / "shim" / "sitecustomize.py").is_file()


def test_every_import_is_installed_in_the_image(image: ImageRoot) -> None:
    dists = distributions(image)
    found = owners(dists)
    missing = {m: where for m, where in third_party_imports(image).items() if m not in found}
    assert missing == {}, "imported by the image's code but not installed in it"


def test_the_image_installs_its_extra_and_nothing_else(image: ImageRoot, part: str) -> None:
    dists = distributions(image)
    reqs = requirements(dists, part)
    assert set(dists) == installed_closure(dists, reqs) | {PROJECT}, "installed beyond the extra"
    assert not set(dists) & TRAINING_STACK
    found = owners(dists)
    used = {d for module in third_party_imports(image) for d in found.get(module, set())}
    assert {canonicalize_name(r.name) for r in reqs} - used == set(), "installed, never imported"


def test_the_sidecar_image_compiled_its_bytecode(sidecar_image: ImageRoot) -> None:
    """Its root is read-only at run time: no module of the venv may need compiling then."""
    root = site_packages(sidecar_image)
    sources = [p for p in root.rglob("*.py") if "__pycache__" not in p.parts]
    uncompiled = [
        str(p.relative_to(root))
        for p in sources
        if not list(p.parent.glob(f"__pycache__/{p.stem}.cpython-3*.pyc"))
    ]
    assert sources and uncompiled == []


def test_the_image_config(image: ImageRoot, part: str) -> None:
    config = image.config
    user = WebhookConfig().sidecar_user_id
    assert config.user == f"{user}:{user}", "runs as the numeric non-root user"
    assert config.entrypoint == ["jitckpt"]
    port = {"webhook": 8443, "sidecar": layout.STATUS_PORT}[part]
    assert config.exposed_ports == [f"{port}/tcp"]
    cmd = {"webhook": ["webhook", "serve", "--cert-dir", "/etc/jitckpt/certs", "--port", "8443"]}
    assert config.cmd == cmd.get(part, ["agent"])
    assert config.labels["org.opencontainers.image.title"] == f"jitckpt-{part}"
    assert config.labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert config.env.get("PYTHONDONTWRITEBYTECODE") == "1", "no bytecode written at run time"
