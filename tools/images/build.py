"""Build both images from the repository's unchanged Dockerfiles and export them.

Steps, each as a platform engineer would run it by hand: a Python base made of
Debian's packages (``base.py``), ``buildah build`` of ``Dockerfile.webhook`` and
``Dockerfile.sidecar`` with only ``PYTHON_IMAGE`` set, then an export of each
image as an OCI layout (``<part>/oci``, the image as a registry would hold it)
and as its unpacked root directory (``<part>/rootfs``, for running its
entry point without an engine). ``--out DIR/<part>`` links to the export.

An export is reused while everything that built it is unchanged: the base, the
Dockerfile, the build context (the files ``.dockerignore`` lets in) and
buildah's version. One build runs at a time per cache directory (a lock), so
CI and a developer on the same machine share the cache safely.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import fnmatch
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tools.images.base import BaseRecipe, ensure_base
from tools.images.buildah import Buildah

PARTS = ("webhook", "sidecar")
DEFAULT_CACHE = Path("/var/cache/jitckpt")
KEPT_EXPORTS = 2  # per part: this build's and the one before (a second checkout's)
DONE = "complete"  # written last into an export directory
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # Debian's, where Debian's pip looks


def _ignore_patterns(context: Path) -> list[str]:
    lines = (context / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _ignored(relative: str, patterns: list[str]) -> bool:
    """Whether ``.dockerignore`` leaves ``relative`` (or a directory above it) out."""
    parts = relative.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        anywhere = pattern.removeprefix("**/")
        for prefix in prefixes:
            if fnmatch.fnmatch(prefix, pattern):
                return True
            if anywhere != pattern and fnmatch.fnmatch(prefix.rsplit("/", 1)[-1], anywhere):
                return True
    return False


def context_files(context: Path) -> Iterator[Path]:
    """The files a build sends to the engine, in a stable order."""
    patterns = _ignore_patterns(context)
    for directory, subdirs, files in os.walk(context):
        here = Path(directory)
        subdirs[:] = sorted(
            d for d in subdirs if not _ignored((here / d).relative_to(context).as_posix(), patterns)
        )
        for name in sorted(files):
            path = here / name
            if not _ignored(path.relative_to(context).as_posix(), patterns):
                yield path


def _trust() -> list[str]:
    """The build's RUN steps trust the CAs this machine trusts (a site's TLS proxy to
    PyPI, say): its bundle is mounted over the base's at build time, never copied
    into an image."""
    if not Path(CA_BUNDLE).is_file():
        return []
    return [f"--volume={CA_BUNDLE}:{CA_BUNDLE}:ro"]


def export_key(context: Path, part: str, base: str, buildah: Buildah) -> str:
    digest = hashlib.sha256(f"{base}\n{buildah.output('--version')}\n".encode())
    digest.update((context / f"Dockerfile.{part}").read_bytes())
    for path in context_files(context):
        digest.update(path.relative_to(context).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Built:
    part: str
    image: str  # the tag in the buildah storage
    export: Path  # holds oci/ and rootfs/


def _build_one(buildah: Buildah, context: Path, part: str, base: str, exports: Path) -> Built:
    key = export_key(context, part, base, buildah)
    tag = f"localhost/jitckpt-{part}:{key}"
    export = exports / f"{part}-{key}"
    if (export / DONE).exists() and buildah.has_image(tag):
        print(f"images: {part} is cached ({tag})", flush=True)
        return Built(part, tag, export)
    buildah.run(
        "build",
        "--isolation=chroot",
        "--pull=never",
        *_trust(),
        f"--build-arg=PYTHON_IMAGE={base}",
        f"--file={context / f'Dockerfile.{part}'}",
        f"--tag={tag}",
        str(context),
    )
    partial = exports / f"{part}-{key}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    buildah.run("push", "--quiet", "--disable-compression", tag, f"oci:{partial / 'oci'}:{part}")
    container = buildah.output("from", "--pull=never", tag)
    try:
        mount = buildah.output("mount", container)
        subprocess.run(["cp", "-a", f"{mount}/.", str(partial / "rootfs")], check=True)
    finally:
        buildah.run("rm", container)
    (partial / DONE).touch()
    shutil.rmtree(export, ignore_errors=True)
    partial.rename(export)
    _prune(buildah, exports, part, keep=export)
    return Built(part, tag, export)


def _prune(buildah: Buildah, exports: Path, part: str, keep: Path) -> None:
    """Drop all but the newest exports of ``part``, with their images."""
    older = sorted(
        (p for p in exports.glob(f"{part}-*") if p != keep and not p.name.endswith(".partial")),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for stale in older[KEPT_EXPORTS - 1 :]:
        tag = f"localhost/jitckpt-{part}:{stale.name.removeprefix(f'{part}-')}"
        if buildah.has_image(tag):
            buildah.run("rmi", tag)
        shutil.rmtree(stale, ignore_errors=True)


def _link(out: Path, built: Built) -> None:
    out.mkdir(parents=True, exist_ok=True)
    link = out / built.part
    temporary = out / f".{built.part}.link"
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(built.export)
    temporary.rename(link)


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build(context: Path, out: Path, cache: Path, push_prefix: str, version: str) -> list[Built]:
    """Both images, built (or reused), exported and linked under ``out``; pushed if asked."""
    buildah = Buildah(cache / "storage", Path("/run/jitckpt-buildah"))
    with _locked(cache):
        base = ensure_base(buildah, cache / "work", BaseRecipe())
        built = [_build_one(buildah, context, part, base, cache / "exports") for part in PARTS]
        for one in built:
            _link(out, one)
        # Both are built before either is pushed, the sidecar first: a webhook must
        # never name a sidecar image that is not there (as `make images` does). The
        # digest the registry gave each is written to ``out/<part>.digest`` for the pin.
        if push_prefix:
            for one in sorted(built, key=lambda b: b.part != "sidecar"):
                digest = out / f"{one.part}.digest"
                target = f"docker://{push_prefix}-{one.part}:{version}"
                buildah.run("push", "--digestfile", str(digest), one.image, target)
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.images", description=__doc__)
    parser.add_argument("--context", type=Path, default=Path.cwd())
    parser.add_argument("--out", type=Path, default=Path("build/images"))
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--push-prefix", default="", help="push to PREFIX-<part>:VERSION")
    parser.add_argument("--version", default="")
    args = parser.parse_args(argv)
    if args.push_prefix and not args.version:
        parser.error("--push-prefix needs --version")
    missing = [tool for tool in ("buildah", "debootstrap") if shutil.which(tool) is None]
    if missing:
        print(
            f"images: {' and '.join(missing)} not installed (`make images-deps`)", file=sys.stderr
        )
        return 2
    if os.geteuid() != 0:
        print("images: buildah (vfs, chroot) and debootstrap need root", file=sys.stderr)
        return 2
    context = args.context.resolve()
    for one in build(context, args.out.resolve(), args.cache, args.push_prefix, args.version):
        print(f"images: {one.part}: {one.image} -> {args.out / one.part}", flush=True)
    return 0
