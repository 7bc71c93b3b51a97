"""The admission load generator, run as its own process.

N clients on N HTTP/1.1 keep-alive connections (httpx, asyncio) each post the
same AdmissionReview back to back; every request's latency goes to stdout as
JSON. Each answer is checked (status 200, uid echoed), so a server that fails
fast cannot look fast.

    python -m bench.loadgen --url https://127.0.0.1:8443/mutate --ca ca.crt \
        --payload review.json --concurrency 8 --requests 800
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LoadPlan:
    """What to send, where, how many at once and how many in all."""

    url: str
    ca: Path
    body: bytes
    concurrency: int
    requests: int
    warmup: int


async def _client(client: Any, plan: LoadPlan, count: int, latencies: list[float]) -> None:
    uid = json.loads(plan.body)["request"]["uid"]
    headers = {"content-type": "application/json"}
    for _ in range(count):
        started = time.perf_counter()
        response = await client.post(plan.url, content=plan.body, headers=headers)
        elapsed = time.perf_counter() - started
        if response.status_code != 200:
            raise RuntimeError(f"status {response.status_code}: {response.text[:200]}")
        if response.json()["response"]["uid"] != uid:
            raise RuntimeError("answer does not echo the review's uid")
        latencies.append(elapsed)


async def generate(plan: LoadPlan) -> list[float]:
    """Latencies (seconds) of the timed requests, after `warmup` untimed ones per client.

    Each client has its own httpx client holding its one connection, as each of
    the API server's connections is its own. Sharing one pool of N connections
    among the N clients is not the same: httpcore then queues a request for a
    free connection even though every client has at most one request out, and
    under load a request waited 200 to 750 ms in that queue, about four times
    in a thousand, before it was sent. That wait is the load generator's, not
    the server's: it made the p99 at 8 clients.
    """
    import httpx

    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    clients = [
        httpx.AsyncClient(verify=str(plan.ca), http1=True, limits=limits)
        for _ in range(plan.concurrency)
    ]
    try:
        discard: list[float] = []
        await asyncio.gather(*(_client(client, plan, plan.warmup, discard) for client in clients))
        latencies: list[float] = []
        per_client = max(1, plan.requests // plan.concurrency)
        await asyncio.gather(*(_client(client, plan, per_client, latencies) for client in clients))
    finally:
        for client in clients:
            await client.aclose()
    return latencies


def main() -> int:
    arguments = argparse.ArgumentParser(description=__doc__)
    arguments.add_argument("--url", required=True)
    arguments.add_argument("--ca", type=Path, required=True)
    arguments.add_argument("--payload", type=Path, required=True)
    arguments.add_argument("--concurrency", type=int, required=True)
    arguments.add_argument("--requests", type=int, required=True)
    arguments.add_argument("--warmup", type=int, default=5, help="requests per client, not timed")
    args = arguments.parse_args()
    latencies = asyncio.run(
        generate(
            LoadPlan(
                url=args.url,
                ca=args.ca,
                body=args.payload.read_bytes(),
                concurrency=args.concurrency,
                requests=args.requests,
                warmup=args.warmup,
            )
        )
    )
    print(json.dumps({"latencies": latencies}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
