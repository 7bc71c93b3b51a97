"""The simulated DDP checkpoint that ``bench.scale --ddp`` measures, and how it counts bytes.

The figure "bytes one node downloads, flat from 8 to 1,024 nodes" holds only if
the simulated files are the ones the shim writes (shares placed by its own
``replicated.owners``, rank files marked node-local) and if the bytes are what
the proxy saw a real commit send and a real restore download.
"""

from __future__ import annotations

from pathlib import Path

from bench.scale import DDP_STATE, RESTORING_NODE, ddp_bytes
from bench.simjob import MARKER_BYTES, RANK_FILE_BYTES, DdpJob, StateTensor
from local.s3server import LocalS3
from shim.frameworks.plain.layout import replicated
from tests.support.faultproxy import FaultProxy


def test_the_replicated_state_is_written_once_in_64_mib_shares_spread_over_nodes() -> None:
    job = DdpJob(64, 8, DDP_STATE)
    state = sum(t.numel() * t.element_size() for t in DDP_STATE)
    assert job.state_bytes == state
    assert 1.1e9 < state < 1.3e9  # the 100M parameters with AdamW
    assert len(job.shares) == -(-state // replicated.SHARE_BYTES)
    writer_nodes = {rank // job.nproc for rank in job.shares}
    assert len(writer_nodes) == len(job.shares)  # one writer a node at most here
    written = [
        name for node in range(job.nnodes) for name in job.files(node) if "replicated" in name
    ]
    assert sorted(written) == sorted(replicated.PART_FILE % rank for rank in job.shares)


def test_a_node_downloads_one_copy_and_its_own_ranks_whatever_the_job() -> None:
    downloads = {n: DdpJob(n, 8, DDP_STATE).needs_bytes(RESTORING_NODE) for n in (8, 1024)}
    one_copy = DdpJob(8, 8, DDP_STATE).state_bytes
    assert downloads[8] == downloads[1024] == one_copy + 8 * RANK_FILE_BYTES + 2 * MARKER_BYTES
    job = DdpJob(8, 8, DDP_STATE)
    rank_files = [name for name in job.files(3) if "rank-" in name]
    assert len(rank_files) == 8 and all(job.files(3)[name] for name in rank_files)


def test_the_bytes_are_those_a_real_commit_sent_and_a_real_restore_got(tmp_path: Path) -> None:
    """Two nodes x 2 processes, a small state in one share (on node 0): node 1's restore
    downloads that share, its own rank files and node 0's marker, and no other rank's."""
    state = (StateTensor(300_000), StateTensor(200_000))  # 2 MB
    job = DdpJob(2, 2, state)
    assert list(job.shares) == [0]
    with LocalS3() as s3, FaultProxy(s3.endpoint) as proxy:
        sent, received, _ = ddp_bytes(job, s3, tmp_path, proxy)
    everything = sum(job.size(name) for node in range(2) for name in job.files(node))
    assert sent >= everything  # and the manifests, the commit record
    needed = job.needs_bytes(RESTORING_NODE)
    assert needed <= received < needed + 2 * RANK_FILE_BYTES  # never node 0's rank files
