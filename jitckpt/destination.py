"""The destination grammar: ``s3://bucket[/prefix]`` and ``pvc://claim[/path]``.

One definition for every part that reads a destination: the webhook checks a
``jitckpt.io/destination`` value with it before injecting, the sidecar parses
its job root with it at start, ``jitckpt ls`` and the demo open stores with
it. It lives here, outside every part and on the standard library alone,
because both images carry ``jitckpt/`` while neither carries the other's part.

A value that crosses a trust boundary is checked completely: the name must be
a valid bucket or claim name; the path must be relative and normalized (no
empty, ``.`` or ``..`` segment, no backslash, no control character), so it
can never leave its root in a key or on a claim; and nothing may contain
``$(``, which the kubelet expands in env values (``$(AWS_SECRET_ACCESS_KEY)``
would copy the sidecar's secret into keys, logs and ``/status``).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

S3 = "s3"
PVC = "pvc"
SCHEMES = (S3, PVC)
ENV_EXPANSION = "$("

RULE = (
    "must be s3://<bucket>[/<prefix>] with a valid S3 bucket name (3-63 lowercase "
    "letters, digits, dots, hyphens; starts and ends with a letter or digit; not an IP "
    "address) or pvc://<claim>[/<path>] with a DNS-1123 claim name; the prefix or path "
    "must be relative with no empty, '.' or '..' segment, no backslash or control "
    f"character, and no '{ENV_EXPANSION}'"
)

_DNS1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_FORBIDDEN_CHARACTER = re.compile(r"[\x00-\x1f\x7f\\]")


class DestinationError(ValueError):
    """A value that is not a destination; the message says which rule it breaks."""


@dataclass(frozen=True)
class Destination:
    """A parsed destination: scheme, bucket or claim, and a normalized relative path."""

    scheme: str  # S3 or PVC
    name: str  # the bucket (s3) or the claim (pvc)
    path: str = ""  # the key prefix or the path on the claim: no leading or trailing '/'

    @property
    def uri(self) -> str:
        """The canonical spelling (no trailing slash)."""
        base = f"{self.scheme}://{self.name}"
        return f"{base}/{self.path}" if self.path else base

    @property
    def segments(self) -> tuple[str, ...]:
        return tuple(self.path.split("/")) if self.path else ()

    def join(self, *segments: str) -> Destination:
        """This destination with ``segments`` appended, each one segment checked like the path."""
        for segment in segments:
            if not segment or "/" in segment:
                raise DestinationError(f"{segment!r} is not one path segment")
        return parse("/".join((self.uri, *segments)))


def is_dns1123_subdomain(value: str) -> bool:
    """Names of Secrets and PersistentVolumeClaims."""
    return len(value) <= 253 and bool(_DNS1123_SUBDOMAIN.match(value))


def is_bucket_name(value: str) -> bool:
    """S3 general-purpose bucket naming rules (the ones a typo can break)."""
    if not _BUCKET.match(value) or ".." in value or ".-" in value or "-." in value:
        return False
    if value.startswith(("xn--", "sthree-")) or value.endswith(("-s3alias", "--ol-s3")):
        return False
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        return True
    return False


def _path_problem(path: str) -> str | None:
    """Why ``path`` (as written after the name) is not a relative, normalized path."""
    if path.startswith("/"):
        return "the path is absolute (an empty segment after the name)"
    trimmed = path.rstrip("/")
    for segment in trimmed.split("/") if trimmed else ():
        if segment == "":
            return "the path has an empty segment ('//')"
        if segment in (".", ".."):
            return f"the path has a {segment!r} segment"
        if _FORBIDDEN_CHARACTER.search(segment):
            return "the path has a backslash or a control character"
    return None


def parse(value: str) -> Destination:
    """The destination ``value`` names, or ``DestinationError`` saying which rule it breaks."""
    if not isinstance(value, str) or not value:
        raise DestinationError("empty destination")
    if ENV_EXPANSION in value:
        raise DestinationError(f"{value!r}: contains '{ENV_EXPANSION}' (kubelet env expansion)")
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in SCHEMES:
        raise DestinationError(f"{value!r}: only s3:// and pvc:// destinations are supported")
    name, _, path = rest.partition("/")
    if scheme == S3 and not is_bucket_name(name):
        raise DestinationError(f"{value!r}: {name!r} is not a valid S3 bucket name")
    if scheme == PVC and not is_dns1123_subdomain(name):
        raise DestinationError(f"{value!r}: {name!r} is not a valid claim name (DNS-1123)")
    problem = _path_problem(path)
    if problem is not None:
        raise DestinationError(f"{value!r}: {problem}")
    return Destination(scheme, name, path.rstrip("/"))


def is_destination(value: str) -> bool:
    try:
        parse(value)
    except DestinationError:
        return False
    return True
