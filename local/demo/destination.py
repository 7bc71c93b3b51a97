"""Where the demo's checkpoints go, and how the demo itself looks into that store.

Three kinds: the embedded S3 server (moto, on 127.0.0.1; the default), an
``s3://`` URI of the user's (credentials from the caller's ``AWS_*`` env,
handed to the sidecar as the namespace's S3 Secret, as a platform team
would), or ``pvc://claim/path`` (the claim is a directory of the pod
runner's node, shared by every pod of the job).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from jitckpt import destination as grammar
from local.podrunner import Node
from local.s3server import LocalS3
from sidecar.storage.base import Store
from sidecar.uri import parse_job_root

SECRET_NAME = "jitckpt-demo-s3"
EMBEDDED_BUCKET = "jitckpt-demo"
CREDENTIAL_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
ENDPOINT_KEYS = ("AWS_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


@dataclass
class Destination:
    """A destination URI plus what the pods and the demo need to reach it."""

    uri: str
    secret: dict[str, str] = field(default_factory=dict)  # empty for pvc://
    server: LocalS3 | None = None

    @classmethod
    def embedded(cls) -> Destination:
        server = LocalS3().start()
        server.create_bucket(EMBEDDED_BUCKET)
        # The store client reads keys from the process env; moto accepts any keys,
        # so keys the caller already has are left alone.
        for key in CREDENTIAL_KEYS:
            os.environ.setdefault(key, server.credentials_env()[key])
        return cls(f"s3://{EMBEDDED_BUCKET}/runs", server.credentials_env(), server)

    @classmethod
    def from_uri(cls, uri: str) -> Destination:
        """``uri`` checked by the destination grammar (``DestinationError`` is a ValueError)."""
        if grammar.parse(uri).scheme == grammar.PVC:
            return cls(uri)
        secret = {k: os.environ[k] for k in CREDENTIAL_KEYS + ENDPOINT_KEYS if k in os.environ}
        return cls(uri, secret)

    @property
    def is_pvc(self) -> bool:
        return grammar.parse(self.uri).scheme == grammar.PVC

    @property
    def description(self) -> str:
        if self.server is not None:
            return f"{self.uri} (embedded S3 server at {self.server.endpoint})"
        if self.is_pvc:
            return f"{self.uri} (the claim is a directory shared by the job's pods)"
        return self.uri

    def namespace_annotations(self) -> dict[str, str]:
        annotations = {"jitckpt.io/destination": self.uri}
        if self.secret:
            annotations["jitckpt.io/s3-secret"] = SECRET_NAME
        return annotations

    def secrets(self) -> dict[str, dict[str, str]]:
        return {SECRET_NAME: dict(self.secret)} if self.secret else {}

    def open_store(self, job_root: str, node: Node) -> Store:
        """The job's store as the sidecar sees it, opened from this machine."""
        if self.is_pvc:
            from sidecar.storage.pvc import DirectoryStore

            claim = grammar.parse(self.uri).name
            root = parse_job_root(job_root, node.claim_path(claim))
            assert root.path is not None
            return DirectoryStore(root.path, root.uri)
        from sidecar.storage.s3 import S3Store

        root = parse_job_root(job_root, Path("/"))
        return S3Store(
            root.bucket,
            root.prefix,
            root.uri,
            part_size=8 << 20,
            concurrency=4,
            read_timeout=30.0,
            max_attempts=3,
            env=self.secret or dict(os.environ),
        )

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
