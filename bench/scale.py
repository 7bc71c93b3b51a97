"""Store requests at scale: one node's restore and commit in a job of N nodes x 8 processes.

For N = 8, 64, 256 and 1,024 simulated nodes (`bench/simjob.py`: the files a
plain FSDP2 loop stages, 48 bytes each, so only requests count) against the
embedded S3 (moto on 127.0.0.1) through a counting proxy
(`tests/support/faultproxy.py`):

- the whole job commits one checkpoint through the sidecar's `commit_node`
  (every node but the last, then the last one alone, which completes the
  checkpoint): requests per node and the last node's;
- one node (node 1: it needs node 0's shared files too) restores it with the
  real `jitckpt agent --phase restore` (access probe included), on the
  writer's layout: its requests, and the agent's own restore time;
- a JIT commit with a store that throttles: 32 nodes commit at once through a
  proxy that answers SlowDown above the share of one prefix's rate that 32
  nodes of a 1,024-node job get (3,500 writes and 5,500 reads a second,
  times 32/1,024), each node with its own store client: seconds until every
  node committed and the checkpoint is valid;
- with ``--ddp``, bytes, for a plain DDP loop's checkpoint as the shim writes it (``DdpJob``: a
  100M-parameter GPT-2 shape with AdamW, 1.2 GB of replicated state in shares
  of at least 64 MiB placed by the shim's ``replicated.owners``, and a 20 KB
  file per rank): the bytes the whole job's commit sends the store, and the
  bytes node 1's real restore downloads, both counted by the proxy.

The job-wide figures are one node's times N, in seconds of one S3 prefix's
published rates: a job's checkpoints share one prefix, and S3 answers
SlowDown (503) above those rates.

    python -m bench.scale [--quick] [--ddp]

``--ddp`` measures the DDP bytes alone, recorded as their own section
(``scale_ddp``); without it, the requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from bench import harness, simjob
from bench.harness import BenchOptions
from bench.jitckpt_node import JitckptNode
from bench.procs import tool
from bench.results import Case, Series
from bench.simjob import DdpJob, SimJob, gpt_state

if TYPE_CHECKING:
    from local.s3server import LocalS3
    from tests.support.faultproxy import FaultProxy

NAME = "scale"
DDP_NAME = "scale_ddp"
SIZES = (8, 64, 256, 1024)
QUICK_SIZES = (8, 64)
NPROC = 8
STEP = 10
RESTORING_NODE = 1
# S3's published request rates per prefix (a job's checkpoints share one prefix).
READS_PER_SECOND = 5500  # GET, HEAD (and LIST)
WRITES_PER_SECOND = 3500  # PUT, COPY, POST, DELETE
READS = ("LIST", "GET", "HEAD")
WRITES = ("PUT", "POST", "DELETE")
# The throttled JIT commit: this many nodes, each with the per-node share of one prefix's
# rate that a job of AT_SCALE nodes gets.
LIVE_NODES = 32
AT_SCALE = 1024
RESTORED = re.compile(r"restored checkpoint-(\d+) \(\d+ bytes\) in ([0-9.]+)s")
# The DDP loop's replicated state: GPT-2 small's shape with a 16k vocabulary, 98M
# parameters, 1.18 GB with AdamW's moments (the "100M parameters, 1.2 GB").
DDP_STATE = tuple(gpt_state(hidden=768, layers=12, vocab=16384, positions=1024))
GB = 1e9


def prefix_seconds(counts: Counter[str]) -> float:
    """How long one prefix takes to serve ``counts`` at S3's published rates."""
    reads = sum(counts[kind] for kind in READS)
    writes = sum(counts[kind] for kind in WRITES)
    return reads / READS_PER_SECOND + writes / WRITES_PER_SECOND


def breakdown(counts: Counter[str]) -> str:
    return " / ".join(f"{counts[kind]} {kind}" for kind in (*READS, *WRITES) if counts[kind])


