"""``jitckpt demo --cluster``: Kueue preempts a PyTorchJob, and a TrainJob, and admits it
again, end to end.

Every part is the real one: the API server admits every pod through jitckpt's
webhook (installed from deploy/), Kueue admits and preempts the jobs of a
ClusterQueue whose quota holds one, the training-operator (a PyTorchJob's) or
the Trainer, JobSet and the Job controller (a TrainJob's) create and delete
their pods, kube-scheduler binds them, ``local/kubelet`` runs them, and the
script is the demo's HF Trainer script, unchanged (``local/clusterdemo``).

The command runs as a user runs it. Its JSON summary is what the API server
said of the pods; the test then checks the files on its own: the final
weights of the preempted-and-resumed job against the uninterrupted one's, bit
for bit, and the resumed trainer's log (it went on from the JIT step, it did
not start over).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from local.clusterdemo.jobs import KINDS, MAX_STEPS, NAMESPACE, PROGRESS_STEP
from local.controlplane.binaries import MissingBinary, binary
from local.demo.weights import compare_files
from shim.layout import JIT_EXIT_CODE
from tests.support.tools import unavailable

pytestmark = [pytest.mark.xdist_group("cluster-demo")]

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kueue",
              "training-operator", "trainer", "jobset")  # fmt: skip


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_kueue_preempts_a_job_and_it_resumes_bitwise_when_admitted_again(
    tmp_path: Path, kind: str
) -> None:
    try:
        for component in COMPONENTS:
            binary(component)
    except MissingBinary as exc:
        unavailable(str(exc))
    jitckpt = Path(sys.executable).with_name("jitckpt")
    done = subprocess.run(
        [str(jitckpt), "demo", "--cluster", "--kind", kind, "--json", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stderr[-20000:]}\n{done.stdout}"
    summary = json.loads(done.stdout)
    account = done.stderr
    assert summary["ok"], account
    assert summary["kind"] == kind
    assert summary["preempted_exit_code"] == JIT_EXIT_CODE
    assert PROGRESS_STEP <= summary["jit_step"] < MAX_STEPS
    assert summary["high_exit_code"] == 0
    assert summary["pods_of_low"] == 2
    assert summary["evicted_to_committed"] is not None
    assert summary["readmitted_to_first_step"] is not None
    assert "weights bitwise equal to the uninterrupted run's" in account

    weights = tmp_path / "jobs" / "weights"
    comparison = compare_files(weights / "low.pt", weights / "reference.pt")
    assert comparison.equal, comparison
    job = KINDS[kind]
    pods = f"{NAMESPACE}_{job.trainer_pod('low')}_*"
    logs = sorted(
        tmp_path.glob(f"nodes/*/pods/{pods}/containers/{job.container}/log"),
        key=lambda log: log.stat().st_mtime,
    )
    assert len(logs) == 2, logs
    first, resumed = (log.read_text(errors="replace") for log in logs)
    step = summary["jit_step"]
    assert f"step {step}/" in first and f"step {step + 1}/" not in first
    assert f"step {step + 1}/" in resumed, resumed[-3000:]
    assert "step 1/" not in resumed, "the resumed pod trained from the start"
