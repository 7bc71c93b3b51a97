"""The final model's hand-over in the shim: the exit status it sees, plain loops, the setting.

The end-to-end tests (``tests/e2e/test_final_model.py``) follow the model of
an unchanged HF script into the store through the pod runner; here, with
real processes and the real agent (on a directory standing for a claim):
the exit status a script ends with, as the shim's ``atexit`` handler sees
it; what a plain loop saves after its last optimizer step, and nothing when
it fails after saving; ``upload-final: "false"``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sidecar import final
from sidecar.config import AgentConfig
from sidecar.storage.factory import open_store
from tests.shim.support import PYTHON, REPO, ShimEnv, Spawn
from tests.sidecar.agentproc import AgentProcess

SCRIPTS = REPO / "tests" / "e2e" / "scripts"
SAVE_MODEL_SCRIPT = SCRIPTS / "train_save_model.py"
DESTINATION = "pvc://claim-a/ckpts/ns-a/job-1"

# Ends the way CASE says; an atexit handler registered first (so it runs last) prints
# the status the shim's tracker saw, to compare with the status the process really had.
ENDINGS = textwrap.dedent(
    """
    import atexit, sys, threading
    from shim.exitstatus import STATUS
    STATUS.install()
    atexit.register(lambda: print("seen", STATUS.code(), flush=True))
    case = sys.argv[1]
    if case == "sys.exit(0)":
        sys.exit(0)
    elif case == "sys.exit(3)":
        sys.exit(3)
    elif case == "sys.exit(text)":
        sys.exit("cannot go on")
    elif case == "exit(2)":
        exit(2)
    elif case == "from sys import exit":
        from sys import exit as leave
        leave(4)
    elif case == "exception":
        raise RuntimeError("evaluation failed")
    elif case == "KeyboardInterrupt":
        raise KeyboardInterrupt
    elif case == "sys.exit in a thread":
        worker = threading.Thread(target=sys.exit, args=(5,))
        worker.start()
        worker.join()
    """
)
CASES = [
    "end of script",
    "sys.exit(0)",
    "sys.exit(3)",
    "sys.exit(text)",
    "exit(2)",
    "from sys import exit",
    "exception",
    "KeyboardInterrupt",
    "sys.exit in a thread",
]


@pytest.mark.parametrize("case", CASES)
def test_the_exit_status_seen_at_exit_is_the_process_status(case: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", ENDINGS, case],
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    seen = int(done.stdout.split("seen ")[1])
    if done.returncode in (0, 1, 2, 3, 4):
        assert seen == done.returncode, done.stderr
    else:  # KeyboardInterrupt: 130 from the interpreter; any failure must not look like 0
        assert seen != 0 and done.returncode != 0


def _final_state(destination: str, pvc: Path) -> final.FinalState | None:
    async def main() -> final.FinalState | None:
        async with open_store(AgentConfig(destination=destination, pvc_mount=pvc)) as store:
            return await final.judge(store)

    return asyncio.run(main())


def _stored(pvc: Path) -> dict[str, bytes]:
    """The committed final model's files, read from the claim (the record checked first)."""
    state = _final_state(DESTINATION, pvc)
    assert state is not None and state.valid, state
    run = pvc / "ckpts" / "ns-a" / "job-1" / state.key
    return {e.path: (run / e.path).read_bytes() for e in state.files}


def _run_with_agent(
    tmp_path: Path, spawn: Spawn, args: list[str], env: dict[str, str] | None = None
) -> tuple[int, str, AgentProcess]:
    """``args`` as the trainer of a pod whose sidecar uploads to a claim; its status, output."""
    pod = ShimEnv(tmp_path / "pod")
    claim = tmp_path / "claim"
    claim.mkdir()
    agent = AgentProcess(
        root=pod.root,
        destination=DESTINATION,
        s3_env={},
        extra_env={"JITCKPT_PVC_MOUNT": str(claim)},
    )
    agent.start()
    try:
        agent.wait_ready()
        run = spawn([PYTHON, *args], {**pod.env, **(env or {})})
        code = run.wait(timeout=120)
        assert agent.terminate() == 0, agent.log()
    finally:
        agent.kill()
    return code, run.output(), agent


@pytest.mark.slow
def test_plain_loop_saves_after_its_last_step_are_the_final_model(
    tmp_path: Path, spawn: Spawn
) -> None:
    """Per-epoch torch.save files but the last one are not final; save_pretrained's files are."""
    out = tmp_path / "out"
    script = str(SCRIPTS / "loop_saves.py")
    code, output, _ = _run_with_agent(tmp_path, spawn, [script, "--output-dir", str(out)])
    assert code == 0, output
    assert "final model handed to the sidecar: 4 files" in output
    expected = ["epoch-2.pt", "final/config.json", "final/generation_config.json"]
    expected.append("final/model.safetensors")
    stored = _stored(tmp_path / "claim")
    assert sorted(stored) == expected
    assert all(stored[name] == (out / name).read_bytes() for name in expected)
    assert (out / "epoch-1.pt").is_file()  # saved before the last steps: not the model


@pytest.mark.slow
def test_a_plain_loop_that_fails_after_saving_uploads_no_final_model(
    tmp_path: Path, spawn: Spawn
) -> None:
    model = tmp_path / "model.pt"
    args = [str(SCRIPTS / "loop_shuffled_then_fail.py"), "--epochs", "1", "--workers", "0"]
    code, output, agent = _run_with_agent(tmp_path, spawn, [*args, "--save-model", str(model)])
    assert code == 1, output
    assert model.is_file()  # it saved, then failed
    assert "exiting with status 1: the final model is not uploaded" in output
    assert _final_state(DESTINATION, tmp_path / "claim") is None
    assert agent.termination()["final"] is None


def test_upload_final_false_keeps_the_model_where_the_program_saved_it(
    tmp_path: Path, spawn: Spawn
) -> None:
    """``jitckpt.io/upload-final: "false"``: save_model writes as ever, nothing reaches final/.

    (With the setting on, ``tests/e2e/test_final_model.py`` follows the model into the store.)
    """
    output = tmp_path / "model"
    args = [str(SAVE_MODEL_SCRIPT), "--output-dir", str(output)]
    code, said, agent = _run_with_agent(tmp_path, spawn, args, {"JITCKPT_UPLOAD_FINAL": "false"})
    assert code == 0, said
    assert (output / "model.safetensors").is_file()
    assert "jitckpt.io/upload-final is false" in said
    assert _final_state(DESTINATION, tmp_path / "claim") is None  # nothing under final/ at all
    assert agent.termination()["final"] is None