async def commit_job(
    job: SimJob | DdpJob, destination: str, env: dict[str, str], scratch: Path, proxy: FaultProxy
) -> tuple[Counter[str], Counter[str]]:
    """Every node commits ``checkpoint-STEP``: the requests of all of them, and of the last."""
    first = len(proxy.requests)
    async with simjob.s3_store(destination, env) as store:
        await simjob.commit(store, job, STEP, range(job.nnodes - 1), scratch)
    last = len(proxy.requests)
    async with simjob.s3_store(destination, env) as store:
        await simjob.commit(store, job, STEP, [job.nnodes - 1], scratch)
    kinds = [r.kind for r in proxy.requests]
    return Counter(kinds[first:]), Counter(kinds[last:])


def restore_node(
    job: SimJob | DdpJob, destination: str, env: dict[str, str], work: Path, proxy: FaultProxy
) -> tuple[Counter[str], float]:
    """Node ``RESTORING_NODE``'s ``jitckpt agent --phase restore``: its requests and the
    restore's time as the agent logs it (checked: ``checkpoint-STEP``, every file it needs)."""
    from local.ports import free_port

    node = JitckptNode(
        work,
        destination,
        env,
        nnodes=job.nnodes,
        node_rank=RESTORING_NODE,
        nproc_per_node=job.nproc,
    )
    first = len(proxy.requests)
    argv = [tool("jitckpt"), "agent", "--phase", "restore"]
    argv += ["--termination-log", str(work / "termination-log")]
    argv += ["--shim-target", str(node.shim_dir)]
    env = node.agent_env(free_port())
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600, check=False)
    log = done.stdout + done.stderr
    found = RESTORED.search(log)
    if done.returncode != 0 or found is None or int(found[1]) != STEP:
        raise RuntimeError(f"the restore of node {RESTORING_NODE} failed:\n{log[-3000:]}")
    restored = node.local_dir / "checkpoints" / f"checkpoint-{STEP}"
    files = sum(1 for path in restored.rglob("*") if path.is_file())
    if files != job.needs(RESTORING_NODE):
        raise RuntimeError(f"restored {files} files, not {job.needs(RESTORING_NODE)}")
    return Counter(r.kind for r in proxy.requests[first:]), float(found[2])


async def throttled_commit(
    destination: str, env: dict[str, str], scratch: Path
) -> tuple[float, bool]:
    """``LIVE_NODES`` nodes commit a JIT checkpoint at once, each with its own store client:
    the seconds until all are committed, and whether the checkpoint is valid then."""
    from sidecar.validity import scan

    job = SimJob(LIVE_NODES, NPROC)
    async with contextlib.AsyncExitStack() as stack:
        stores = [
            await stack.enter_async_context(simjob.s3_store(destination, env))
            for _ in range(job.nnodes)
        ]
        started = time.monotonic()
        await asyncio.gather(
            *(simjob.commit(stores[n], job, STEP, [n], scratch) for n in range(job.nnodes))
        )
        seconds = time.monotonic() - started
        valid = [state.valid async for state in scan(stores[0]) if state.step == STEP]
    return seconds, valid == [True]


def ddp_bytes(
    job: DdpJob, s3: LocalS3, work: Path, proxy: FaultProxy
) -> tuple[int, int, Counter[str]]:
    """``job`` commits its checkpoint and node ``RESTORING_NODE`` restores it: the request
    bodies the commit sent the store, the response bodies the restore got back (both
    counted by ``proxy``; checked: the bytes restored are those the node needs), the
    restore's requests."""
    bucket = f"scale-ddp-{job.nnodes}"
    s3.create_bucket(bucket)
    destination = f"s3://{bucket}/bench/job"
    env = dict(s3.credentials_env(), AWS_S3_ENDPOINT=proxy.endpoint)
    first = len(proxy.requests)
    asyncio.run(commit_job(job, destination, env, work / "files", proxy))
    sent = sum(r.sent for r in proxy.requests[first:])
    shutil.rmtree(work / "files")
    first = len(proxy.requests)
    restored, _ = restore_node(job, destination, env, work / "node", proxy)
    received = sum(r.received for r in proxy.requests[first:])
    local = work / "node" / "local" / "checkpoints" / f"checkpoint-{STEP}"
    on_disk = sum(path.stat().st_size for path in local.rglob("*") if path.is_file())
    if on_disk != job.needs_bytes(RESTORING_NODE):
        raise RuntimeError(f"restored {on_disk} bytes, not {job.needs_bytes(RESTORING_NODE)}")
    shutil.rmtree(work / "node")
    return sent, received, restored


