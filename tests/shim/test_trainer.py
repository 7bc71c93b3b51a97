"""A real HF Trainer (tiny model, CPU) under the shim, stopped by real signals."""

from __future__ import annotations

import json
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.shim.support import (
    PYTHON,
    TORCHRUN,
    TRAIN_TINY,
    Proc,
    ShimEnv,
    Spawn,
    checkpoint_steps,
    jit_lines,
)

MAX_STEPS = 10


def assert_same_weights(left: Path, right: Path) -> None:
    a = torch.load(left, weights_only=True)
    b = torch.load(right, weights_only=True)
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert different == []


@pytest.mark.slow
def test_sigterm_saves_at_next_step_exits_143_and_resume_is_bitwise(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    common = [*TRAIN_TINY, "--output-dir", str(out), "--max-steps", str(MAX_STEPS)]
    reference = spawn(
        [PYTHON, *common, "--final-weights", str(tmp_path / "reference.pt")],
        {**shim_env.without_shim(), "OMP_NUM_THREADS": "1"},
    )
    cut = spawn(
        [PYTHON, *common, "--step-sleep", "0.4", "--final-weights", str(tmp_path / "cut.pt")],
        shim_env.env,
    )
    cut.wait_for("rank 0 step 3/")
    cut.signal(signal.SIGTERM)
    assert cut.wait() == 143
    output = cut.output()
    assert "train() returned" not in output and not (tmp_path / "cut.pt").exists()
    [step] = checkpoint_steps(shim_env.checkpoints)
    assert step in (3, 4)  # the step boundary right after the signal
    assert f"stopping at step {step} for a JIT checkpoint" in output
    state = json.loads((shim_env.checkpoints / f"checkpoint-{step}/trainer_state.json").read_text())
    assert state["global_step"] == step
    assert checkpoint_steps(out) == []  # checkpoints go to JITCKPT_DIR, not the output dir
    assert list(shim_env.pids.iterdir()) == []
    assert reference.wait() == 0

    resumed = spawn(
        [PYTHON, *common, "--final-weights", str(tmp_path / "resumed.pt")],
        {**shim_env.env, "JITCKPT_SAVE_STEPS": "5", "JITCKPT_SAVE_TOTAL_LIMIT": "1"},
    )
    assert resumed.wait() == 0, resumed.output()
    assert f"resuming from {shim_env.checkpoints}/checkpoint-{step}" in resumed.output()
    assert f"train() returned at step {MAX_STEPS}" in resumed.output()
    # HF's Trainer keeps no state of its own beyond its checkpoint: nothing is said of it.
    assert "keeps state across steps" not in output + resumed.output()
    # The periodic settings came from the environment: saves every 5 steps, newest kept.
    assert checkpoint_steps(shim_env.checkpoints) == [MAX_STEPS]
    assert_same_weights(tmp_path / "resumed.pt", tmp_path / "reference.pt")


COUNTED_COLLECTIVES_SCRIPT = """
import sys, traceback
import torch.distributed as dist
from transformers import TrainerCallback
from local.demo import train_tiny

calls = [0]
for name in ("all_reduce", "all_gather", "broadcast", "barrier", "all_gather_object"):
    def counted(*args, _original=getattr(dist, name), **kwargs):
        if "/shim/" in traceback.extract_stack(limit=2)[0].filename:  # the shim called it
            calls[0] += 1
        return _original(*args, **kwargs)
    setattr(dist, name, counted)

class Counting(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        print(f"rank {dist.get_rank()} shim collectives before step end {state.global_step}: "
              f"{calls[0]}", flush=True)

original = train_tiny.make_callbacks
train_tiny.make_callbacks = lambda sleep: [Counting(), *original(sleep)]
sys.exit(train_tiny.main())
"""


@pytest.mark.slow
def test_torchrun_sigterm_to_one_worker_stops_both_at_the_same_step(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """With no collective of the shim's at a step end: the ranks agree through the store."""
    script = tmp_path / "counted.py"
    script.write_text(COUNTED_COLLECTIVES_SCRIPT)
    run = spawn(
        [
            str(Path(PYTHON).with_name("torchrun")),
            "--nproc-per-node",
            "2",
            "--master-port",
            "29531",
            str(script),
            "--output-dir",
            str(tmp_path / "out"),
            "--max-steps",
            "40",
            "--step-sleep",
            "0.3",
        ],
        shim_env.env,
    )
    run.wait_for("rank 1 step 5/", timeout=90)  # steps 2 to 4 are counted on both ranks
    ranks = {}
    for pid_file in shim_env.pids.iterdir():
        environ = Path(f"/proc/{pid_file.stem}/environ").read_bytes().split(b"\0")
        rank = [item[5:].decode() for item in environ if item.startswith(b"RANK=")]
        if rank:
            ranks[rank[0]] = int(pid_file.stem)
    assert set(ranks) == {"0", "1"}
    started = time.monotonic()
    subprocess.run(["kill", "-TERM", str(ranks["1"])], check=True)
    code = run.wait(timeout=90)
    assert time.monotonic() - started < 30  # nothing hung
    assert code == 143, run.output()[-3000:]  # a JIT stop: retryable, never a success
    output = run.output()
    stops = {
        line.split("pid ")[1].split(":")[0]: line.split("step ")[1].split(" ")[0]
        for line in jit_lines(output)
        if "stopping at step" in line
    }
    assert set(stops) == {str(ranks["0"]), str(ranks["1"])}
    assert len(set(stops.values())) == 1, stops
    step = int(next(iter(stops.values())))
    checkpoint = shim_env.checkpoints / f"checkpoint-{step}"
    names = {path.name for path in checkpoint.iterdir()}
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= names
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= names
    assert output.count("exitcode  : 143") == 2
    assert "train() returned" not in output
    # Between the first step end and the stop, the shim asked for no collective at all.
    for rank in ("0", "1"):
        counts = [
            int(line.rsplit(": ", 1)[1])
            for line in output.splitlines()
            if line.startswith(f"rank {rank} shim collectives before step end ")
            and 2 <= int(line.split("step end ")[1].split(":")[0]) <= step
        ]
        assert len(counts) >= 2 and len(set(counts)) == 1, (rank, counts)


SLOW_SAVE_SECONDS = 32  # more than torchrun's default 30 s
SLOW_SAVE_SCRIPT = """
import sys, time
from transformers import Trainer
from local.demo import train_tiny

class SlowSaveTrainer(Trainer):
    def _save_checkpoint(self, model, trial):
        print("slow save begins", flush=True)
        time.sleep({seconds})
        super()._save_checkpoint(model, trial)

sys.exit(train_tiny.main(trainer_class=SlowSaveTrainer))
"""


@pytest.mark.slow
def test_torchrun_does_not_kill_a_save_longer_than_30s(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """Without the shim torchrun SIGKILLs its worker 30 s after forwarding SIGTERM."""
    script = tmp_path / "slow_save.py"
    script.write_text(textwrap.dedent(SLOW_SAVE_SCRIPT.format(seconds=SLOW_SAVE_SECONDS)))
    run = spawn(
        [
            str(Path(PYTHON).with_name("torchrun")),
            "--nproc-per-node",
            "1",
            "--master-port",
            "29537",
            str(script),
            "--output-dir",
            str(tmp_path / "out"),
            "--max-steps",
            "40",
            "--step-sleep",
            "0.2",
        ],
        {**shim_env.env, "JITCKPT_GRACE_SECONDS": "70"},
    )
    run.wait_for("rank 0 step 2/", timeout=90)
    started = time.monotonic()
    run.signal(signal.SIGTERM)  # to the launcher, which forwards it to its worker
    code = run.wait(timeout=90)
    assert time.monotonic() - started > SLOW_SAVE_SECONDS
    output = run.output()
    assert code == 143, output[-3000:]  # the launcher got SIGTERM: it looks terminated by it
    assert "slow save begins" in output
    assert "JIT checkpoint-" in output and "saved; exiting with 143" in output, output[-3000:]
    [step] = checkpoint_steps(shim_env.checkpoints)
    assert (shim_env.checkpoints / f"checkpoint-{step}" / "trainer_state.json").is_file()


CRASH_SCRIPT = """
import os, time
import torch.distributed
if os.environ["RANK"] == "1":
    raise RuntimeError("worker crash")
time.sleep(60)
"""


def test_torchrun_worker_crash_keeps_torchruns_exit_status(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """A crash is no JIT stop: torchrun exits 1 (permanent), even though rank 0 got SIGTERM."""
    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT)
    run = spawn(
        [TORCHRUN, "--nproc-per-node", "2", "--master-port", "29539", str(script)],
        shim_env.env,
    )
    code = run.wait(timeout=90)
    output = run.output()
    assert code == 1, output[-3000:]
    assert "RuntimeError: worker crash" in output
    assert "exiting with 143" not in output


OUTSIDE_TRAIN_SCRIPT = """
import sys, time
from transformers import Trainer, TrainingArguments
from local.demo import train_tiny
args = train_tiny.parse_args(["--output-dir", sys.argv[1]])
trainer = Trainer(model=train_tiny.build_model(args),
                  args=TrainingArguments(output_dir=sys.argv[1], use_cpu=True, report_to="none"))
print("ready", flush=True)
time.sleep(60)
"""


def test_sigterm_outside_train_behaves_as_without_shim(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """With a Trainer built but not training, SIGTERM keeps its default action (death)."""
    script = tmp_path / "outside.py"
    script.write_text(OUTSIDE_TRAIN_SCRIPT)
    proc = spawn([PYTHON, str(script), str(tmp_path / "out")], shim_env.env)
    proc.wait_for("ready", timeout=90)
    proc.signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert checkpoint_steps(shim_env.checkpoints) == []


def user_handler_script(body: str) -> str:
    """A training script that installs its own SIGTERM handler (``body``) first."""
    return (
        "import signal, sys, threading\n"
        "def handler(signum, frame):\n"
        + textwrap.indent(textwrap.dedent(body).lstrip("\n"), "    ")
        + "signal.signal(signal.SIGTERM, handler)\n"
        "from local.demo import train_tiny\n"
        "sys.exit(train_tiny.main())\n"
    )


def preempt_with_user_handler(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path, handler_body: str
) -> Proc:
    """Train with the program's own SIGTERM handler; SIGTERM after step 2."""
    script = tmp_path / "handler.py"
    script.write_text(user_handler_script(handler_body))
    run = spawn(
        [PYTHON, str(script), "--output-dir", str(tmp_path / "out"), "--step-sleep", "0.3"],
        shim_env.env,
    )
    run.wait_for("rank 0 step 2/", timeout=90)
    run.signal(signal.SIGTERM)
    return run


@pytest.mark.slow
def test_user_sigterm_handler_runs_after_the_jit_save(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    body = """
        print("user handler ran", flush=True)
        sys.exit(5)
    """
    run = preempt_with_user_handler(shim_env, spawn, tmp_path, body)
    assert run.wait() == 143
    output = run.output()
    assert output.index("JIT checkpoint-") < output.index("user handler ran")
    assert len(checkpoint_steps(shim_env.checkpoints)) == 1


def test_transformers_without_the_hooked_attributes(shim_env: ShimEnv, tmp_path: Path) -> None:
    """An unknown transformers: no integration, one message, the program runs unchanged."""
    fake = tmp_path / "site" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '0.0-unknown'\n")
    (fake / "trainer.py").write_text("class Trainer:\n    pass\n")
    env = {**shim_env.env, "PYTHONPATH": shim_env.env["PYTHONPATH"] + ":" + str(fake.parent)}
    done = subprocess.run(
        [PYTHON, "-c", "import transformers.trainer as t; t.Trainer(); print('trained')"],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "trained"
    lines = jit_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert "transformers 0.0-unknown lacks" in lines[0] and "Trainer.train" in lines[0]


def test_jit_off_leaves_sigterm_alone(shim_env: ShimEnv, spawn: Spawn, tmp_path: Path) -> None:
    """``jitckpt.io/jit: "false"``: no handler, SIGTERM kills the run as it would unshimmed."""
    run = spawn(
        [PYTHON, *TRAIN_TINY, "--output-dir", str(tmp_path / "out"), "--step-sleep", "0.3"],
        {**shim_env.env, "JITCKPT_JIT": "false"},
    )
    run.wait_for("rank 0 step 2/", timeout=90)
    run.signal(signal.SIGTERM)
    assert run.wait() == -signal.SIGTERM
    assert checkpoint_steps(shim_env.checkpoints) == []


@pytest.mark.slow
def test_a_hang_after_the_jit_save_does_not_hold_the_node(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """The program's own SIGTERM handler never returns: the process still leaves with 143,
    at the exit deadline, and says where it was stuck."""
    body = """
        print("user handler waits forever", flush=True)
        threading.Event().wait()
    """
    run = preempt_with_user_handler(shim_env, spawn, tmp_path, body)
    run.wait_for("user handler waits forever", timeout=60)
    waiting = time.monotonic()
    assert run.wait(timeout=60) == 143
    waited = time.monotonic() - waiting
    output = run.output()
    assert "still here" in output
    assert 'handler.py", line 4 in handler' in output  # the stack dump names where it hangs
    assert len(checkpoint_steps(shim_env.checkpoints)) == 1
    assert waited > 5  # it did wait in the handler: the exit came from the deadline


HIDDEN_BUFFER_SCRIPT = """
import collections, sys
from transformers import Trainer
from local.demo import train_tiny

class RecentLossTrainer(Trainer):
    '''Keeps the last losses in a buffer of its own (a schedule of its own would read it).'''

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._recent = collections.deque(maxlen=3)

    def training_step(self, model, inputs, *args, **kwargs):
        loss = super().training_step(model, inputs, *args, **kwargs)
        self._recent.append(float(loss))
        return loss

sys.exit(train_tiny.main(trainer_class=RecentLossTrainer))
"""
HIDDEN_WARNING = (
    "RecentLossTrainer keeps state across steps that {why} (_recent): a resume may not "
    "continue as an uninterrupted run would"
)


@pytest.mark.slow
def test_a_subclass_with_a_hidden_buffer_is_named_at_the_save_and_at_the_resume(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """The shim cannot know what ``_recent`` does: it says, once, that a resume may differ."""
    script = tmp_path / "recent_loss.py"
    script.write_text(HIDDEN_BUFFER_SCRIPT)
    common = [str(script), "--output-dir", str(tmp_path / "out"), "--max-steps", "8"]
    cut = spawn([PYTHON, *common, "--step-sleep", "0.4"], shim_env.env)
    cut.wait_for("rank 0 step 3/")
    cut.signal(signal.SIGTERM)
    assert cut.wait() == 143
    warning = HIDDEN_WARNING.format(why="its checkpoints do not hold")
    assert cut.output().count(warning) == 1, cut.output()[-3000:]
    [step] = checkpoint_steps(shim_env.checkpoints)
    assert (shim_env.checkpoints / f"checkpoint-{step}" / "jitckpt_trainer_0.pth").is_file()

    resumed = spawn([PYTHON, *common], shim_env.env)
    assert resumed.wait() == 0, resumed.output()
    output = resumed.output()
    assert f"resuming from {shim_env.checkpoints}/checkpoint-{step}" in output
    assert output.count(HIDDEN_WARNING.format(why="the checkpoint did not hold")) == 1, output
    assert "own state is back" not in output  # nothing of it was known, nothing put back
