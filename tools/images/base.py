"""A Python base image made of Debian's packages, for the Dockerfiles' ``PYTHON_IMAGE``.

The Dockerfiles are written for the official ``python:3.11-slim-bookworm``: they
run ``python -m pip wheel``, ``python -m venv`` and the venv's ``pip``, and
their final stage copies a virtualenv whose interpreter is the base's. Debian
bookworm's own ``python3`` (3.11), ``python3-venv``, ``python3-pip`` and
``python-is-python3`` (``/usr/bin/python``) give exactly that, built by
``debootstrap`` from the Debian mirror alone, so no registry is needed.

Made once per recipe: the image's tag is a digest of the recipe, the code of
the steps and debootstrap's version, so a change to any of them builds a new
base and an unchanged one is reused from the buildah storage.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from tools.images.buildah import Buildah


@dataclass(frozen=True)
class BaseRecipe:
    suite: str = "bookworm"
    mirror: str = "http://deb.debian.org/debian"
    security_mirror: str = "http://deb.debian.org/debian-security"
    packages: tuple[str, ...] = ("python3", "python3-venv", "python3-pip", "python-is-python3")
    # The official image's config: the Dockerfiles' `ENV PATH=...:$PATH` extends this PATH.
    env: tuple[str, ...] = (
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG=C.UTF-8",
    )
    cmd: str = "python3"

    def sources_list(self) -> str:
        """The release, its point updates and its security updates, applied at build time."""
        return (
            f"deb {self.mirror} {self.suite} main\n"
            f"deb {self.mirror} {self.suite}-updates main\n"
            f"deb {self.security_mirror} {self.suite}-security main\n"
        )


def _debootstrap_version() -> str:
    done = subprocess.run(
        ["dpkg-query", "-W", "-f=${Version}", "debootstrap"],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def base_tag(recipe: BaseRecipe) -> str:
    """``localhost/jitckpt-python-base:<digest of what builds it>``: the recipe, the
    steps (the code of the functions that run them) and debootstrap's version."""
    digest = hashlib.sha256()
    for step in (_chroot, _bootstrap, _commit):
        digest.update(inspect.getsource(step).encode())
    digest.update(_debootstrap_version().encode())
    digest.update(json.dumps(asdict(recipe), sort_keys=True).encode())
    return f"localhost/jitckpt-python-base:{digest.hexdigest()[:16]}"


def _chroot(root: Path, *argv: str) -> None:
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["chroot", str(root), *argv], check=True, env=env, stdin=subprocess.DEVNULL)


def _bootstrap(recipe: BaseRecipe, root: Path) -> None:
    """debootstrap, security updates, then nothing a container does not need."""
    include = ",".join(recipe.packages)
    options = ["--variant=minbase", f"--include={include}"]
    subprocess.run(
        ["debootstrap", *options, recipe.suite, str(root), recipe.mirror],
        check=True,
        stdin=subprocess.DEVNULL,
    )
    (root / "etc/apt/sources.list").write_text(recipe.sources_list())
    _chroot(root, "apt-get", "update", "-q")
    _chroot(root, "apt-get", "upgrade", "-q", "-y")
    _chroot(root, "apt-get", "clean")
    # Package lists, device nodes and run-time state: a container engine provides
    # /dev, /proc and /sys, and a stale list would only mislead a later apt-get.
    for emptied in ("var/lib/apt/lists", "dev", "proc", "sys", "run", "tmp", "var/log"):
        for entry in (root / emptied).iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()


def _commit(buildah: Buildah, root: Path, recipe: BaseRecipe, tag: str) -> None:
    """The root as the one layer of an image, with the official image's config."""
    container = buildah.output("from", "scratch")
    try:
        mount = buildah.output("mount", container)
        subprocess.run(["cp", "-a", f"{root}/.", mount], check=True)
        config = [f"--env={env}" for env in recipe.env]
        buildah.run("config", *config, f"--cmd={recipe.cmd}", container)
        buildah.run("commit", "--quiet", container, tag)
    finally:
        buildah.run("rm", container)


def ensure_base(buildah: Buildah, work: Path, recipe: BaseRecipe) -> str:
    """The base image's tag, built first if the storage lacks it."""
    tag = base_tag(recipe)
    if buildah.has_image(tag):
        print(f"images: base {tag} is cached", flush=True)
        return tag
    root = work / "base-root"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    try:
        _bootstrap(recipe, root)
        _commit(buildah, root, recipe, tag)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return tag
