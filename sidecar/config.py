"""The sidecar's settings, read once from its environment.

The webhook writes these variables into the sidecar container (names in
``shim/layout.py``); the S3 Secret arrives as read-only files with the keys of
an OpenShift AI data connection (``sidecar/credentials.py`` reads them). The
tuning knobs below the layout names are sidecar-only: the webhook never sets
them, tests and operators may.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from shim import layout, protocol
from sidecar.uri import parse_job_root

# Sidecar-only tuning (not part of the injected pod spec).
ENV_PART_SIZE = "JITCKPT_PART_SIZE"  # multipart part size and threshold, bytes
ENV_CONCURRENCY = "JITCKPT_UPLOAD_CONCURRENCY"  # parts in flight per store
# Downloads have their own range size and concurrency: stores cost per request, and a
# restore is on the job's critical path, so it fetches larger ranges, more at once.
ENV_DOWNLOAD_RANGE_SIZE = "JITCKPT_DOWNLOAD_RANGE_SIZE"  # bytes per ranged GET
ENV_DOWNLOAD_CONCURRENCY = "JITCKPT_DOWNLOAD_CONCURRENCY"  # ranges in flight per store
ENV_S3_READ_TIMEOUT = "JITCKPT_S3_READ_TIMEOUT"  # seconds before a stalled read is retried
ENV_S3_MAX_ATTEMPTS = "JITCKPT_S3_MAX_ATTEMPTS"  # per request, botocore and our own loop
ENV_GRACE_MARGIN = "JITCKPT_GRACE_MARGIN"  # seconds kept free before the SIGKILL
ENV_TORN_MIN_AGE = "JITCKPT_TORN_MIN_AGE"  # seconds before retention may delete a torn one
# Legacy run phase: seconds to wait for a first trainer process before giving up on it.
ENV_TRAINER_START_TIMEOUT = "JITCKPT_TRAINER_START_TIMEOUT"
# Seconds a restore the trainer already waits on may take; past it, nothing is restored.
ENV_RESTORE_TIMEOUT = "JITCKPT_RESTORE_TIMEOUT"
# Seconds a socket connection that has not said hello may go without a complete line.
ENV_SOCKET_IDLE_SECONDS = "JITCKPT_SOCKET_IDLE_SECONDS"
# A JIT checkpoint streamed in parts is dropped when nothing more came for it this long.
ENV_STREAM_IDLE_SECONDS = "JITCKPT_STREAM_IDLE_SECONDS"
# Seconds the temporary keys of a web identity (IRSA) are asked for (STS's default: unset).
ENV_STS_DURATION_SECONDS = "JITCKPT_STS_DURATION_SECONDS"

S3_MIN_PART = 5 * 1024 * 1024  # S3's smallest non-final multipart part
# With the default part size, a file up to this size goes in one request, as s5cmd sends
# any file under its 50 MiB part size: a multipart upload costs two more requests and, on
# stores that join the parts when it completes (moto), a second copy of every byte.
SINGLE_PUT_MAX = 48 * 1024 * 1024
DOWNLOAD_RANGE_SIZE = 64 * 1024 * 1024
DOWNLOAD_CONCURRENCY = 8
MIN_RANGE_SIZE = 1024 * 1024  # below this, per-request cost dominates any store
# A piece per node, none smaller: a restore reads every piece, so a piece per node of a
# small file would make its requests follow the job's size, not the file's.
PIECE_MIN_SIZE = 64 * 1024 * 1024

_INTEGER = re.compile(r"[0-9]{1,9}")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def parse_bool(value: str) -> bool:
    """Annotation-style booleans: "true"/"false" and the usual spellings."""
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"not a boolean: {value!r}")


def _env_integer(source: Mapping[str, str], name: str, low: int, high: int) -> int:
    value = source.get(name)
    if value is None or value == "":
        raise ValueError(
            f"{name} is not set: the webhook copies the node count and node rank from the "
            "trainer container; without them no checkpoint's validity can be judged"
        )
    if not _INTEGER.fullmatch(value) or not low <= int(value) <= high:
        raise ValueError(f"{name}={value!r} is not an integer from {low} to {high}")
    return int(value)


def node_of_job(source: Mapping[str, str]) -> dict[str, int]:
    """``nnodes`` and ``node_rank`` from the env, required: never a guess of one node.

    A checkpoint is valid once all ``nnodes`` nodes committed; a sidecar that
    assumed one node would call a multi-node checkpoint valid after its own
    commit. The rank may be a replica index plus an offset (``jitckpt inject``
    on PyTorchJob worker templates).
    """
    nnodes = _env_integer(source, layout.ENV_NNODES, 1, layout.MAX_NNODES)
    rank = _env_integer(source, layout.ENV_NODE_RANK, 0, layout.MAX_NNODES - 1)
    if source.get(layout.ENV_NODE_RANK_OFFSET):
        rank += _env_integer(source, layout.ENV_NODE_RANK_OFFSET, 0, layout.MAX_NNODES - 1)
    return {"nnodes": nnodes, "node_rank": rank}


def nproc_of_job(source: Mapping[str, str]) -> int | None:
    """Processes per node from the env, None when unknown: torchrun also takes ``auto``,
    ``cpu`` or ``gpu`` there, and an unknown layout only makes a restore download
    every node's files (``sidecar/nodefiles.py``), never a wrong one."""
    value = source.get(layout.ENV_NPROC_PER_NODE, "")
    if not _INTEGER.fullmatch(value) or not 1 <= int(value) <= protocol.MAX_RANK:
        return None
    return int(value)