def case(
    metric: str,
    unit: str,
    samples: dict[int, list[float]],
    note: str,
    *,
    files: str = "48-byte files",
    benchmark: str = NAME,
) -> Case:
    """One metric, one subject per job size; the smallest job is the reference, so the
    ratios say how the figure grows with the job."""
    series = [Series(f"{n} nodes x {NPROC}", v, {"nnodes": n}) for n, v in samples.items()]
    return Case(
        benchmark=benchmark,
        case=f"jobs of N nodes x {NPROC} processes, {files}",
        metric=metric,
        unit=unit,
        lower_is_better=True,
        series=series,
        reference=series[0].subject,
        note=note,
    )


def run(options: BenchOptions) -> list[Case]:
    from local.s3server import LocalS3
    from tests.support.faultproxy import FaultProxy

    sizes = QUICK_SIZES if options.quick else SIZES
    # A throttled store makes every retry a warning: thousands of lines, counted instead.
    logging.getLogger("sidecar.storage.retry").setLevel(logging.ERROR)
    restore_requests: dict[int, list[float]] = {}
    restore_extra: dict[int, list[float]] = {}
    restore_seconds: dict[int, list[float]] = {}
    job_restore_seconds: dict[int, list[float]] = {}
    commit_per_node: dict[int, list[float]] = {}
    commit_last: dict[int, list[float]] = {}
    job_commit_seconds: dict[int, list[float]] = {}
    with LocalS3() as s3, tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        for n in sizes:
            bucket = f"scale-{n}"
            s3.create_bucket(bucket)
            destination = f"s3://{bucket}/bench/job"
            job = SimJob(n, NPROC)
            work = Path(tmp) / f"n{n}"
            with FaultProxy(s3.endpoint) as proxy:
                env = dict(s3.credentials_env(), AWS_S3_ENDPOINT=proxy.endpoint)
                committed, last = asyncio.run(
                    commit_job(job, destination, env, work / "files", proxy)
                )
                restored, seconds = restore_node(job, destination, env, work / "node", proxy)
            files = job.needs(RESTORING_NODE)
            print(
                f"[scale] {n} nodes x {NPROC}: restore of node {RESTORING_NODE} "
                f"{sum(restored.values())} requests ({breakdown(restored)}; {files} files) "
                f"in {seconds:.2f}s; job commit {sum(committed.values())} requests "
                f"({breakdown(committed)}), the last node's {sum(last.values())} "
                f"({breakdown(last)})",
                flush=True,
            )
            restore_requests[n] = [sum(restored.values())]
            restore_extra[n] = [sum(restored.values()) - files]
            restore_seconds[n] = [seconds]
            job_restore_seconds[n] = [prefix_seconds(restored) * n]
            commit_per_node[n] = [sum(committed.values()) / n]
            commit_last[n] = [sum(last.values())]
            job_commit_seconds[n] = [prefix_seconds(committed)]
            s3.reset()
        bucket = "scale-throttled"
        s3.create_bucket(bucket)
        share = LIVE_NODES / AT_SCALE
        with FaultProxy(s3.endpoint) as proxy:
            proxy.throttle(WRITES_PER_SECOND * share, WRITES)
            proxy.throttle(READS_PER_SECOND * share, ("GET", "HEAD"))
            env = dict(s3.credentials_env(), AWS_S3_ENDPOINT=proxy.endpoint)
            throttled, valid = asyncio.run(
                throttled_commit(f"s3://{bucket}/bench/job", env, Path(tmp) / "throttled")
            )
            slowdowns = proxy.injected("SlowDown")
        if not valid:
            raise RuntimeError("the throttled JIT commit did not leave a valid checkpoint")
        print(f"[scale] throttled JIT commit: {throttled:.1f}s, {slowdowns} SlowDown", flush=True)
    where = f"one node's restore: node {RESTORING_NODE} by `jitckpt agent --phase restore`"
    rates = f"{READS_PER_SECOND} reads and {WRITES_PER_SECOND} writes a second per prefix"
    return [
        case("requests of one node's restore", "requests", restore_requests, where),
        case(
            "requests of one node's restore beyond the files it downloads",
            "requests",
            restore_extra,
            where,
        ),
        case("one node's restore time (the agent's own)", "s", restore_seconds, where),
        case(
            "the whole job's restores (N x one node's) in one prefix's rate",
            "s",
            job_restore_seconds,
            f"scale: job-wide seconds = requests at S3's published {rates}",
        ),
        case("requests per node of the whole job's commit", "requests", commit_per_node, ""),
        case("requests of the last node's commit", "requests", commit_last, ""),
        case(
            "the whole job's commit in one prefix's rate",
            "s",
            job_commit_seconds,
            f"scale: job-wide seconds = requests at S3's published {rates}",
        ),
        Case(
            benchmark=NAME,
            case=f"JIT commit of {LIVE_NODES} nodes x {NPROC} at once, the store throttling "
            f"at {LIVE_NODES}/{AT_SCALE} of one prefix's rate",
            metric="seconds to every node committed",
            unit="s",
            lower_is_better=True,
            series=[Series("jitckpt", [throttled], {"slowdowns": slowdowns})],
            note=f"scale, throttled: each node the share of a prefix's rate that a "
            f"{AT_SCALE}-node job's nodes get; {slowdowns} requests answered SlowDown",
        ),
    ]


