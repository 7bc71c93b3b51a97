"""The shim talking to the real ``jitckpt agent`` over its socket, uploading to a real S3."""

from __future__ import annotations

import json
import signal
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import boto3
import pytest

from local.s3server import LocalS3
from tests.shim.support import PYTHON, TRAIN_TINY, ShimEnv, Spawn, checkpoint_steps, jit_lines
from tests.sidecar.agentproc import AgentProcess

MANIFEST = ".jitckpt/node-0.json"
RECORD = ".jitckpt/commit.json"


def uploaded(local_s3: LocalS3, destination: str) -> dict[int, set[str]]:
    """Object names per checkpoint step under the job root in S3."""
    env = local_s3.credentials_env()
    client: Any = boto3.client(
        "s3",
        endpoint_url=env["AWS_S3_ENDPOINT"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )
    bucket, prefix = destination.removeprefix("s3://").split("/", 1)
    found: dict[int, set[str]] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            head, _, rest = item["Key"][len(prefix) + 1 :].partition("/")
            if head.startswith("checkpoint-"):
                found.setdefault(int(head.split("-")[1]), set()).add(rest)
    return found


@pytest.mark.slow
def test_periodic_and_jit_checkpoints_uploaded_despite_rotation_then_restored(
    shim_env: ShimEnv, agent: AgentProcess, local_s3: LocalS3, spawn: Spawn, tmp_path: Path
) -> None:
    common = [*TRAIN_TINY, "--output-dir", str(tmp_path / "out"), "--max-steps", "20"]
    run = spawn(
        [PYTHON, *common, "--save-steps", "2", "--save-total-limit", "3", "--step-sleep", "0.3"],
        shim_env.env,
    )
    run.wait_for("rank 0 step 7/", timeout=90)
    run.signal(signal.SIGTERM)
    assert run.wait() == 143
    output = run.output()
    jit_step = int(output.split("stopping at step ")[1].split(" ")[0])
    assert f"jit checkpoint-{jit_step} handed to the sidecar" in output
    assert "periodic checkpoint-2 handed to the sidecar" in output
    # HF's rotation keeps 3, yet the local copies the sidecar had committed were removed as
    # each next periodic save began (``shim/localcopies.py``; none before the JIT save):
    # checkpoint-2 went as checkpoint-4's save began, or checkpoint-6's...
    kept = checkpoint_steps(shim_env.checkpoints)
    assert kept[-1] == jit_step and set(kept[:-1]) <= {4, 6}, kept
    assert "removed the local copy of checkpoint-2 (the store has it)" in output
    agent.wait_for(lambda: agent.committed_step() == jit_step, 60, "the JIT commit")
    # The JIT checkpoint was streamed: its upload began with its first file, before the
    # save ended and the checkpoint was complete (the periodic ones were handed over whole).
    log = agent.log()
    streamed = log.index(f"checkpoint-{jit_step} (jit) streamed: ")
    uploading = log.index(f"uploading checkpoint-{jit_step} (jit")
    assert streamed < uploading < log.index(f"accepted checkpoint-{jit_step} (jit"), log
    assert "(periodic) streamed" not in log
    objects = uploaded(local_s3, agent.destination)
    # ...yet every staged checkpoint went up whole, with its manifest, except one the
    # JIT commit superseded while it was still queued or uploading.
    superseded = {item["step"] for item in agent.status()["superseded"]}
    assert superseded <= {6}
    for step in {2, 4, 6, jit_step} - superseded:
        assert {"model.safetensors", "optimizer.pt", "trainer_state.json", MANIFEST} <= objects[
            step
        ], (step, objects.get(step))
    agent.wait_for(lambda: not any(agent.staging.glob("checkpoint-*")), 30, "staging cleanup")
    status = agent.status()
    assert status["trainer_sigterm"] is True  # the shim reported SIGTERM (its save began)
    # The report before the JIT exit names the saved step (the periodic ones may lag).
    assert status["progress"]["step"] == jit_step and status["progress"]["max_steps"] == 20
    [client] = [c for c in status["clients"] if c["pid"] == run.pid]
    assert client["framework"] == "transformers" and client["exit_code"] == 143

    # A new pod: empty local dir, the sidecar restores the newest valid checkpoint.
    agent.terminate()
    fresh = ShimEnv(tmp_path / "pod-2")
    again = AgentProcess(
        root=fresh.root, destination=agent.destination, s3_env=local_s3.credentials_env()
    )
    again.start()
    try:
        again.wait_ready(timeout=60)
        resumed = spawn([PYTHON, *common], fresh.env)
        assert resumed.wait() == 0, resumed.output()
    finally:
        again.kill()
    assert f"resuming from {fresh.checkpoints}/checkpoint-{jit_step}" in resumed.output()
    assert "train() returned at step 20" in resumed.output()


def test_the_last_step_reaches_the_sidecar_and_its_termination_message(
    shim_env: ShimEnv, agent: AgentProcess, spawn: Spawn, tmp_path: Path
) -> None:
    """Steps far shorter than the once-a-second reports: only the final report names step 6."""
    common = [*TRAIN_TINY, "--output-dir", str(tmp_path / "out"), "--max-steps", "6"]
    run = spawn([PYTHON, *common], shim_env.env)
    assert run.wait(timeout=90) == 0, run.output()
    assert "train() returned at step 6" in run.output()
    assert agent.status()["progress"]["step"] == 6
    agent.terminate()
    assert json.loads(agent.termination_log.read_text())["last_step"] == 6


@pytest.mark.slow
def test_sidecar_gone_mid_run_training_goes_on_and_says_so_once(
    shim_env: ShimEnv, agent: AgentProcess, spawn: Spawn, tmp_path: Path
) -> None:
    run = spawn(
        [
            PYTHON,
            *TRAIN_TINY,
            "--output-dir",
            str(tmp_path / "out"),
            "--max-steps",
            "16",
            "--save-steps",
            "3",
            "--step-sleep",
            "0.2",
        ],
        shim_env.env,
    )
    run.wait_for("periodic checkpoint-3 handed to the sidecar", timeout=90)
    agent.kill()  # SIGKILL: the socket file stays, nobody answers
    assert run.wait() == 0, run.output()
    output = run.output()
    assert "train() returned at step 16" in output
    gone = [line for line in jit_lines(output) if "did not answer" in line]
    assert len(gone) == 1, jit_lines(output)
    assert checkpoint_steps(shim_env.checkpoints) == [3, 6, 9, 12, 15, 16]


PLAIN_LOOP_SCRIPT = """
import multiprocessing, os, sys, time
import torch
import torch.distributed  # a plain loop: no transformers

def worker(ready, done):  # like a DataLoader worker started with "spawn": it stages nothing
    import torch.distributed
    ready.set()
    done.wait()

def save(step):
    path = os.path.join(os.environ["JITCKPT_DIR"], "checkpoints", "checkpoint-%d" % step)
    os.makedirs(path)
    state = {"step": step, "w": torch.full((1000,), float(step))}
    torch.save(state, os.path.join(path, "state.pt"))
    print("wrote checkpoint-%d" % step, flush=True)

if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    ready, done = context.Event(), context.Event()
    helper = context.Process(target=worker, args=(ready, done))
    helper.start()
    ready.wait()
    save(1)
    save(2)
    time.sleep(float(sys.argv[1]))
    print("second phase", flush=True)
    done.set()
    helper.join()
    save(3)
"""


@pytest.mark.slow
def test_plain_loop_checkpoints_staged_once_complete(
    shim_env: ShimEnv, agent: AgentProcess, local_s3: LocalS3, spawn: Spawn, tmp_path: Path
) -> None:
    script = tmp_path / "plain.py"
    script.write_text(textwrap.dedent(PLAIN_LOOP_SCRIPT))
    run = spawn([PYTHON, str(script), "7"], shim_env.env)
    assert run.wait(timeout=90) == 0, run.output()
    output = run.output()
    # checkpoint-1 went once checkpoint-2 existed; 2 and 3 when the process ended.
    assert output.index("checkpoint-1 handed") < output.index("second phase")
    assert output.index("second phase") < output.index("checkpoint-2 handed")
    assert "checkpoint-3 handed" in output
    for step in (1, 2, 3):  # once each: the spawned helper process staged nothing
        assert output.count(f"checkpoint-{step} handed") == 1, output
    agent.wait_for(lambda: agent.committed_step() == 3, 60, "the last commit")
    objects = uploaded(local_s3, agent.destination)
    assert {step: names for step, names in objects.items()} == {
        step: {"state.pt", MANIFEST, RECORD} for step in (1, 2, 3)
    }


def test_the_copy_the_agent_installs_is_a_working_shim(
    shim_env: ShimEnv, agent: AgentProcess, tmp_path: Path
) -> None:
    """What the sidecar copies to /opt/jitckpt/shim activates on its own, without the repo."""
    copied = sorted(path.name for path in agent.shim_target.glob("*.py"))
    assert "sitecustomize.py" in copied and "protocol.py" in copied
    code = (
        "import sys; m = sys.modules['_jitckpt_shim'];"
        "print(m.__path__[0], 'protocol' in sys.modules, 'shim' in sys.modules)"
    )
    done = subprocess.run(
        [PYTHON, "-c", code],
        env={**shim_env.env, "PYTHONPATH": str(agent.shim_target)},
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.split() == [str(agent.shim_target), "False", "False"], done.stderr
    assert jit_lines(done.stderr) == []
