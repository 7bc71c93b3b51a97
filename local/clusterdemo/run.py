"""``jitckpt demo --cluster``: start the cluster, run the flow, say what happened."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import IO

from local.clusterdemo.cluster import kubeflow_cluster
from local.clusterdemo.flow import run_flow
from local.clusterdemo.jobs import KINDS
from local.clusterdemo.observe import FlowError
from local.controlplane.binaries import MissingBinary
from local.controlplane.cluster import ControlPlaneError
from local.demo.destination import Destination


def run_cluster_demo(workdir: Path | None, keep: bool, as_json: bool, kind: str) -> int:
    """0 when the preempted job resumed bitwise, 1 when not, 2 when the cluster can't run."""
    account: IO[str] = sys.stderr if as_json else sys.stdout

    def say(line: str) -> None:
        print(line, file=account, flush=True)

    work = workdir or Path(tempfile.mkdtemp(prefix="jitckpt-cluster-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    destination = Destination.embedded()
    summary: dict[str, object]
    try:
        say("starting etcd, kube-apiserver, its controllers, two nodes, Kueue, the "
            "training-operator, the Trainer with JobSet and jitckpt's webhook (deploy/) on "
            "127.0.0.1")  # fmt: skip
        with kubeflow_cluster(work) as cluster:
            api = cluster.api()
            try:
                result = run_flow(api, cluster.node_root, KINDS[kind], workdir=work / "jobs",
                                  destination=destination, say=say, logs=cluster.logs)  # fmt: skip
            finally:
                api.close()
        summary = result.summary()
        code = 0 if result.ok else 1
    except MissingBinary as exc:
        say(f"jitckpt demo --cluster: {exc}")
        summary, code = {"ok": False, "error": str(exc)}, 2
    except (ControlPlaneError, FlowError) as exc:
        say(f"jitckpt demo --cluster: {exc}")
        summary, code = {"ok": False, "error": str(exc)}, 1
    finally:
        destination.close()
        if keep or workdir is not None:
            say(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
    return code