def run_ddp(options: BenchOptions) -> list[Case]:
    """The DDP checkpoint's bytes: in the store, and downloaded by one node, at each size."""
    from local.s3server import LocalS3
    from tests.support.faultproxy import FaultProxy

    sizes = QUICK_SIZES if options.quick else SIZES
    store_bytes: dict[int, list[float]] = {}
    node_bytes: dict[int, list[float]] = {}
    with LocalS3() as s3, tempfile.TemporaryDirectory(prefix="bench-scale-ddp-") as tmp:
        for n in sizes:
            ddp = DdpJob(n, NPROC, DDP_STATE)
            with FaultProxy(s3.endpoint) as proxy:
                sent, received, restored = ddp_bytes(ddp, s3, Path(tmp) / f"ddp-{n}", proxy)
            print(
                f"[scale] DDP {n} nodes x {NPROC}: {len(ddp.shares)} shares of "
                f"{ddp.state_bytes / GB:.3f} GB; the commit sent {sent / GB:.3f} GB, node "
                f"{RESTORING_NODE}'s restore got {received / GB:.3f} GB in "
                f"{sum(restored.values())} requests ({breakdown(restored)})",
                flush=True,
            )
            store_bytes[n] = [sent / GB]
            node_bytes[n] = [received / GB]
            s3.reset()
    state = DdpJob(1, NPROC, DDP_STATE).state_bytes / GB
    files = f"a plain DDP loop's checkpoint ({state:.2f} GB replicated state, 20 KB rank files)"
    note = (
        "scale_ddp: the checkpoint as the shim writes it (shares of the replicated state "
        "placed by replicated.owners, rank files node-local); bytes = request bodies the "
        f"whole job's commit sent and response bodies node {RESTORING_NODE}'s restore got, "
        "counted by the proxy"
    )
    return [
        case(
            "bytes the checkpoint puts in the store",
            "GB",
            store_bytes,
            note,
            files=files,
            benchmark=DDP_NAME,
        ),
        case(
            "bytes one node downloads on resume",
            "GB",
            node_bytes,
            note,
            files=files,
            benchmark=DDP_NAME,
        ),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    return harness.main(NAME, "bench.scale", run, __doc__, argv, ddp=(DDP_NAME, run_ddp))


if __name__ == "__main__":
    raise SystemExit(main())
