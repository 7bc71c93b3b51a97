"""Helpers of the image tests (fixtures are in conftest.py)."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

ENV_IMAGES = "JITCKPT_IMAGES"  # the directory `make images-check` exported the images to


def written_to_root(upper: Path, mount_points: set[str]) -> set[str]:
    """What a container wrote to its root: its overlay's upper directory, less the
    mount points the runtime made there (and the directories above them)."""
    made = {str(parent) for point in mount_points for parent in PurePosixPath(point).parents}
    made |= mount_points
    return {str(p.relative_to(upper)) for p in upper.rglob("*")} - made - {"."}
