"""A real S3 server on 127.0.0.1: moto in server mode, in its own process.

`jitckpt demo` uses it as the default destination and the tests and benchmarks
use it as their store, so every S3 call in them crosses a real HTTP socket.
"""

from __future__ import annotations

import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from local.background import Background
from local.ports import free_port

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"


@dataclass
class LocalS3:
    """moto's S3 server as a child process; use as a context manager."""

    host: str = "127.0.0.1"
    port: int = 0
    startup_timeout: float = 30.0
    _process: Background | None = field(default=None, init=False, repr=False)

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def credentials_env(self) -> dict[str, str]:
        """The env a client needs, in the keys of an OpenShift AI data connection."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_S3_ENDPOINT": self.endpoint,
        }

    def start(self) -> LocalS3:
        if not self.port:
            self.port = free_port(self.host)
        env = dict(os.environ, **self.credentials_env())
        argv = [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)]
        process = self._process = Background(argv, env=env, name="moto server").start()
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if process.exited() is not None:
                raise RuntimeError(f"moto server exited with {process.exited()}")
            try:
                with urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1):
                    return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto server did not answer on {self.endpoint}")

    def client(self) -> Any:
        """A plain botocore S3 client of this server: its requests are signed, as any S3
        client's (for callers that read or write the store around the sidecar)."""
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def create_bucket(self, bucket: str) -> None:
        """Create a bucket through a signed request, as any S3 client would."""
        self.client().create_bucket(Bucket=bucket)

    def reset(self) -> None:
        """Drop every bucket and object (moto's reset API), between tests.

        Dropping is not instant: moto keeps large objects in temporary files, and a
        benchmark job that uploaded tens of 500 MB checkpoints leaves gigabytes to
        delete (over 10 s on a 2-core machine)."""
        request = urllib.request.Request(self.endpoint + "/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=300):
            pass

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop(timeout=10)
        self._process = None

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
