"""One destination grammar: the webhook, the sidecar, ``jitckpt ls`` and the demo agree.

Every value is put to each reader: the webhook's setting check, the sidecar's
job-root parser (what ``jitckpt agent`` and ``jitckpt ls`` call), the agent's
config and the demo's destination. A value is accepted by all of them or by
none, so nothing the webhook admits is refused by the sidecar at start, and
nothing the webhook refuses is accepted behind its back.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jitckpt import destination as grammar
from local.demo.destination import Destination as DemoDestination
from shim import layout
from sidecar.config import AgentConfig
from sidecar.uri import DestinationError, parse_job_root
from webhook import settings

VALID = [
    ("s3://ml-checkpoints", "s3", "ml-checkpoints", ""),
    ("s3://ml-checkpoints/", "s3", "ml-checkpoints", ""),
    ("s3://ml.checkpoints-1/team-a/runs/", "s3", "ml.checkpoints-1", "team-a/runs"),
    ("s3://bkt/with space/ünïcode", "s3", "bkt", "with space/ünïcode"),
    ("pvc://shared-ckpt", "pvc", "shared-ckpt", ""),
    ("pvc://shared-ckpt/jobs/x", "pvc", "shared-ckpt", "jobs/x"),
]

INVALID = [
    "s3://bkt/$(AWS_SECRET_ACCESS_KEY)",  # kubelet env expansion
    "pvc://claim/$(HOME)/x",
    "s3://bkt/a\nb",
    "s3://bkt/a\x00b",
    "s3://bkt/a\x7fb",
    "s3://bkt/a\\..\\b",
    "s3://Bucket/x",
    "s3://ab",
    "s3://b/p",
    "s3://-bucket",
    "s3://192.168.1.10",
    "s3://bkt/../other",
    "s3://bkt/a/../../b",
    "s3://bkt//absolute",
    "s3://bkt/a//b",
    "s3://bkt/./a",
    "s3:///x",
    "s3://",
    "pvc://Claim_1/x",
    "pvc://claim/../x",
    "pvc:///abs",
    "pvc://",
    "gs://bucket/x",
    "S3://bucket/x",
    "",
]


@pytest.mark.parametrize(("value", "scheme", "name", "path"), VALID)
def test_every_reader_accepts_a_valid_destination(
    value: str, scheme: str, name: str, path: str
) -> None:
    parsed = grammar.parse(value)
    assert (parsed.scheme, parsed.name, parsed.path) == (scheme, name, path)
    assert grammar.parse(parsed.uri) == parsed
    assert settings.validate_value("destination", value, "pod annotation") is None
    root = parse_job_root(value, Path("/mnt/claim"))
    if scheme == "s3":
        assert (root.bucket, root.prefix) == (name, path)
    else:
        assert root.claim == name
        assert root.path == Path("/mnt/claim").joinpath(*parsed.segments)
    job_root = parsed.join("ns-a", "job-1").uri
    config = AgentConfig.from_env(
        {layout.ENV_DESTINATION: job_root, layout.ENV_NNODES: "1", layout.ENV_NODE_RANK: "0"}
    )
    assert config.destination == job_root
    assert DemoDestination.from_uri(value).is_pvc == (scheme == "pvc")


@pytest.mark.parametrize("value", INVALID)
def test_every_reader_refuses_an_invalid_destination(value: str) -> None:
    with pytest.raises(DestinationError):
        grammar.parse(value)
    error = settings.validate_value("destination", value, "pod annotation")
    assert error is not None
    expansion = grammar.ENV_EXPANSION in value
    assert error.rule == (settings.NO_ENV_EXPANSION_RULE if expansion else grammar.RULE)
    if "://" in value:  # a plain path is a directory for ``jitckpt ls``, not a destination
        with pytest.raises(DestinationError):
            parse_job_root(value, Path("/mnt/claim"))
    with pytest.raises(ValueError):
        AgentConfig.from_env(
            {layout.ENV_DESTINATION: value, layout.ENV_NNODES: "1", layout.ENV_NODE_RANK: "0"}
        )
    with pytest.raises(ValueError):
        DemoDestination.from_uri(value)


def test_the_error_names_the_broken_rule() -> None:
    for value, words in [
        ("s3://bkt/$(AWS_SECRET_ACCESS_KEY)", "$("),
        ("s3://Bucket", "bucket name"),
        ("pvc://Claim", "claim name"),
        ("s3://bkt/a/../b", "'..'"),
        ("s3://bkt/a//b", "empty segment"),
        ("s3://bkt/a\tb", "control character"),
        ("gs://b", "only s3:// and pvc://"),
    ]:
        with pytest.raises(DestinationError, match=re.escape(words)):
            grammar.parse(value)


def test_a_job_root_joins_checked_segments() -> None:
    base = grammar.parse("s3://bkt/team/")
    assert base.join("ns-a", "job-1").uri == "s3://bkt/team/ns-a/job-1"
    for bad in ("..", "", "a/b", "$(X)", "a\x00"):
        with pytest.raises(DestinationError):
            base.join("ns-a", bad)
