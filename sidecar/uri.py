"""Job roots: where one job's checkpoints live in the store.

``s3://bucket/prefix/<ns>/<job>`` or ``pvc://claim/path/<ns>/<job>``, parsed by
the one destination grammar (``jitckpt/destination.py``) the webhook checked
the value with; for ``pvc://`` the claim is mounted in the sidecar, so its
root is a directory below the mount. A plain absolute or relative path is
accepted too (a claim mounted by hand, for ``jitckpt ls``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from jitckpt import destination as grammar
from jitckpt.destination import DestinationError

__all__ = ["DestinationError", "JobRoot", "parse_job_root"]


@dataclass(frozen=True)
class JobRoot:
    """A parsed job root: an S3 bucket and key prefix, or a local directory."""

    scheme: Literal["s3", "file"]
    uri: str  # canonical, for messages
    bucket: str = ""
    prefix: str = ""  # S3 key prefix without leading or trailing slash
    path: Path | None = None  # local directory (pvc:// or plain path)
    claim: str = ""  # the claim of a pvc:// root, mounted at ``path``'s mount

    def child_uri(self, key: str) -> str:
        """The user-facing address of ``key`` below this root."""
        return self.uri.rstrip("/") + "/" + key


def parse_job_root(uri: str, pvc_mount: Path) -> JobRoot:
    """Parse ``uri``; ``pvc_mount`` is where a ``pvc://`` claim is mounted."""
    if "://" in uri:
        parsed = grammar.parse(uri)
        if parsed.scheme == grammar.S3:
            return JobRoot(scheme="s3", uri=parsed.uri, bucket=parsed.name, prefix=parsed.path)
        path = pvc_mount.joinpath(*parsed.segments)
        return JobRoot(scheme="file", uri=parsed.uri, path=path, claim=parsed.name)
    if not uri.strip():
        raise DestinationError("empty destination")
    path = Path(uri).absolute()
    return JobRoot(scheme="file", uri=str(path), path=path)
