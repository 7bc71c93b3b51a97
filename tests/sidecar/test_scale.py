"""Store requests that grow with what a node needs, not with the job (issue 38).

Jobs of 4 and of 48 nodes (two groups in the record's fan-in) x 2 processes, as a plain
FSDP2 loop stages them (each rank's shard and state marked node-local, node 0's
``.metadata`` shared), are committed node by node through the real ``commit_node`` and
restored through the real ``restore``, against moto behind a counting proxy: every
request either makes is counted by kind. The benchmark at 8 to 1,024 nodes is
``python -m bench.scale``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest

from sidecar import summary
from sidecar.config import AgentConfig
from sidecar.nodefiles import NodeLayout
from sidecar.restore import restore
from sidecar.storage.factory import open_store
from sidecar.validity import judge
from tests.sidecar.helpers import commit_sharded, sharded_files
from tests.support.faultproxy import FaultProxy

NPROC = 2
STEP = 10
RESTORING = 1  # needs node 0's shared file too


def since(proxy: FaultProxy, first: int) -> Counter[str]:
    return Counter(r.kind for r in proxy.requests[first:])


def job(
    nnodes: int, proxy: FaultProxy, bucket: str, tmp_path: Path
) -> tuple[list[Counter[str]], Counter[str], int | None]:
    """Every node commits, one after the other; then node ``RESTORING`` restores: each
    node's commit requests, the restore's, and the step it restored."""
    config = AgentConfig(destination=f"s3://{bucket}/ns/job-{nnodes}")

    async def main() -> tuple[list[Counter[str]], Counter[str], int | None]:
        commits = []
        async with open_store(config) as store:
            for node in range(nnodes):
                first = len(proxy.requests)
                scratch = tmp_path / f"n{nnodes}"
                await commit_sharded(store, scratch, STEP, node=node, nnodes=nnodes, nproc=NPROC)
                commits.append(since(proxy, first))
            first = len(proxy.requests)
            layout = NodeLayout(RESTORING, nnodes, NPROC)
            target = tmp_path / f"restore-{nnodes}" / "checkpoints"
            result = await restore(store, target, layout, "pod-1")
        return commits, since(proxy, first), result.step

    return asyncio.run(main())


@pytest.fixture
def through_proxy(
    proxy: FaultProxy, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> FaultProxy:
    monkeypatch.setenv("AWS_S3_ENDPOINT", proxy.endpoint)
    return proxy


def test_a_nodes_requests_do_not_grow_with_the_job(
    through_proxy: FaultProxy, bucket: str, tmp_path: Path
) -> None:
    small_commits, small_restore, small_step = job(4, through_proxy, bucket, tmp_path)
    large_commits, large_restore, large_step = job(48, through_proxy, bucket, tmp_path)
    assert small_step == large_step == STEP
    assert len(summary.groups(48)) == 2  # the larger job's record is made of two groups
    # The restore: the steps, its checkpoint's .jitckpt/, the record, its own manifest and
    # node 0's (the shared file's), then its files (its own 4 and .metadata): the same
    # requests in a job 12 times the size.
    files = len(sharded_files(RESTORING, NPROC)[0]) + 1
    assert small_restore == large_restore == Counter({"LIST": 2, "GET": 3 + files})
    # A node's commit: its files and manifest, then one listing; the node that completes a
    # group reads that group's manifests (and writes its summary), the one that completes
    # the job the group summaries too, and writes the record. No node reads more than a
    # group's manifests and the group summaries, however many nodes there are.
    for commits, nnodes in ((small_commits, 4), (large_commits, 48)):
        puts = [len(sharded_files(node, NPROC)[0]) + 1 for node in range(nnodes)]
        assert all(c["PUT"] >= puts[n] and c["LIST"] >= 1 for n, c in enumerate(commits))
        readers = [n for n, c in enumerate(commits) if c["GET"]]
        groups = summary.groups(nnodes)
        assert readers == [group[-1] for group in groups], readers  # committed in order
        bound = summary.group_size(nnodes) + len(groups)
        assert max(c["GET"] for c in commits) <= bound
        others = [n for n in range(nnodes) if n not in readers]
        assert all(commits[n] == Counter({"PUT": puts[n], "LIST": 1}) for n in others)
    last = large_commits[-1]
    assert last["GET"] == len(summary.groups(48)[-1]) + len(summary.groups(48))
    assert (
        last["PUT"] == len(sharded_files(47, NPROC)[0]) + 1 + 2
    )  # the group summary and the record


def test_nodes_committing_at_once_into_a_throttled_store_all_commit(
    through_proxy: FaultProxy, bucket: str, tmp_path: Path
) -> None:
    """8 nodes, each with its own store client, commit at once through a store that answers
    SlowDown above 10 writes and 20 reads a second (S3 does above a prefix's rate): every
    request refused is retried with backoff, and the checkpoint ends committed."""
    nnodes = 8
    through_proxy.throttle(10, ("PUT", "POST", "DELETE"))
    through_proxy.throttle(20, ("GET", "HEAD"))
    config = AgentConfig(destination=f"s3://{bucket}/ns/throttled")

    async def node(rank: int) -> None:
        async with open_store(config) as store:
            await commit_sharded(store, tmp_path, STEP, node=rank, nnodes=nnodes, nproc=NPROC)

    async def main() -> bool:
        await asyncio.gather(*(node(rank) for rank in range(nnodes)))
        async with open_store(config) as store:
            return (await judge(store, STEP)).valid

    assert asyncio.run(main())
    assert through_proxy.injected("SlowDown") > 0
