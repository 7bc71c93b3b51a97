"""Real PyTorch Lightning runs (CPU, gloo) under the shim, stopped by real signals.

The script is the user-style one of the end-to-end tests, unchanged. A run is
stopped at an exact step through the demo's hold (the ranks wait at step K
until SIGTERM comes), except where the test is about an unannounced SIGTERM.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import torch

from tests.shim.support import (
    PYTHON,
    TORCHRUN,
    Proc,
    ShimEnv,
    Spawn,
    assert_attached_once,
    assert_stood_down,
    checkpoint_steps,
    jit_lines,
)

SCRIPT = str(Path(__file__).parents[1] / "e2e" / "scripts" / "train_lightning.py")
MAX_STEPS = 30  # 12 batches an epoch: epochs end at steps 12 and 24
HOLD = "JITCKPT_DEMO_HOLD_AT_STEP"


def final_weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=False)["state_dict"]


def assert_bitwise_equal(left: Path, right: Path) -> None:
    a, b = final_weights(left), final_weights(right)
    assert a.keys() == b.keys()
    assert [name for name in a if not torch.equal(a[name], b[name])] == []


def stop_at(proc: Proc, step: int) -> None:
    """Wait until the run holds at ``step``, then SIGTERM it."""
    proc.wait_for(f"holding at step {step} until", timeout=120)
    proc.signal(signal.SIGTERM)


# A stop where Lightning validates right after the step (the save waits for the
# validation's end); and one at an epoch's last batch with gradient accumulation
# (two batches per optimizer step) and no validation.
# The resumed run saves periodically as the settings say (the newest two kept).
EVERY_4_STEPS = ({"JITCKPT_SAVE_STEPS": "4", "JITCKPT_SAVE_TOTAL_LIMIT": "2"}, [24, 28])
EVERY_EPOCH = ({"JITCKPT_SAVE_STRATEGY": "epoch", "JITCKPT_SAVE_TOTAL_LIMIT": "2"}, [24, 30])
CASES = {
    "validation-at-epoch-end": ([], 12, EVERY_4_STEPS),
    "accumulation-epoch-end": (
        ["--no-validate", "--accumulate-grad-batches", "2"],
        6,  # 6 optimizer steps an epoch
        EVERY_EPOCH,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_stop_at_epoch_end_exits_143_and_resume_is_bitwise(
    case: str, shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    extra, step, (periodic, kept) = CASES[case]
    reference = spawn(
        [PYTHON, SCRIPT, "--output-dir", str(tmp_path / "reference"), *extra],
        shim_env.without_shim(),
    )
    cut = spawn(
        [PYTHON, SCRIPT, "--output-dir", str(tmp_path / "cut"), *extra],
        {**shim_env.env, HOLD: str(step)},
    )
    stop_at(cut, step)
    assert cut.wait() == 143, cut.output()[-3000:]
    output = cut.output()
    assert f"stopping at step {step} for a JIT checkpoint" in output
    assert_attached_once(output, "Lightning (lightning.pytorch ", shim_env.checkpoints)
    if "--no-validate" not in extra:
        assert "saving once the validation ended" in output
    assert "fit() returned" not in output and not (tmp_path / "cut" / "final.ckpt").exists()
    assert checkpoint_steps(shim_env.checkpoints) == [step]
    written = sorted(p.name for p in (shim_env.checkpoints / f"checkpoint-{step}").iterdir())
    assert written == ["jitckpt_rank_0.pt", "model.ckpt"]
    assert list(shim_env.pids.iterdir()) == []
    assert reference.wait() == 0, reference.output()[-3000:]

    resumed = spawn(
        [PYTHON, SCRIPT, "--output-dir", str(tmp_path / "resumed"), *extra],
        {**shim_env.env, **periodic},
    )
    assert resumed.wait() == 0, resumed.output()[-3000:]
    output = resumed.output()
    assert f"resuming from {shim_env.checkpoints}/checkpoint-{step}" in output
    assert f"fit() returned at step {MAX_STEPS}" in output
    # The periodic saves the environment asked for, the newest two kept here.
    assert checkpoint_steps(shim_env.checkpoints) == kept
    assert_bitwise_equal(tmp_path / "resumed" / "final.ckpt", tmp_path / "reference" / "final.ckpt")


@pytest.mark.slow
def test_train_data_that_cannot_resume_exactly_gets_no_checkpoint_and_lightnings_sigterm(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """Persistent workers started by spawn: their random states carry over from epochs a
    resume cannot replay, and are followed in forked workers only (refused in the words every
    framework uses: shim/workerstates.problem).

    Said once before the first step; no JIT or periodic checkpoint; SIGTERM
    does what Lightning does with it without the shim (the same exit, and the
    same rest of the program), not a JIT stop and not death by the signal.
    """
    args = ["--num-workers", "2", "--persistent-workers", "--workers-start", "spawn"]
    args += ["--max-steps", "200"]
    runs = {}
    for name, env in (
        ("plain", shim_env.without_shim()),
        ("shim", {**shim_env.env, "JITCKPT_SAVE_STEPS": "2"}),
    ):
        run = spawn([PYTHON, SCRIPT, "--output-dir", str(tmp_path / name), *args], env)
        # The first epoch's last step (96 samples, batch 8): Lightning ends fit() at the
        # epoch's end with the persistent workers' iterator alive at exit, whose workers
        # (SIGTERM ignored under the shim) held multiprocessing's exit forever.
        run.wait_for("rank 0 step 12\n", timeout=120)
        run.signal(signal.SIGTERM)
        runs[name] = (run.wait(), run.output())
    code, output = runs["shim"]
    assert code == runs["plain"][0], output[-3000:]
    assert ("fit() returned" in output) == ("fit() returned" in runs["plain"][1])
    reason = "persistent DataLoader workers started by 'spawn'"
    assert_stood_down(output, reason, "rank 0 step 1\n", shim_env.checkpoints)


def test_a_jit_save_that_fails_leaves_sigterm_its_default_action(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """No checkpoint can be written (a file where the directory goes): death by SIGTERM."""
    shim_env.checkpoints.write_text("not a directory")
    run = spawn(
        [PYTHON, SCRIPT, "--output-dir", str(tmp_path / "out")], {**shim_env.env, HOLD: "3"}
    )
    stop_at(run, 3)
    assert run.wait() == -signal.SIGTERM, run.output()[-3000:]
    output = run.output()
    assert "JIT checkpoint-3 could not be written" in output
    assert "fit() returned" not in output


def _two_nodes(
    tmp_path: Path, port: int, args: list[str], extra_env: dict[str, str] | None = None
) -> list[tuple[ShimEnv, Proc]]:
    """Two one-process "nodes" (torchrun each, own local dir), as two pods of a job."""
    nodes = []
    for rank in range(2):
        env = ShimEnv(tmp_path / f"node-{rank}")
        env.env.update(extra_env or {})
        command = [
            TORCHRUN,
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={rank}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            SCRIPT,
            *args,
        ]
        nodes.append((env, Proc(command, env.env, tmp_path / f"node-{rank}.log")))
    return nodes


def _worker_pid(env: ShimEnv) -> int:
    """The training process of a node (the one of its registered pids that has a RANK)."""
    for pid_file in env.pids.iterdir():
        environ = Path(f"/proc/{pid_file.stem}/environ").read_bytes().split(b"\0")
        if any(item.startswith(b"RANK=") for item in environ):
            return int(pid_file.stem)
    raise AssertionError(f"no training process registered in {env.pids}")


@pytest.mark.slow
def test_sigterm_to_one_node_of_two_stops_both_at_the_same_step(tmp_path: Path) -> None:
    """An unannounced SIGTERM to node 1's trainer: both nodes save the same step, exit 143."""
    nodes = _two_nodes(
        tmp_path, 29541, ["--output-dir", str(tmp_path / "out"), "--max-steps", "400"]
    )
    try:
        (env0, node0), (env1, node1) = nodes
        node1.wait_for("rank 1 step 5", timeout=120)
        subprocess.run(["kill", "-TERM", str(_worker_pid(env1))], check=True)
        codes = [node0.wait(timeout=120), node1.wait(timeout=120)]
    finally:
        for _, proc in nodes:
            if proc.popen.poll() is None:
                proc.popen.kill()
    outputs = [proc.output() for _, proc in nodes]
    assert codes == [143, 143], outputs[0][-2000:] + outputs[1][-2000:]
    stops = [
        line.split("stopping at step ")[1].split(" ")[0]
        for output in outputs
        for line in jit_lines(output)
        if "stopping at step" in line
    ]
    assert len(stops) == 2 and stops[0] == stops[1], stops
    step = int(stops[0])
    assert 5 <= step < 400
    assert all("fit() returned" not in output for output in outputs)
    # Lightning writes the checkpoint on global rank 0; for a JIT save of a job on two
    # nodes each node's local rank 0 writes it too (so each sidecar uploads a piece of
    # it), the same dict every rank dumped; every rank writes its own state.
    directories = [env.checkpoints / f"checkpoint-{step}" for env in (env0, env1)]
    names = [sorted(p.name for p in directory.iterdir()) for directory in directories]
    assert names == [["jitckpt_rank_0.pt", "model.ckpt"], ["jitckpt_rank_1.pt", "model.ckpt"]]
    sizes = {(directory / "model.ckpt").stat().st_size for directory in directories}
    assert len(sizes) == 1, sizes  # a replica: one size on every node
    # Lightning's own SIGTERM handling stayed out (it would broadcast and raise).
    assert all("Received SIGTERM" not in output for output in outputs)


