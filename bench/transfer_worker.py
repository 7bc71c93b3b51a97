"""One upload or download by an in-process S3 client, timed from inside its own process.

Runs as a child of `bench.transfer` so that every client starts cold and its
CPU time is its own. Prints one JSON object: seconds and CPU seconds of the
transfer itself, bytes moved, and the part size and concurrency the client used. Not
counted: interpreter start, imports, and making the client with its first request (a
listing), which the agent does before any restore or upload (its access probe).

Clients: `jitckpt` (the sidecar's storage layer through `open_store`, with the
settings a default sidecar gets; each file's CRC32C taken from the bytes the upload
sends, as the agent commits; downloads verified as a restore does) and `boto3`
(TransferManager defaults).

    python -m bench.transfer_worker --client jitckpt --direction upload \
        --local PATH --bucket B --prefix P
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Listed once before timing: the client's first request (connection, models loaded).
WARM_PREFIX = ".bench-warm/"


@dataclass(frozen=True)
class Job:
    """One transfer: a local file or directory and the S3 prefix that mirrors it."""

    direction: str  # "upload" or "download"
    local: Path  # upload: the source; download: the source it was uploaded from
    target: Path  # download: where to write; unused for upload
    bucket: str
    prefix: str

    def files(self) -> list[tuple[str, Path]]:
        """(key relative to the prefix, local source file), a single file keyed by its name."""
        if self.local.is_file():
            return [(self.local.name, self.local)]
        return sorted(
            (str(path.relative_to(self.local)), path)
            for path in self.local.rglob("*")
            if path.is_file()
        )


async def _download(
    store: Any, key: str, target: Path, expected: dict[str, tuple[int, str]]
) -> None:
    """As a restore does: the file made by the caller, written through its descriptor."""
    path = target / key
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        await store.get_file(key, fd, *expected[key])
    finally:
        os.close(fd)


async def _jitckpt(job: Job) -> dict[str, Any]:

    from sidecar import checksum
    from sidecar.config import (
        ENV_CONCURRENCY,
        ENV_DOWNLOAD_CONCURRENCY,
        ENV_DOWNLOAD_RANGE_SIZE,
        ENV_PART_SIZE,
        AgentConfig,
    )
    from sidecar.safefs import open_path
    from sidecar.storage.factory import open_store

    # The sidecar's own tuning knobs pass through; everything else is its default.
    tuning = {
        name: os.environ[name]
        for name in (
            ENV_PART_SIZE,
            ENV_CONCURRENCY,
            ENV_DOWNLOAD_RANGE_SIZE,
            ENV_DOWNLOAD_CONCURRENCY,
        )
        if name in os.environ
    }
    config = AgentConfig.from_env(
        {
            "JITCKPT_DESTINATION": f"s3://{job.bucket}/{job.prefix}",
            "JITCKPT_NNODES": "1",
            "JITCKPT_NODE_RANK": "0",
            **tuning,
        }
    )
    files = job.files()
    expected = {}
    if job.direction == "download":
        # A restore knows sizes and checksums from the manifest before it starts.
        expected = {key: (path.stat().st_size, checksum.of_file(path)) for key, path in files}
    store = open_store(config)
    async with store:
        await store.list_objects(WARM_PREFIX)  # as the agent's access probe does first
        started, cpu = time.perf_counter(), time.process_time()
        if job.direction == "upload":
            # As the agent commits: the CRC32C comes out of the upload itself.
            await asyncio.gather(*(store.put_file(key, open_path(path)) for key, path in files))
        else:
            await asyncio.gather(*(_download(store, key, job.target, expected) for key, _ in files))
        elapsed, cpu_used = time.perf_counter() - started, time.process_time() - cpu
    return {
        "seconds": elapsed,
        "cpu_seconds": cpu_used,
        "params": {
            "part_size": config.part_size,
            "concurrency": config.concurrency,
            "download_range_size": config.download_range_size,
            "download_concurrency": config.download_concurrency,
        },
    }


def _boto3(job: Job) -> dict[str, Any]:

    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.client("s3", endpoint_url=os.environ["AWS_S3_ENDPOINT"])
    config = TransferConfig()
    files = job.files()
    client.list_objects_v2(Bucket=job.bucket, Prefix=WARM_PREFIX)  # the same first request
    started, cpu = time.perf_counter(), time.process_time()
    for key, path in files:
        full = f"{job.prefix}/{key}"
        if job.direction == "upload":
            client.upload_file(str(path), job.bucket, full, Config=config)
        else:
            destination = job.target / key
            destination.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(job.bucket, full, str(destination), Config=config)
    elapsed, cpu_used = time.perf_counter() - started, time.process_time() - cpu
    return {
        "seconds": elapsed,
        "cpu_seconds": cpu_used,
        "params": {
            "part_size": config.multipart_chunksize,
            "multipart_threshold": config.multipart_threshold,
            "concurrency": config.max_concurrency,
            "files": "one after another (TransferManager per-file concurrency)",
        },
    }


def main() -> int:
    arguments = argparse.ArgumentParser(description=__doc__)
    arguments.add_argument("--client", choices=("jitckpt", "boto3"), required=True)
    arguments.add_argument("--direction", choices=("upload", "download"), required=True)
    arguments.add_argument("--local", type=Path, required=True)
    arguments.add_argument("--target", type=Path, default=Path("."))
    arguments.add_argument("--bucket", required=True)
    arguments.add_argument("--prefix", required=True)
    args = arguments.parse_args()
    job = Job(args.direction, args.local, args.target, args.bucket, args.prefix)
    report = asyncio.run(_jitckpt(job)) if args.client == "jitckpt" else _boto3(job)
    report["bytes"] = sum(path.stat().st_size for _, path in job.files())
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
