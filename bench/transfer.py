"""Transfer: throughput and CPU s/GB of the sidecar's storage layer, against s5cmd and boto3.

Two payloads: one large file of random bytes, and a real HF checkpoint
directory (bench/checkpoint_files.py). A fourth subject runs the sidecar's
storage layer with s5cmd-sized parts and more in flight (JITCKPT_PART_SIZE,
JITCKPT_UPLOAD_CONCURRENCY), to show what its defaults cost. Each client
uploads to its own prefix of the same LocalS3 bucket, then downloads what it
uploaded into an empty directory. The order of the clients rotates every
repetition, and there are as many repetitions as clients, so each client
takes each place once (why: run()). The part size and concurrency each
client used are recorded with its samples.

CPU: for the Python clients the process CPU time of the transfer itself
(bench/transfer_worker.py); for s5cmd the whole process (a Go binary starts in
milliseconds), from wait4's rusage.

    python -m bench.transfer [--quick] [--reps N]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import harness
from bench.checkpoint_files import directory_bytes, make_checkpoint
from bench.harness import BenchOptions
from bench.procs import s5cmd_binary
from bench.results import Case, Series
from local.background import REPO_ROOT

NAME = "transfer"
BUCKET = "bench-transfer"
JITCKPT_TUNED = "jitckpt 64MiB x 8"
CLIENTS = ("jitckpt", "s5cmd", "boto3", JITCKPT_TUNED)
# The sidecar's knobs (sidecar/config.py) for the tuned run: s5cmd-sized parts, more in flight.
TUNED_ENV = {"JITCKPT_PART_SIZE": str(64 * 1024 * 1024), "JITCKPT_UPLOAD_CONCURRENCY": "8"}
DIRECTIONS = ("upload", "download")
MB = 1_000_000
# s5cmd's defaults (s5cmd cp --help): --part-size 50 MiB, --concurrency 5 per file.
S5CMD_PARAMS = {"part_size": 50 * 1024 * 1024, "concurrency": 5, "numworkers": 256}


@dataclass(frozen=True)
class Payload:
    name: str
    path: Path
    size: int


@dataclass(frozen=True)
class Measured:
    seconds: float
    cpu_seconds: float
    params: dict[str, Any]


def _random_file(path: Path, size: int) -> None:
    chunk = 16 * 1024 * 1024
    with path.open("wb") as handle:
        remaining = size
        while remaining:
            handle.write(os.urandom(min(chunk, remaining)))
            remaining -= min(chunk, remaining)


def s5cmd_env(s3_env: dict[str, str]) -> dict[str, str]:
    return dict(os.environ, **s3_env)


def run_s5cmd(args: list[str], env: dict[str, str]) -> Measured:
    """Whole-process wall and CPU time of one s5cmd command that must exit 0."""
    argv = [s5cmd_binary(), "--endpoint-url", env["AWS_S3_ENDPOINT"], *args]
    started = time.perf_counter()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    stderr = process.stderr.read().decode() if process.stderr else ""
    if process.returncode != 0:
        raise RuntimeError(f"s5cmd {' '.join(args)} exited {process.returncode}: {stderr}")
    return Measured(elapsed, usage.ru_utime + usage.ru_stime, dict(S5CMD_PARAMS))


def run_worker(client: str, args: list[str], env: dict[str, str]) -> Measured:
    completed = subprocess.run(
        [sys.executable, "-m", "bench.transfer_worker", "--client", client, *args],
        env=env,
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    report = json.loads(completed.stdout)
    return Measured(report["seconds"], report["cpu_seconds"], report["params"])


def transfer(
    client: str, direction: str, payload: Payload, target: Path, env: dict[str, str]
) -> Measured:
    prefix = f"{client.split(maxsplit=1)[0]}-{CLIENTS.index(client)}/{payload.name}"
    if client == "s5cmd":
        remote = f"s3://{BUCKET}/{prefix}/"
        if direction == "upload":
            source = str(payload.path) if payload.path.is_file() else f"{payload.path}/*"
            return run_s5cmd(["cp", source, remote], env)
        return run_s5cmd(["cp", remote + "*", f"{target}/"], env)
    args = ["--direction", direction, "--local", str(payload.path), "--target", str(target)]
    args += ["--bucket", BUCKET, "--prefix", prefix]
    if client == JITCKPT_TUNED:
        return run_worker("jitckpt", args, dict(env, **TUNED_ENV))
    return run_worker(client, args, env)


def run(options: BenchOptions) -> list[Case]:
    from local.s3server import LocalS3

    # One repetition per client, so that every client takes every place in the order once:
    # on this machine a download's cost depends on its place. The same client's took 1.2
    # CPU s/GB run first and 2.0 to 2.7 run third (s5cmd's single file: 0.85 and 1.65), all
    # of the difference in the kernel's copy into fresh page-cache pages. What fits: this
    # guest reports freed memory to its hypervisor (free page reporting), so the first touch
    # of such a page faults in the host, and whoever allocates first after others freed
    # pays. Fewer repetitions would favour whoever runs first.
    # (make bench within 45 minutes: 5 repetitions of a 1 GB file were 16 of them.)
    reps = options.repetitions(len(CLIENTS), len(CLIENTS))
    file_size = 200 * MB if options.quick else 500 * MB
    checkpoint_state = 60 * MB if options.quick else 500 * MB
    samples: dict[tuple[str, str, str], list[Measured]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-transfer-") as tmp, LocalS3() as s3:
        work = Path(tmp)
        s3.create_bucket(BUCKET)
        env = s5cmd_env(s3.credentials_env())
        big = work / "large.bin"
        _random_file(big, file_size)
        checkpoint = make_checkpoint(work, checkpoint_state)
        payloads = (
            Payload("single-file", big, file_size),
            Payload("checkpoint-dir", checkpoint, directory_bytes(checkpoint)),
        )
        for rep in range(reps):
            order = CLIENTS[rep % len(CLIENTS) :] + CLIENTS[: rep % len(CLIENTS)]
            for payload in payloads:
                for direction in DIRECTIONS:
                    for client in order:
                        target = work / "download" / str(CLIENTS.index(client))
                        shutil.rmtree(target, ignore_errors=True)
                        target.mkdir(parents=True)
                        measured = transfer(client, direction, payload, target, env)
                        samples.setdefault((payload.name, direction, client), []).append(measured)
                        print(
                            f"[bench] transfer rep {rep} {payload.name} {direction} {client}: "
                            f"{measured.seconds:.2f} s",
                            file=sys.stderr,
                            flush=True,
                        )
                shutil.rmtree(work / "download", ignore_errors=True)
    return cases_from(samples, payloads)


def _value(metric: str, payload: Payload, measured: Measured) -> float:
    if metric == "throughput":
        return payload.size / MB / measured.seconds
    return measured.cpu_seconds / (payload.size / 1e9)


def cases_from(
    samples: dict[tuple[str, str, str], list[Measured]], payloads: tuple[Payload, ...]
) -> list[Case]:
    """Throughput and CPU per GB cases, one per payload and direction."""
    cases = []
    for payload in payloads:
        for direction in DIRECTIONS:
            for metric, unit, lower in (
                ("throughput", "MB/s", False),
                ("CPU per GB", "CPU s/GB", True),
            ):
                series = []
                for client in CLIENTS:
                    measured = samples[(payload.name, direction, client)]
                    values = [_value(metric, payload, m) for m in measured]
                    series.append(Series(client, values, measured[0].params))
                cases.append(
                    Case(
                        benchmark=NAME,
                        case=f"{payload.name} {payload.size / MB:.0f} MB {direction}",
                        metric=metric,
                        unit=unit,
                        lower_is_better=lower,
                        series=series,
                        note="transfer: Python clients timed inside their process (the "
                        "transfer only, after the client's first request, as the agent's access "
                        "probe makes it); s5cmd as a whole process; LocalS3 (moto) on the same "
                        "2 cores",
                    )
                )
    return cases


if __name__ == "__main__":
    raise SystemExit(harness.main(NAME, "bench.transfer", run, __doc__))
