"""Job roots: where one job's checkpoints live in the store.

``s3://bucket/prefix/<ns>/<job>`` or ``pvc://claim/path/<ns>/<job>``; for
``pvc://`` the claim is mounted in the sidecar, so its root is a directory.
A plain path is accepted too (a claim mounted by hand, for ``jitckpt ls``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal


class DestinationError(ValueError):
    """A destination that names no usable job root."""


@dataclass(frozen=True)
class JobRoot:
    """A parsed job root: an S3 bucket and key prefix, or a local directory."""

    scheme: Literal["s3", "file"]
    uri: str  # as the user wrote it, for messages
    bucket: str = ""
    prefix: str = ""  # S3 key prefix without leading or trailing slash
    path: Path | None = None  # local directory (pvc:// or plain path)

    def child_uri(self, key: str) -> str:
        """The user-facing address of ``key`` below this root."""
        return self.uri.rstrip("/") + "/" + key


def _clean_parts(raw: str, uri: str) -> list[str]:
    parts = [p for p in PurePosixPath(raw).parts if p not in ("/", "")]
    if any(p in (".", "..") for p in parts):
        raise DestinationError(f"{uri}: '.' and '..' are not allowed in a destination")
    return parts


def parse_job_root(uri: str, pvc_mount: Path) -> JobRoot:
    """Parse ``uri``; ``pvc_mount`` is where a ``pvc://`` claim is mounted."""
    text = uri.strip()
    if text.startswith("s3://"):
        rest = text[len("s3://") :]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise DestinationError(f"{uri}: no bucket")
        parts = _clean_parts(prefix, uri)
        return JobRoot(scheme="s3", uri=text.rstrip("/"), bucket=bucket, prefix="/".join(parts))
    if text.startswith("pvc://"):
        rest = text[len("pvc://") :]
        claim, _, sub = rest.partition("/")
        if not claim:
            raise DestinationError(f"{uri}: no claim name")
        parts = _clean_parts(sub, uri)
        return JobRoot(scheme="file", uri=text.rstrip("/"), path=pvc_mount.joinpath(*parts))
    if "://" in text:
        raise DestinationError(f"{uri}: only s3:// and pvc:// destinations are supported")
    if not text:
        raise DestinationError("empty destination")
    path = Path(text).absolute()
    return JobRoot(scheme="file", uri=str(path), path=path)
