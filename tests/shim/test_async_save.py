"""Periodic HF saves written behind the training loop: the same files, a correct JIT stop,
the snapshot released, and no checkpoint staged from a writer that did not finish.

A slow disk is made with a FIFO planted where HF will write a checkpoint's
``trainer_state.json`` (the last file it writes, through Python's ``open``, which
lets other threads run while it waits): the background writer blocks in
``open`` until the test reads it, so "a save in flight" lasts exactly as long
as the test needs.
"""

from __future__ import annotations

import gc
import io
import os
import re
import signal
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from shim import asyncsave, devicetags, writerproc
from shim.layout import ENV_DEMO_HOLD_AT_STEP
from tests.shim.support import (
    PYTHON,
    TORCHRUN,
    TRAIN_TINY,
    Proc,
    ShimEnv,
    Spawn,
    assert_attached_once,
    checkpoint_steps,
)
from tests.shim.test_trainer import assert_same_weights
from tests.shim.test_with_agent import uploaded
from tests.sidecar.agentproc import AgentProcess

# Every background save by the writer process, the first one included (it waits for the
# process to start; by default the thread writes until it has).
BY_PROCESS = {writerproc.ENV_WRITER: writerproc.PROCESS}
HF_FILES = {
    "config.json",
    "generation_config.json",
    "jitckpt_books_0.pth",  # the shim's record of the loss since the last log, and the time
    "jitckpt_data_0.pth",  # the shim's record of where the train DataLoader stood
    "model.safetensors",
    "optimizer.pt",
    "rng_state.pth",
    "scheduler.pt",
    "trainer_state.json",
    "training_args.bin",
}


def _drain_fifo(path: Path, into: list[bytes] | None = None) -> threading.Thread:
    """Open ``path`` for reading (unblocking its writer) and read it to the end, in a thread."""

    def read() -> None:
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                if into is not None:
                    into.append(chunk)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def writer_pid(output: str) -> int:
    """The pid of the writer process the shim said it started (the first one)."""
    match = re.search(r"written by the writer process (\d+)", output)
    assert match, output[-3000:]
    return int(match.group(1))


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """Whether process ``pid`` ended (or is a zombie) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def _assert_not_a_trainer(pid: int, shim_env: ShimEnv) -> None:
    """The writer process runs without the shim: no pid file for the preStop hook, no
    ``JITCKPT_DIR`` (sitecustomize stays inactive), none of the trainer's descriptors."""
    assert not (shim_env.pids / f"{pid}.pid").exists()
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert not [entry for entry in environ if entry.startswith(b"JITCKPT_DIR=")]
    sockets = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    assert len([s for s in sockets if s.startswith("socket:")]) == 1, sockets  # its own


def _plant_fifo(checkpoints: Path, step: int, name: str = "trainer_state.json") -> Path:
    directory = checkpoints / f"checkpoint-{step}"
    directory.mkdir(parents=True)
    fifo = directory / name
    os.mkfifo(fifo)
    return fifo