class AgentConfig(BaseModel):
    """Everything the agent needs; ``from_env`` is the only way production builds it."""

    destination: str
    job_name: str = ""
    # Defaults for tests and `jitckpt ls` only: ``from_env`` requires both (fail closed).
    node_rank: int = Field(default=0, ge=0)
    nnodes: int = Field(default=1, ge=1, le=layout.MAX_NNODES)
    nproc_per_node: int | None = Field(default=None, ge=1, le=protocol.MAX_RANK)
    pod_name: str = ""
    pod_namespace: str = ""
    pod_ip: str = "0.0.0.0"
    status_port: int = Field(default=layout.STATUS_PORT, ge=0, le=65535)
    retention: int = Field(default=0, ge=0)
    verify_ssl: bool = True
    verify_access: bool = True
    resume: bool = True
    # A store the sidecar cannot reach (no credentials, refused): the trainer runs
    # unprotected by default, never worse off than without jitckpt; "fail-closed" holds it.
    store_unreachable: Literal["run-unprotected", "fail-closed"] = "run-unprotected"
    grace_seconds: float = Field(default=300.0, gt=0)
    grace_margin: float = Field(default=5.0, ge=0)
    mode: Literal["native", "legacy"] = "native"
    local_dir: Path = Path(layout.LOCAL_DIR)
    socket_path: Path = Path(layout.SOCKET_PATH)
    pvc_mount: Path = Path(layout.PVC_MOUNT)
    part_size: int = Field(default=16 * 1024 * 1024, ge=S3_MIN_PART)
    concurrency: int = Field(default=4, ge=1, le=64)
    download_range_size: int = Field(default=DOWNLOAD_RANGE_SIZE, ge=MIN_RANGE_SIZE)
    download_concurrency: int = Field(default=DOWNLOAD_CONCURRENCY, ge=1, le=64)
    piece_min_size: int = Field(default=PIECE_MIN_SIZE, ge=64 * 1024)  # piece-min-size
    s3_read_timeout: float = Field(default=60.0, gt=0)
    s3_max_attempts: int = Field(default=8, ge=1)
    torn_min_age: float = Field(default=3600.0, ge=0)
    trainer_start_timeout: float = Field(default=1800.0, gt=0)
    # As long as the startupProbe allows a restore the trainer waits for before it starts.
    restore_timeout: float = Field(default=43200.0, gt=0, le=protocol.MAX_RESTORE_SECONDS)
    socket_idle_seconds: float = Field(default=120.0, gt=0)
    stream_idle_seconds: float = Field(default=300.0, gt=0)
    s3_secret_dir: Path | None = None
    sts_duration_seconds: int | None = Field(default=None, ge=10, le=43200)

    @property
    def single_put_max(self) -> int:
        """Files up to this size go in one request: a part size set in the env is also the
        threshold (what JITCKPT_PART_SIZE says); with the default parts, SINGLE_PUT_MAX."""
        if "part_size" in self.model_fields_set:
            return self.part_size
        return max(self.part_size, SINGLE_PUT_MAX)

    @field_validator("destination")
    @classmethod
    def _destination_set(cls, value: str) -> str:
        if not value.strip():
            raise ValueError(f"{layout.ENV_DESTINATION} is empty")
        return value.strip()

    @model_validator(mode="after")
    def _destination_parses(self) -> AgentConfig:
        parse_job_root(self.destination, self.pvc_mount)  # DestinationError is a ValueError
        return self

    @model_validator(mode="after")
    def _one_node_of_the_job(self) -> AgentConfig:
        if self.node_rank >= self.nnodes:
            raise ValueError(
                f"node rank {self.node_rank} is not below the node count {self.nnodes}"
            )
        return self

    @property
    def run_dir(self) -> Path:
        """The run volume: the socket's directory, which also holds the pid files."""
        return self.socket_path.parent

    @property
    def pids_dir(self) -> Path:
        return self.run_dir / layout.PIDS_SUBDIR

    @property
    def checkpoints_dir(self) -> Path:
        return self.local_dir / layout.CHECKPOINTS_SUBDIR

    @property
    def staging_dir(self) -> Path:
        return self.local_dir / layout.STAGING_SUBDIR

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AgentConfig:
        """Build from environment variables; unset ones take the layout defaults."""
        source = os.environ if env is None else env
        names: dict[str, str] = {
            "destination": layout.ENV_DESTINATION,
            "job_name": layout.ENV_JOB_NAME,
            "pod_name": layout.ENV_POD_NAME,
            "pod_namespace": layout.ENV_POD_NAMESPACE,
            "pod_ip": layout.ENV_POD_IP,
            "status_port": layout.ENV_STATUS_PORT,
            "retention": layout.ENV_RETENTION,
            "verify_ssl": layout.ENV_VERIFY_SSL,
            "verify_access": layout.ENV_VERIFY_ACCESS,
            "resume": layout.ENV_RESUME,
            "store_unreachable": layout.ENV_STORE_UNREACHABLE,
            "grace_seconds": layout.ENV_GRACE_SECONDS,
            "grace_margin": ENV_GRACE_MARGIN,
            "mode": layout.ENV_MODE,
            "local_dir": layout.ENV_DIR,
            "socket_path": layout.ENV_SOCKET,
            "pvc_mount": layout.ENV_PVC_MOUNT,
            "part_size": ENV_PART_SIZE,
            "concurrency": ENV_CONCURRENCY,
            "download_range_size": ENV_DOWNLOAD_RANGE_SIZE,
            "download_concurrency": ENV_DOWNLOAD_CONCURRENCY,
            "piece_min_size": layout.ENV_PIECE_MIN_SIZE,
            "s3_read_timeout": ENV_S3_READ_TIMEOUT,
            "s3_max_attempts": ENV_S3_MAX_ATTEMPTS,
            "torn_min_age": ENV_TORN_MIN_AGE,
            "trainer_start_timeout": ENV_TRAINER_START_TIMEOUT,
            "restore_timeout": ENV_RESTORE_TIMEOUT,
            "socket_idle_seconds": ENV_SOCKET_IDLE_SECONDS,
            "stream_idle_seconds": ENV_STREAM_IDLE_SECONDS,
            "s3_secret_dir": layout.ENV_S3_SECRET_DIR,
            "sts_duration_seconds": ENV_STS_DURATION_SECONDS,
        }
        booleans = {"verify_ssl", "verify_access", "resume"}
        values: dict[str, object] = {
            "destination": source.get(layout.ENV_DESTINATION, ""),
            **node_of_job(source),
            "nproc_per_node": nproc_of_job(source),
        }
        for field, env_name in names.items():
            raw = source.get(env_name)
            if raw is None or raw == "" or field == "destination":
                continue
            values[field] = parse_bool(raw) if field in booleans else raw
        return cls.model_validate(values)
