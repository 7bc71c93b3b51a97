"""The in-place restart is a new trainer process, never a process that opened another
connection; and a JIT checkpoint always beats a restore the sidecar started on its own
(DESIGN 7, ``sidecar/trainers.py``).

The real agent and S3 server; the trainer side is the shim's own session, lease,
stream and staging where a test stands for a real training process, and forged
``hello`` lines where it stands for processes that are not this one (a restarted
container's).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim import lease, protocol
from shim.channel import Client
from shim.config import ShimConfig
from shim.session import ProcessSession
from shim.staging import stage
from shim.streaming import Stream
from tests.sidecar import shimtalk
from tests.sidecar.agentproc import AgentProcess
from tests.sidecar.helpers import make_checkpoint
from tests.support.faultproxy import FaultProxy

MODEL = {"model.bin": 64 * 1024, "trainer_state.json": 40}
# What DeepSpeed ZeRO-3's save under HF writes twice.
STATES = "global_step8/zero_pp_rank_0_mp_rank_00_model_states.pt"
OPTIM = "global_step8/zero_pp_rank_0_mp_rank_00_optim_states.pt"


@pytest.fixture
def session(agent: AgentProcess, monkeypatch: pytest.MonkeyPatch) -> Iterator[ProcessSession]:
    """This test process as a training process: its lease and its session (the shim's)."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the session chains to it
    held: list[Client] = []
    monkeypatch.setattr(lease, "_HELD", held)
    lease.take(str(agent.socket))
    assert held, "no lease taken"
    config = ShimConfig(local_dir=str(agent.local_dir), socket_path=str(agent.socket))
    yield ProcessSession(config)
    for client in held:
        client.close()


def _read_up_to_here(agent: AgentProcess) -> None:
    """Once a request on a new connection is answered, the agent has read the ends of the
    connections closed before it (their EOFs were ready when the new one was accepted)."""
    probe = Client(str(agent.socket))
    assert isinstance(probe.call(protocol.Status()), protocol.StatusAnswer)
    probe.close()


def test_a_jit_checkpoint_handed_over_whole_on_a_new_connection_is_committed(
    agent: AgentProcess, session: ProcessSession, tmp_path: Path
) -> None:
    """DeepSpeed ZeRO-3's JIT save under HF as it was first seen (issue 47). The trainer
    committed periodic checkpoint-5 and streams JIT checkpoint-8; a save writes its model
    states again, here with other bytes, so the shim stops streaming (its connection is
    reset: the sidecar drops what it held) and hands the checkpoint over whole on a new
    connection, saying its ``hello`` there first. That ``hello`` is the same process,
    which still holds its lease: no restore begins, and the JIT checkpoint is taken and
    committed."""
    session.hello("transformers")
    restored = agent.status()["restored"]
    out = tmp_path / "out"
    periodic = make_checkpoint(out, 5, MODEL)
    assert session.link.stage(stage(str(periodic), str(agent.staging), 5, "periodic"))
    agent.wait_for(lambda: agent.committed_step() == 5, 60, "checkpoint-5 committed")

    jit = out / "checkpoint-8"
    states = jit / STATES
    states.parent.mkdir(parents=True)
    states.write_bytes(os.urandom(4096))
    stream = Stream(session.link, str(jit), str(agent.staging), 8, "jit")
    stream.written(str(states))
    optim = jit / OPTIM
    stream.writing(str(optim))  # the save moves on: the model states are handed over
    optim.write_bytes(os.urandom(4096))
    stream.written(str(optim))
    assert stream.handed == [STATES] and not stream.broken
    stream.writing(str(states))  # the same file again, with other bytes
    states.write_bytes(os.urandom(4096))
    stream.written(str(states))
    assert stream.broken
    agent.wait_for(
        lambda: any(row["step"] == 8 for row in agent.status()["superseded"]),
        30,
        "the streamed part of checkpoint-8 dropped",
    )

    (jit / "trainer_state.json").write_text('{"global_step": 8}')
    whole = stage(str(jit), str(agent.staging), 8, "jit", shim_loads=True)
    assert session.link.stage(whole) is not None, agent.log()
    agent.wait_for(lambda: agent.committed_step() == 8, 60, "the JIT checkpoint committed")
    status = agent.status()
    assert status["restoring"] is None and status["restored"] == restored, status
    session.bye(143)
    assert agent.terminate() == 0


def test_a_jit_checkpoint_during_a_restore_for_a_restarted_trainer_is_taken(
    agent: AgentProcess, proxy: FaultProxy, tmp_path: Path
) -> None:
    """The trainer staged periodic checkpoint-5 (its upload slowed here) and exited; a new
    process says ``hello``: a restart, so the sidecar restores again once checkpoint-5 is
    committed. That trainer is stopped before then and hands over JIT checkpoint-6: taken,
    the restore abandoned, checkpoint-6 committed; the process waiting on the restore
    hears what was restored before it."""
    first = Client(str(agent.socket), timeout=30)
    answer = first.call(shimtalk.hello(os.getpid()))
    assert isinstance(answer, protocol.HelloAnswer), answer
    restored = answer.restored
    proxy.delay(8, times=1, method="PUT", path="checkpoint-5/model.bin")
    periodic = make_checkpoint(tmp_path, 5, MODEL)
    staged = first.call(stage(str(periodic), str(agent.staging), 5, "periodic"))
    assert isinstance(staged, protocol.StagedAnswer), staged
    assert first.call(protocol.Bye(exit_code=1)) == protocol.OkAnswer()
    first.close()

    again = Client(str(agent.socket), timeout=30)
    hello = again.call(shimtalk.hello(os.getpid() + 1))
    assert isinstance(hello, protocol.HelloAnswer) and hello.pending is not None, hello
    jit = make_checkpoint(tmp_path, 6, MODEL)
    taken = again.call(stage(str(jit), str(agent.staging), 6, "jit", shim_loads=True))
    assert isinstance(taken, protocol.StagedAnswer), taken
    assert again.call(protocol.AwaitRestore(seconds=30)) == protocol.HelloAnswer(restored=restored)
    agent.wait_for(lambda: agent.committed_step() == 6, 60, "the JIT checkpoint committed")
    assert agent.status()["restoring"] is None
    assert "the restore is abandoned, the checkpoint taken" in agent.log()
    again.call(protocol.Bye(exit_code=143))
    again.close()
    assert agent.terminate() == 0


def test_a_restarted_trainer_with_the_old_ones_pid_is_a_restart(
    agent: AgentProcess, tmp_path: Path
) -> None:
    """A trainer container restarted without a shared PID namespace numbers its processes
    afresh: the new trainer has the old one's pid and another start time. It is a new
    trainer all the same (its lease came first), and the sidecar restores again."""
    pid = os.getpid()
    old_lease = Client(str(agent.socket))
    old_lease.send(protocol.Lease(pid=pid, started=1000))
    first = Client(str(agent.socket), timeout=30)
    hello = protocol.Hello(
        pid=pid,
        rank=0,
        local_rank=0,
        world_size=1,
        node_rank=0,
        nnodes=1,
        framework="transformers",
        started=1000,
    )
    assert isinstance(first.call(hello), protocol.HelloAnswer)
    periodic = make_checkpoint(tmp_path, 5, MODEL)
    staged = first.call(stage(str(periodic), str(agent.staging), 5, "periodic"))
    assert isinstance(staged, protocol.StagedAnswer), staged
    agent.wait_for(lambda: agent.committed_step() == 5, 60, "checkpoint-5 committed")
    first.close()  # the container exits: the kernel closes all it held
    old_lease.close()
    _read_up_to_here(agent)

    new_lease = Client(str(agent.socket))
    new_lease.send(protocol.Lease(pid=pid, started=2000))
    again = Client(str(agent.socket), timeout=30)
    answer = again.call(dataclasses.replace(hello, started=2000))
    assert isinstance(answer, protocol.HelloAnswer), answer
    if answer.pending is not None:
        answer = again.call(protocol.AwaitRestore(seconds=30))
    assert isinstance(answer, protocol.HelloAnswer) and answer.restored is not None, answer
    assert answer.restored.step == 5
    assert f"a new trainer process (pid {pid}) started in this pod" in agent.log()
    again.close()
    new_lease.close()
    assert agent.terminate() == 0
