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
    """Latencies (seconds) of the timed requests, after `warmup` untimed ones per client."""
    import httpx

    limits = httpx.Limits(
        max_connections=plan.concurrency, max_keepalive_connections=plan.concurrency
    )
    async with httpx.AsyncClient(verify=str(plan.ca), http1=True, limits=limits) as client:
        discard: list[float] = []
        clients = range(plan.concurrency)
        await asyncio.gather(*(_client(client, plan, plan.warmup, discard) for _ in clients))
        latencies: list[float] = []
        per_client = max(1, plan.requests // plan.concurrency)
        await asyncio.gather(*(_client(client, plan, per_client, latencies) for _ in clients))
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
