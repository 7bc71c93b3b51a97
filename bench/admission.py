"""Admission latency: `jitckpt webhook serve` against the bare FastAPI floor.

Both servers run over TLS with the same certificate (made by `jitckpt webhook
certs`) and receive the same AdmissionReview: the PyTorchJob master fixture
pod on CREATE. A load generator in its own process (bench/loadgen.py) holds
1, 8 and 32 keep-alive connections; each repetition gives one p50 and one p99.
The subjects alternate within each repetition so drift on the shared machine
hits both alike.

    python -m bench.admission [--quick] [--reps N]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import BenchOptions
from bench.procs import tool, wait_for_port
from bench.results import Case, Series
from bench.stats import quantile
from local.background import REPO_ROOT, Background

NAME = "admission"
FIXTURES = REPO_ROOT / "tests" / "webhook" / "testdata" / "fixtures"
POD_FIXTURE = FIXTURES / "pytorchjob-master.yaml"
NAMESPACE_FIXTURE = FIXTURES / "namespace-team-a.yaml"
HOST = "127.0.0.1"
JITCKPT = "jitckpt"
FLOOR = "fastapi echo (floor)"


@dataclass(frozen=True)
class Plan:
    concurrency: tuple[int, ...]
    requests: int
    reps: int


def plan(options: BenchOptions) -> Plan:
    if options.quick:
        return Plan(concurrency=(1, 8), requests=200, reps=options.repetitions(5, 3))
    return Plan(concurrency=(1, 8, 32), requests=960, reps=options.repetitions(5, 3))


def admission_review(pod_path: Path = POD_FIXTURE) -> dict[str, Any]:
    """The AdmissionReview the API server sends for a pod CREATE."""
    import yaml

    pod = yaml.safe_load(pod_path.read_text())
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.UUID(int=1)),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": pod["metadata"]["name"],
            "namespace": pod["metadata"]["namespace"],
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kubeflow:training-operator"},
            "object": pod,
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


def webhook_config() -> str:
    """The cluster defaults of the fixture namespace, as the webhook's config file.

    Without a Kubernetes API the server knows only its config file, so the
    namespace's settings go there: the review then takes the injection path.
    """
    import yaml

    namespace = yaml.safe_load(NAMESPACE_FIXTURE.read_text())
    prefix = "jitckpt.io/"
    defaults = {
        key[len(prefix) :]: value
        for key, value in namespace["metadata"]["annotations"].items()
        if key.startswith(prefix)
    }
    text: str = yaml.safe_dump({"defaults": defaults})
    return text


def make_certs(directory: Path) -> None:
    subprocess.run(
        [tool("jitckpt"), "webhook", "certs", "--out", str(directory), "--dns", HOST],
        check=True,
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
    )


def server_argv(subject: str, cert_dir: Path, config: Path, port: int) -> list[str]:
    if subject == JITCKPT:
        return [
            tool("jitckpt"),
            "webhook",
            "serve",
            "--cert-dir",
            str(cert_dir),
            "--port",
            str(port),
            "--config",
            str(config),
            "--host",
            HOST,
            "--no-kube-api",
        ]
    return [
        sys.executable,
        "-m",
        "bench.echo_server",
        "--cert-dir",
        str(cert_dir),
        "--port",
        str(port),
        "--host",
        HOST,
    ]


def load(url: str, ca: Path, payload: Path, concurrency: int, requests: int) -> list[float]:
    """Latencies in seconds, from a load generator in its own process."""
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.loadgen",
            "--url",
            url,
            "--ca",
            str(ca),
            "--payload",
            str(payload),
            "--concurrency",
            str(concurrency),
            "--requests",
            str(requests),
        ],
        check=False,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"load generator failed against {url}: {completed.stderr[-2000:]}")
    latencies: list[float] = json.loads(completed.stdout)["latencies"]
    return latencies


def run(options: BenchOptions) -> list[Case]:
    from local.ports import free_port

    settings = plan(options)
    subjects = (JITCKPT, FLOOR)
    # (subject, concurrency) -> per-repetition p50 and p99 in milliseconds
    p50: dict[tuple[str, int], list[float]] = {}
    p99: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-admission-") as tmp:
        work = Path(tmp)
        cert_dir = work / "certs"
        make_certs(cert_dir)
        config = work / "config.yaml"
        config.write_text(webhook_config())
        payload = work / "review.json"
        payload.write_text(json.dumps(admission_review()))
        servers = {}
        for subject in subjects:
            port = free_port()
            servers[subject] = (
                Background(
                    server_argv(subject, cert_dir, config, port), log=work / f"{port}.log"
                ).start(),
                f"https://{HOST}:{port}/mutate",
            )
            wait_for_port(HOST, port)
        try:
            for rep in range(settings.reps):
                order = subjects if rep % 2 == 0 else subjects[::-1]
                for concurrency in settings.concurrency:
                    for subject in order:
                        url = servers[subject][1]
                        latencies = load(
                            url, cert_dir / "ca.crt", payload, concurrency, settings.requests
                        )
                        key = (subject, concurrency)
                        p50.setdefault(key, []).append(1000 * quantile(latencies, 0.5))
                        p99.setdefault(key, []).append(1000 * quantile(latencies, 0.99))
        finally:
            for server, _ in servers.values():
                server.stop()
    cases = []
    for concurrency in settings.concurrency:
        for metric, values in (("p50 latency", p50), ("p99 latency", p99)):
            cases.append(
                Case(
                    benchmark=NAME,
                    case=f"{concurrency} concurrent",
                    metric=metric,
                    unit="ms",
                    lower_is_better=True,
                    series=[
                        Series(
                            subject=subject,
                            samples=values[(subject, concurrency)],
                            params={
                                "requests_per_rep": settings.requests,
                                "concurrency": concurrency,
                                "tls": True,
                                "http": "1.1 keep-alive",
                            },
                        )
                        for subject in subjects
                    ],
                    note="admission: one sample = the p50 or p99 of one load-generator run "
                    "(fixture PyTorchJob master pod, TLS, httpx keep-alive)",
                )
            )
    return cases


if __name__ == "__main__":
    raise SystemExit(harness.main(NAME, "bench.admission", run, __doc__))