def test_background_save_writes_what_hf_writes_and_resumes_bitwise(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    out = tmp_path / "out"  # the same output_dir for every run: training_args.bin names it
    common = [*TRAIN_TINY, "--output-dir", str(out), "--max-steps", "9", "--save-steps", "3"]
    sync_env = ShimEnv(tmp_path / "sync")
    sync = spawn(
        [PYTHON, *common, "--final-weights", str(tmp_path / "sync.pt")],
        {**sync_env.env, asyncsave.ENV_ASYNC_SAVE: "false"},
    )
    assert sync.wait() == 0, sync.output()
    assert "periodic checkpoints are saved synchronously: JITCKPT_ASYNC_SAVE is false" in (
        sync.output()
    )
    background = spawn(
        [PYTHON, *common, "--final-weights", str(tmp_path / "async.pt")],
        {**shim_env.env, **BY_PROCESS},
    )
    assert background.wait() == 0, background.output()
    output = background.output()
    assert_attached_once(output, "HF Trainer (transformers ", shim_env.checkpoints)
    assert "periodic checkpoints are written behind the training loop" in output
    for step in (3, 6, 9):
        assert f"checkpoint-{step} written behind the training loop" in output
    # The weights and the optimizer state were serialized by the writer process, which
    # ended with its trainer.
    assert output.count("s write by the writer process)") == 3, output
    assert _gone(writer_pid(output))
    assert checkpoint_steps(shim_env.checkpoints) == [3, 6, 9]
    # Byte for byte what HF's synchronous save wrote, file by file.
    for step in (3, 6, 9):
        mine = shim_env.checkpoints / f"checkpoint-{step}"
        theirs = sync_env.checkpoints / f"checkpoint-{step}"
        assert {p.name for p in mine.iterdir()} == HF_FILES
        for name in HF_FILES - {"jitckpt_books_0.pth"}:  # the run's training time: its own
            assert (mine / name).read_bytes() == (theirs / name).read_bytes(), (step, name)
    assert_same_weights(tmp_path / "async.pt", tmp_path / "sync.pt")

    # Plain HF (no shim) resumes from the checkpoint written in the background: the same
    # weights as the run that was never interrupted.
    resumed = spawn(
        [
            PYTHON,
            *common,
            "--resume",
            str(shim_env.checkpoints / "checkpoint-6"),
            "--final-weights",
            str(tmp_path / "resumed.pt"),
        ],
        shim_env.without_shim(),
    )
    assert resumed.wait() == 0, resumed.output()
    assert_same_weights(tmp_path / "resumed.pt", tmp_path / "sync.pt")


@pytest.mark.slow
def test_jit_stop_during_a_background_save_commits_a_correct_jit_checkpoint(
    shim_env: ShimEnv, agent: AgentProcess, local_s3: object, spawn: Spawn, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    common = [*TRAIN_TINY, "--output-dir", str(out), "--max-steps", "12"]
    reference = spawn(
        [PYTHON, *common, "--final-weights", str(tmp_path / "reference.pt")],
        shim_env.without_shim(),
    )
    fifo = _plant_fifo(shim_env.checkpoints, 4)
    cut = spawn([PYTHON, *common, "--save-steps", "4", "--step-sleep", "0.3"], shim_env.env)
    # checkpoint-4's writer is stuck on the slow disk while training goes on.
    cut.wait_for("rank 0 step 5/", timeout=120)
    cut.signal(signal.SIGTERM)
    cut.wait_for("for a JIT checkpoint", timeout=60)
    reader = _drain_fifo(fifo)
    assert cut.wait() == 143, cut.output()
    reader.join(30)
    output = cut.output()
    jit_step = int(output.split("stopping at step ")[1].split(" ")[0])
    assert jit_step in (5, 6)
    assert "checkpoint-4 was being written when the JIT save began: dropped" in output
    assert "periodic checkpoint-4 handed to the sidecar" not in output
    assert f"jit checkpoint-{jit_step} handed to the sidecar" in output
    # The partial checkpoint-4 is gone; the JIT one is complete, committed, alone in the store.
    assert checkpoint_steps(shim_env.checkpoints) == [jit_step]
    agent.wait_for(lambda: agent.committed_step() == jit_step, 60, "the JIT commit")
    assert set(uploaded(local_s3, agent.destination)) == {jit_step}  # type: ignore[arg-type]
    assert reference.wait() == 0, reference.output()

    # The next run resumes from the JIT checkpoint and ends where the uninterrupted one did.
    resumed = spawn(
        [PYTHON, *common, "--final-weights", str(tmp_path / "resumed.pt")], shim_env.env
    )
    assert resumed.wait() == 0, resumed.output()
    assert f"resuming from {shim_env.checkpoints}/checkpoint-{jit_step}" in resumed.output()
    assert_same_weights(tmp_path / "resumed.pt", tmp_path / "reference.pt")


@pytest.mark.slow
def test_a_checkpoint_written_while_the_loop_holds_is_staged_before_the_stop(
    shim_env: ShimEnv, agent: AgentProcess, local_s3: object, spawn: Spawn, tmp_path: Path
) -> None:
    """HF saves checkpoint-4 after step 4's end and step 5's end holds: no step end comes to
    stage it, so the hold does, once its writer is done, while no SIGTERM has come."""
    out = tmp_path / "out"
    common = [*TRAIN_TINY, "--output-dir", str(out), "--max-steps", "12", "--save-steps", "4"]
    run = spawn([PYTHON, *common], {**shim_env.env, ENV_DEMO_HOLD_AT_STEP: "5"})
    assert_staged_while_held_at_5(run, agent, local_s3)


def assert_staged_while_held_at_5(run: Proc, agent: AgentProcess, local_s3: object) -> None:
    """``run`` saved checkpoint-4 behind the loop and holds at step 5: the checkpoint is
    handed over and committed during the hold, before any SIGTERM; the JIT-5 one follows."""
    run.wait_for("holding at step 5 until", timeout=120)
    run.wait_for("periodic checkpoint-4 handed to the sidecar", timeout=30)
    agent.wait_for(lambda: agent.committed_step() == 4, 60, "checkpoint-4 committed")
    output = run.output()
    assert "written behind the training loop" in output
    assert output.index("holding at step 5") < output.index("checkpoint-4 handed")
    assert "stopping at step" not in output  # still holding: no SIGTERM yet
    run.signal(signal.SIGTERM)
    assert run.wait(timeout=300) == 143, run.output()
    assert "jit checkpoint-5 handed to the sidecar" in run.output()
    agent.wait_for(lambda: agent.committed_step() == 5, 60, "the JIT commit")
    assert set(uploaded(local_s3, agent.destination)) == {4, 5}  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_writer_killed_mid_write_stages_nothing_and_is_never_resumed(
    shim_env: ShimEnv, agent: AgentProcess, local_s3: object, spawn: Spawn, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    common = [*TRAIN_TINY, "--output-dir", str(out), "--max-steps", "12", "--save-steps", "4"]
    fifo = _plant_fifo(shim_env.checkpoints, 8)
    run = spawn([PYTHON, *common, "--step-sleep", "0.3"], {**shim_env.env, **BY_PROCESS})
    run.wait_for("periodic checkpoint-4 handed to the sidecar", timeout=120)
    run.wait_for("rank 0 step 9/", timeout=120)  # checkpoint-8's writer is stuck in open()
    writer = writer_pid(run.output())
    _assert_not_a_trainer(writer, shim_env)
    assert (shim_env.pids / f"{run.pid}.pid").exists()
    run.signal(signal.SIGKILL)
    run.wait()
    assert _gone(writer)  # the writer process does not outlive its trainer
    output = run.output()
    assert "checkpoint-8" not in "".join(
        line for line in output.splitlines() if "handed to the sidecar" in line
    )
    # The writer was killed before trainer_state.json (HF's completion mark, written last).
    assert (shim_env.checkpoints / "checkpoint-8" / "model.safetensors").is_file()
    assert not (shim_env.checkpoints / "checkpoint-8" / "trainer_state.json").is_file()
    agent.wait_for(lambda: agent.committed_step() == 4, 60, "checkpoint-4 committed")
    assert "accepted checkpoint-8" not in agent.log()
    assert set(uploaded(local_s3, agent.destination)) == {4}  # type: ignore[arg-type]
    fifo.unlink()

    # The container restarts in the same pod: it resumes from checkpoint-4, never the torn 8.
    again = spawn([PYTHON, *common, "--final-weights", str(tmp_path / "again.pt")], shim_env.env)
    assert again.wait() == 0, again.output()
    assert f"resuming from {shim_env.checkpoints}/checkpoint-4" in again.output()


@pytest.mark.slow
def test_a_killed_writer_process_stages_nothing_and_the_next_save_is_written(
    shim_env: ShimEnv, agent: AgentProcess, local_s3: object, spawn: Spawn, tmp_path: Path
) -> None:
    """The writer process is killed while it writes checkpoint-8's weights (stuck opening
    them on the slow disk): 8 is dropped, never staged; a new writer process writes 12."""
    out = tmp_path / "out"
    common = [*TRAIN_TINY, "--output-dir", str(out), "--max-steps", "12", "--save-steps", "4"]
    fifo = _plant_fifo(shim_env.checkpoints, 8, "model.safetensors")
    run = spawn([PYTHON, *common, "--step-sleep", "0.3"], {**shim_env.env, **BY_PROCESS})
    run.wait_for("periodic checkpoint-4 handed to the sidecar", timeout=120)
    writer = writer_pid(run.output())
    run.wait_for("rank 0 step 9/", timeout=120)
    assert fifo.exists() and not _gone(writer, 0)
    os.kill(writer, signal.SIGKILL)
    assert run.wait(timeout=300) == 0, run.output()
    output = run.output()
    assert "writing checkpoint-8 in the background failed (WriterDied" in output
    assert "checkpoint-8 was not written on every rank: not staged" in output
    assert "periodic checkpoint-8 handed" not in output
    assert "periodic checkpoint-12 handed to the sidecar" in output
    assert re.search(r"checkpoint-12 written .* by the writer process\)", output)
    assert output.count("are serialized and written by the writer process") == 2  # restarted
    assert 8 not in checkpoint_steps(shim_env.checkpoints)
    agent.wait_for(lambda: agent.committed_step() == 12, 60, "checkpoint-12 committed")
    assert "accepted checkpoint-8" not in agent.log()
    assert set(uploaded(local_s3, agent.destination)) == {4, 12}  # type: ignore[arg-type]


class Disk:
    """A framework's tensor writer, as the integration names it (``saves.intercept``)."""

    @staticmethod
    def write(tensors: dict[str, torch.Tensor], path: Path) -> None:
        with open(path, "wb") as handle:  # Python's open: other threads run while it waits
            torch.save(tensors, handle)


def test_the_snapshot_is_released_once_written(tmp_path: Path) -> None:
    """In process: while the write is held by the slow disk the copy is held and counted;
    once written, nothing refers to it and the count is zero."""
    saves = asyncsave.BackgroundSaves("test")
    saves.intercept(Disk, "write")
    directory = tmp_path / "checkpoint-1"
    fifo = _plant_fifo(tmp_path, 1, "weights.pt")
    live = {"weight": torch.arange(1 << 18, dtype=torch.float32)}
    live["view"] = live["weight"][10:20]  # a view of the same storage: one copy, one storage

    saves.save(str(directory), 1, lambda: Disk.write(live, fifo))
    assert saves.pending(1)
    assert saves.held_bytes == live["weight"].untyped_storage().nbytes()
    job = saves._job
    assert job is not None
    _, args, _, snapshot = job.calls[0]
    assert snapshot is not None and len(snapshot.copies) == 1  # the view is in the same copy
    copied = snapshot.rebuild(args)[0]
    assert (
        copied["view"].untyped_storage().data_ptr() == copied["weight"].untyped_storage().data_ptr()
    )
    assert (
        copied["weight"].untyped_storage().data_ptr() != live["weight"].untyped_storage().data_ptr()
    )
    live["weight"].add_(1.0)  # training goes on: the copy keeps the saved values
    reference = [weakref.ref(storage) for storage in snapshot.copies.values()]
    del copied, args, job, snapshot
    written: list[bytes] = []
    reader = _drain_fifo(fifo, written)
    saves.wait()
    reader.join(30)
    saved = torch.load(io.BytesIO(b"".join(written)), weights_only=True)
    assert torch.equal(saved["weight"], torch.arange(1 << 18, dtype=torch.float32))
    gc.collect()
    assert saves.held_bytes == 0
    assert [ref() for ref in reference] == [None]
    staged: list[tuple[str, int]] = []
    saves.agree_and_stage(lambda path, step: staged.append((path, step)), block=True)
    assert staged == [(str(directory), 1)]


def test_the_writer_thread_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer process is opt-in: it did not stall the loop less than the thread in
    bench/stall.py (two cores, and an H100)."""
    monkeypatch.delenv(writerproc.ENV_WRITER, raising=False)
    assert writerproc.mode() == writerproc.THREAD and writerproc.shared() is None
    monkeypatch.setenv(writerproc.ENV_WRITER, "auto")
    assert writerproc.mode() == writerproc.AUTO and writerproc.shared() is not None


def _mapped_snapshots(pid: int) -> int:
    return Path(f"/proc/{pid}/maps").read_text().count("memfd:jitckpt-snapshot")


def test_the_writer_process_writes_torch_save_bytes_and_unmaps_the_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process: ``torch.save`` deferred to the writer process writes the bytes it writes
    here; while the write is held by the slow disk the snapshot is mapped on both sides,
    once written on neither."""
    monkeypatch.setenv(writerproc.ENV_WRITER, writerproc.PROCESS)
    saves = asyncsave.BackgroundSaves("test")
    saves.intercept(torch, "save")
    weight = torch.arange(1 << 18, dtype=torch.float32)
    live = {"weight": weight, "view": weight[10:20], "step": 1}
    fifo = _plant_fifo(tmp_path, 1, "weights.pt")
    saves.save(str(tmp_path / "checkpoint-1"), 1, lambda: torch.save(live, fifo))
    job = saves._job
    assert job is not None and job.by_process
    expected = io.BytesIO()
    torch.save(live, expected)  # a buffer: written at once, here
    weight.add_(1.0)  # training goes on: the snapshot keeps the saved values
    [writer] = writerproc._SHARED
    assert writer.pid is not None
    deadline = time.monotonic() + 120
    while _mapped_snapshots(writer.pid) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # the writer starts (imports torch), then maps the snapshot
    assert _mapped_snapshots(os.getpid()) == 1 and _mapped_snapshots(writer.pid) == 1
    written: list[bytes] = []
    reader = _drain_fifo(fifo, written)
    saves.wait()
    reader.join(30)
    del job
    gc.collect()
    # The same archive (its name inside is the file's stem, as torch.save writes it).
    assert b"".join(written).replace(b"weights/", b"archive/") == expected.getvalue()
    assert _mapped_snapshots(os.getpid()) == 0 and _mapped_snapshots(writer.pid) == 0
    assert saves.held_bytes == 0


def test_the_writer_process_records_the_gpu_a_copy_came_from(tmp_path: Path) -> None:
    """A copy of a GPU storage is saved by the writer process as on that GPU: the bytes
    the training process writes for the same copies tagged with their device (as its
    writer thread writes them, and as ``torch.save`` of the GPU tensors writes them)."""
    first, second = torch.arange(4096, dtype=torch.float32), torch.ones(64, dtype=torch.int64)
    live = {"first": first, "view": first[8:16], "second": second, "step": 3}
    tagged = [first.untyped_storage(), second.untyped_storage()]
    for storage in tagged:
        devicetags.register(storage, torch.device("cuda", 0))
    try:
        expected = io.BytesIO()
        torch.save(live, expected)
    finally:
        for storage in tagged:
            devicetags.forget(storage)
    # Once per tensor (the view too), each a string of its own, as torch's own tagger gives.
    assert expected.getvalue().count(b"cuda:0") == 3

    writer = writerproc.WriterProcess()
    assert writer.ensure_started()
    storages = {asyncsave.storage_key(t): t.untyped_storage() for t in (first, second)}
    arena = writerproc.Arena(sum(writerproc.aligned(s.nbytes()) for s in storages.values()))
    try:
        offsets = {key: writerproc.copy_into(arena, s)[0] for key, s in storages.items()}
        devices = {asyncsave.storage_key(first): "cuda:0", asyncsave.storage_key(second): "cuda:0"}
        target = tmp_path / "archive.pt"
        data = writerproc.payload((live, target), {}, offsets, devices, asyncsave.storage_key)
        writer.call(torch.save, data, arena, threading.Event())
        assert target.read_bytes() == expected.getvalue()
        # The writer forgets the tags once written: the next call's CPU copies say cpu.
        del devices[asyncsave.storage_key(second)]
        data = writerproc.payload((live, target), {}, offsets, devices, asyncsave.storage_key)
        writer.call(torch.save, data, arena, threading.Event())
        assert target.read_bytes().count(b"cuda:0") == 2
    finally:
        arena.close()
        writer._drop()
    assert devicetags.registered() == 0


class ScriptPath(os.PathLike):  # type: ignore[type-arg]
    """A path class of the user's script (``__main__``), which only the trainer can import."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __fspath__(self) -> str:
        return self.path


def test_a_call_the_writer_process_cannot_make_is_written_by_the_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A call whose arguments the writer process cannot rebuild (here a path of a class
    of the user's script; any error it answers) is made by the training process's writer
    thread from the same snapshot: the same bytes, said once, the checkpoint staged."""
    monkeypatch.setenv(writerproc.ENV_WRITER, writerproc.PROCESS)
    monkeypatch.setattr(ScriptPath, "__module__", "__main__")
    monkeypatch.setattr(sys.modules["__main__"], "ScriptPath", ScriptPath, raising=False)
    saves = asyncsave.BackgroundSaves("test")
    saves.intercept(torch, "save")
    live = {"weight": torch.arange(1 << 18, dtype=torch.float32), "step": 7}
    expected = io.BytesIO()
    torch.save(live, expected)
    for step in (1, 2):
        directory = tmp_path / f"checkpoint-{step}"
        directory.mkdir()
        target = ScriptPath(directory / "archive.pt")
        saves.save(str(directory), step, lambda: torch.save(live, target))  # noqa: B023
        job = saves._job
        assert job is not None and job.by_process
        del job
        saves.wait()
        written = (directory / "archive.pt").read_bytes()
        assert written == expected.getvalue()
    said = capfd.readouterr().err
    assert said.count("could not make a torch.serialization.save call") == 1, said
    written = [line for line in said.splitlines() if "written behind the training loop" in line]
    assert len(written) == 2, said
    assert all(
        line.endswith("by the writer process, 1 call by the writer thread)") for line in written
    )
    staged: list[tuple[str, int]] = []
    saves.agree_and_stage(lambda path, step: staged.append((path, step)), block=True)
    assert staged == [(str(tmp_path / "checkpoint-2"), 2)]


def test_parameters_are_copied_before_the_next_optimizer_step_changes_them(
    tmp_path: Path,
) -> None:
    """What only an optimizer step changes is copied by the writer during the next forward
    and backward passes, not at the boundary; the next step waits for that copy."""
    saves = asyncsave.BackgroundSaves("test")
    saves.intercept(Disk, "write")
    parameter = torch.nn.Parameter(torch.zeros(16 << 20))  # 64 MB: a copy takes a while
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    fifo = _plant_fifo(tmp_path, 2, "weights.pt")
    stable = {asyncsave.storage_key(parameter)}

    saves.save(
        str(tmp_path / "checkpoint-2"),
        2,
        lambda: Disk.write({"w": parameter.detach()}, fifo),
        stable,
    )
    job = saves._job
    assert job is not None
    [(_, _, _, snapshot)] = job.calls
    assert snapshot is not None and snapshot.copies == {}  # nothing copied at the boundary
    assert saves.held_bytes == parameter.numel() * 4  # but counted
    parameter.grad = torch.ones_like(parameter)
    optimizer.step()  # the global pre-hook waits for the writer's copy
    assert job.copied.is_set()
    assert torch.equal(parameter.detach()[:3], -torch.ones(3))
    written: list[bytes] = []
    reader = _drain_fifo(fifo, written)
    saves.wait()
    reader.join(30)
    saved = torch.load(io.BytesIO(b"".join(written)), weights_only=True)
    assert torch.count_nonzero(saved["w"]) == 0  # the values of the save's moment


@pytest.mark.slow
def test_two_ranks_write_in_the_background_and_stage_each_checkpoint_once_written(
    shim_env: ShimEnv, agent: AgentProcess, local_s3: object, spawn: Spawn, tmp_path: Path
) -> None:
    """torchrun, 2 ranks: rank 0 defers the weights and optimizer, rank 1 writes only its
    small RNG file at once; both take part in the agreement, and each checkpoint is staged
    once, whole, by local rank 0."""
    run = spawn(
        [
            TORCHRUN,
            "--nproc-per-node",
            "2",
            *TRAIN_TINY,
            "--output-dir",
            str(tmp_path / "out"),
            "--max-steps",
            "9",
            "--save-steps",
            "3",
        ],
        shim_env.env,
    )
    assert run.wait(timeout=300) == 0, run.output()
    output = run.output()
    assert output.count("train() returned at step 9") == 2
    for step in (3, 6, 9):
        assert output.count(f"periodic checkpoint-{step} handed to the sidecar") == 1
    agent.wait_for(lambda: agent.status()["queue"] == [], 60, "the uploads")
    objects = uploaded(local_s3, agent.destination)  # type: ignore[arg-type]
    # Each checkpoint is uploaded whole, or (a slow upload on a loaded machine) dropped once
    # a newer one is committed, as the sidecar's backlog rule says, and /status says so;
    # the newest is always uploaded.
    dropped = {entry["step"] for entry in agent.status()["superseded"]}
    assert 9 in objects and 9 not in dropped, (objects, dropped)
    for step in (3, 6, 9):
        if step in dropped:
            continue  # partly uploaded, maybe: never committed (the backlog rule's tests)
        assert {"model.safetensors", "optimizer.pt", "rng_state_0.pth", "rng_state_1.pth"} <= (
            objects[step]
        ), (step, objects.get(step))
