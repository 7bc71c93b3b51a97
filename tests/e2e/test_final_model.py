"""The trained model reaches ``<job root>/final/``: unchanged scripts, preempted, resumed.

Every pod is a PyTorchJob pod injected by ``mutate()`` and run by the pod
runner, as in the demo. The scripts know nothing of jitckpt: an HF one that
trains and calls ``trainer.save_model()`` (``scripts/train_save_model.py``),
on S3 and on ``pvc://``, and the Kubeflow-shaped plain DDP loop whose rank 0
saves the model with ``torch.save`` (``scripts/loop_ddp_mnist.py``, two
ranks). Each time:

- run 1 is preempted at step 3: it exits 143 and the store holds its JIT
  checkpoint and no ``final/`` at all;
- run 2 resumes and finishes: ``final/`` holds exactly the files the
  script's own final save wrote in its pod, byte for byte (read back from the
  store, each checked against the commit record);
- on ``pvc://`` a run 3 then resumes, saves and raises after the save (exit
  1): its model is in its pod, and ``final/`` is still run 2's.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from local.demo.jobrun import JobRun
from local.demo.scenario import (
    DemoOptions,
    Scenario,
    final_model,
    finish_first,
    open_scenario,
    preempt,
    resume,
    start_first,
)
from sidecar import final

SCRIPTS = Path(__file__).with_name("scripts")
SCRIPT = SCRIPTS / "train_save_model.py"
CRASHING = SCRIPTS / "train_save_model_then_fail.py"
DDP_SCRIPT = SCRIPTS / "loop_ddp_mnist.py"
OUTPUT = "model"  # relative: each pod writes into its own working directory
MAX_STEPS = 8
DDP_STEPS = 16  # 2 epochs of 8 steps on 2 ranks
DDP_MODEL = "mnist_cnn.pt"  # the DDP script's default, in its working directory
PREEMPT_AT = 3

Model = dict[str, bytes]


def stored_model(s: Scenario) -> Model | None:
    """The committed final model's files, downloaded and verified (None: no final/ at all)."""

    async def main() -> Model | None:
        async with s.destination.open_store(s.job_root, s.node) as store:
            state = await final.judge(store)
            if state is None:
                return None
            assert state.valid and state.run is not None, state.reason
            model: Model = {}
            for entry in state.files:
                with tempfile.TemporaryFile() as out:
                    key = final.file_key(state.run, entry.path)
                    await store.get_file(key, out.fileno(), entry.size, entry.crc32c)
                    out.seek(0)
                    model[entry.path] = out.read()
            return model

    return asyncio.run(main())


def pod_output(run: JobRun) -> Model:
    """What the HF trainer of node 0 wrote into its ``output_dir``."""
    working_dir = run.job.working_dir(0)
    assert working_dir is not None
    directory = Path(working_dir) / OUTPUT
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*")}


def ddp_model(run: JobRun) -> Model:
    """The model file rank 0 of the DDP loop saved in node 0's working directory."""
    working_dir = run.job.working_dir(0)
    assert working_dir is not None
    return {DDP_MODEL: (Path(working_dir) / DDP_MODEL).read_bytes()}


def preempted_then_resumed(s: Scenario, saved: Callable[[JobRun], Model], steps: int) -> JobRun:
    """Runs 1 and 2; checks that only the finished one left a final model: what it ``saved``."""
    first, watcher = start_first(s)
    first.wait_for_step(PREEMPT_AT, s.options.timeout)
    preempt(s, first)
    judged = finish_first(s, first, watcher)
    assert first.exit_codes() == [143]
    assert judged.jit_step is not None, "no JIT checkpoint committed"
    assert stored_model(s) is None, "a preempted run must leave no final/"
    second = resume(s, None)
    assert second.exit_codes() == [0], second.logs()
    written = saved(second)
    assert stored_model(s) == written  # exactly what the script's final save wrote
    summary = final_model(s)  # what the demo reports
    assert summary is not None and summary["valid"] and summary["step"] == steps
    assert summary["size"] == sum(len(data) for data in written.values())
    assert summary["uri"].startswith(f"{s.job_root}/final/run-")
    return second


def options(tmp_path: Path, destination: str, mode: str) -> DemoOptions:
    return DemoOptions(
        script=SCRIPT,
        script_args=["--output-dir", OUTPUT, "--max-steps", str(MAX_STEPS)],
        nnodes=1,
        nproc_per_node=1,
        preempt_at_step=PREEMPT_AT,
        destination=destination,
        sidecar_mode=mode,
        compare=False,
        workdir=tmp_path / "demo",
        keep=True,
    )


def hf_model(run: JobRun) -> Model:
    written = pod_output(run)
    assert {"model.safetensors", "config.json"} <= set(written)
    return written


@pytest.mark.slow
def test_final_model_in_s3_after_preemption_and_resume(tmp_path: Path, s3_bucket: str) -> None:
    with open_scenario(options(tmp_path, f"s3://{s3_bucket}/final", "native"), sys.stderr) as s:
        preempted_then_resumed(s, hf_model, MAX_STEPS)


@pytest.mark.slow
def test_final_model_on_a_claim_and_a_crash_after_the_save_uploads_none(tmp_path: Path) -> None:
    with open_scenario(options(tmp_path, "pvc://ckpt-claim/final", "legacy"), sys.stderr) as s:
        second = preempted_then_resumed(s, hf_model, MAX_STEPS)
        s.options.script = CRASHING
        third = s.run(s.job("run-3", s.options.job_name, {})).start()
        third.wait(s.options.timeout)
        assert third.exit_codes() == [1]
        crashed = pod_output(third)
        assert "model.safetensors" in crashed  # it saved, then failed
        assert stored_model(s) == pod_output(second)  # final/ is still run 2's


@pytest.mark.slow
def test_final_model_of_a_plain_ddp_loop_is_what_rank_0_saved(
    tmp_path: Path, s3_bucket: str
) -> None:
    ddp = options(tmp_path, f"s3://{s3_bucket}/final-ddp", "native")
    ddp.script, ddp.script_args, ddp.nproc_per_node = DDP_SCRIPT, ["--epochs", "2"], 2
    with open_scenario(ddp, sys.stderr) as s:
        preempted_then_resumed(s, ddp_model, DDP_STEPS)
