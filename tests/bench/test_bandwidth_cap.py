"""The fault proxy's bandwidth cap, which the bandwidth-capped SIGTERM-to-durable case rests on.

A node's time to durable under a cap means something only if the proxy in front
of the store really holds every upload (and download) to the cap, all of a
node's connections together, and counts the bytes it carried. Only lower bounds
on time are asserted: a loaded machine makes a transfer slower, never faster.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from local.s3server import LocalS3
from tests.support.faultproxy import BURST_SECONDS, Bandwidth, FaultProxy

CAP = 2_000_000  # bytes a second
SIZE = 2_000_000  # bytes per object
BURST = CAP * BURST_SECONDS  # what the link lets through at once, after an idle time


@pytest.fixture(scope="module")
def local_s3() -> Iterator[LocalS3]:
    with LocalS3() as server:
        server.create_bucket("capped")
        yield server


def test_the_bucket_lets_through_its_burst_then_the_rate() -> None:
    limit = Bandwidth(rate=1000.0, burst=100.0)
    assert limit.pay(100, now=0.0) == 0.0  # the burst goes at once
    assert limit.pay(100, now=0.0) == pytest.approx(0.1)  # then 100 bytes per 0.1 s
    assert limit.pay(1000, now=0.0) == pytest.approx(1.1)
    # an idle second refills the burst only, never more
    assert limit.pay(100, now=10.0) == 0.0
    assert limit.pay(100, now=10.0) == pytest.approx(0.1)


def _client(s3: LocalS3, endpoint: str) -> object:
    import boto3

    env = s3.credentials_env()
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )


def test_a_capped_link_takes_at_least_size_over_cap_each_way(local_s3: LocalS3) -> None:
    body = bytes(range(256)) * (SIZE // 256)
    with FaultProxy(local_s3.endpoint) as proxy:
        proxy.limit_bandwidth(CAP)
        client = _client(local_s3, proxy.endpoint)
        started = time.monotonic()
        client.put_object(Bucket="capped", Key="up", Body=body)  # type: ignore[attr-defined]
        uploaded = time.monotonic() - started
        started = time.monotonic()
        got = client.get_object(Bucket="capped", Key="up")["Body"].read()  # type: ignore[attr-defined]
        downloaded = time.monotonic() - started
        put = [r for r in proxy.requests if r.kind == "PUT"]
        get = [r for r in proxy.requests if r.kind == "GET"]
    assert got == body
    floor = (len(body) - BURST) / CAP
    assert uploaded >= floor and downloaded >= floor, (uploaded, downloaded)
    assert put[-1].sent >= len(body) and get[-1].received == len(body)


def test_the_cap_is_shared_by_every_connection_of_one_proxy(local_s3: LocalS3) -> None:
    """Two uploads at once through one proxy: together at the cap, not each at it."""
    body = b"x" * (SIZE // 2)
    with FaultProxy(local_s3.endpoint) as proxy:
        proxy.limit_bandwidth(CAP)

        def put(key: str) -> None:
            _client(local_s3, proxy.endpoint).put_object(  # type: ignore[attr-defined]
                Bucket="capped", Key=key, Body=body
            )

        threads = [threading.Thread(target=put, args=(f"both-{n}",)) for n in range(2)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        both = time.monotonic() - started
    assert both >= (2 * len(body) - BURST) / CAP, both