SPAWN_SCRIPT = """
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, index):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

if __name__ == "__main__":
    data = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=1, strategy="ddp_spawn",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Tiny(), data)
    print("trained", flush=True)
"""


@pytest.mark.slow
def test_a_strategy_the_shim_cannot_serve_is_said_once_and_trains(
    shim_env: ShimEnv, tmp_path: Path
) -> None:
    """ddp_spawn trains in processes Lightning spawns itself: no integration, one message."""
    script = tmp_path / "spawned.py"
    script.write_text(SPAWN_SCRIPT)
    done = subprocess.run(
        [PYTHON, str(script)],
        env=shim_env.env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and "trained" in done.stdout, done.stderr[-3000:]
    lines = jit_lines(done.stderr)
    assert len(lines) == 1, lines
    assert "_MultiProcessingLauncher starts the training processes itself" in lines[0]
    assert "trains unchanged" in lines[0]
    assert checkpoint_steps(shim_env.checkpoints) == []


def test_lightning_without_the_patched_parts(shim_env: ShimEnv, tmp_path: Path) -> None:
    """An unknown pytorch_lightning: no integration, one message, the program runs unchanged."""
    fake = tmp_path / "site" / "pytorch_lightning"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "__version__ = '0.0-unknown'\nclass Trainer:\n    def fit(self, model):\n        pass\n"
    )
    env = {**shim_env.env, "PYTHONPATH": shim_env.env["PYTHONPATH"] + ":" + str(fake.parent)}
    done = subprocess.run(
        [PYTHON, "-c", "import pytorch_lightning as pl; pl.Trainer().fit(None); print('trained')"],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "trained", done.stderr
    lines = jit_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert "pytorch_lightning 0.0-unknown lacks Trainer.save_checkpoint" in lines[0]
