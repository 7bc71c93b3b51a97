"""Pick the backend for a job root."""

from __future__ import annotations

import os

from sidecar.config import AgentConfig
from sidecar.credentials import StoreAccess
from sidecar.storage.base import Store
from sidecar.storage.pvc import DirectoryStore
from sidecar.storage.s3 import S3Store
from sidecar.uri import JobRoot, parse_job_root


def open_store(
    config: AgentConfig, root: JobRoot | None = None, access: StoreAccess | None = None
) -> Store:
    """The store of ``config.destination`` (or of ``root`` when given), reached with
    ``access``'s credentials, or botocore's default chain without it."""
    target = root or parse_job_root(config.destination, config.pvc_mount)
    if target.scheme == "s3":
        return S3Store(
            target.bucket,
            target.prefix,
            target.uri,
            part_size=config.part_size,
            concurrency=config.concurrency,
            download_range_size=config.download_range_size,
            download_concurrency=config.download_concurrency,
            single_put_max=config.single_put_max,
            read_timeout=config.s3_read_timeout,
            max_attempts=config.s3_max_attempts,
            verify_ssl=config.verify_ssl,
            env={**os.environ, **access.store_env} if access is not None else None,
            session=access.session() if access is not None else None,
        )
    assert target.path is not None
    return DirectoryStore(target.path, target.uri)
