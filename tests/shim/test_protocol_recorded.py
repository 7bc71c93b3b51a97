"""Every line the shim and the agent really send each other parses through the one schema.

A tiny HF Trainer run with the shim active talks to the real agent through a
recording Unix socket in between; it saves periodically, gets SIGTERM, saves a
JIT checkpoint (streamed file by file while it is written) and exits 143, so
the shim sends every op it has (``hello``, ``progress``, ``staging``,
``staged``, ``sigterm``, ``bye``, ``lease``). Each request line
must parse with ``protocol.decode_request``, and each answer line of the agent
with ``protocol.decode_answer`` for the request it answers; ops that are never
answered must get no line back.
"""

from __future__ import annotations

import signal
from pathlib import Path

from shim import protocol
from shim.channel import Client
from tests.shim.support import PYTHON, TRAIN_TINY, Recorder, ShimEnv, Spawn, lines
from tests.sidecar.agentproc import AgentProcess


def _parse(recorder: Recorder) -> tuple[list[protocol.Request], list[protocol.Answer]]:
    """Every request and answer of every conversation, each parsed through the schema."""
    requests: list[protocol.Request] = []
    answers: list[protocol.Answer] = []
    for sent, answered in recorder.conversations:
        mine = [protocol.decode_request(line) for line in lines(sent)]
        expecting = [r for r in mine if protocol.OPS[r.OP].answered]
        replies = lines(answered)
        assert len(replies) == len(expecting), (mine, replies)
        answers += [
            protocol.decode_answer(line, r) for line, r in zip(replies, expecting, strict=True)
        ]
        requests += mine
    return requests, answers


def test_the_shims_real_messages_and_the_agents_answers_parse(
    shim_env: ShimEnv, agent: AgentProcess, spawn: Spawn, tmp_path: Path
) -> None:
    recorded = shim_env.run / "recorded.sock"
    recorder = Recorder(recorded, agent.socket)
    env = dict(shim_env.env, JITCKPT_SOCKET=str(recorded))
    args = ["--output-dir", str(tmp_path / "out"), "--max-steps", "12", "--save-steps", "2"]
    run = spawn([PYTHON, *TRAIN_TINY, *args, "--step-sleep", "0.3"], env)
    run.wait_for("rank 0 step 4/", timeout=90)
    run.signal(signal.SIGTERM)
    assert run.wait() == 143, run.output()
    # What the shim never sends, said here the shim's way: a status, a refused staged,
    # (nothing was pending to restore) the wait for a restore, answered at once, and what
    # a process the shim does not follow says (tests/shim/test_no_optimizer.py has one).
    client = Client(str(recorded))
    assert isinstance(client.call(protocol.Status()), protocol.StatusAnswer)
    # A save held in memory for room on the volume, then dropped (``shim/volumeroom.py``).
    assert isinstance(client.call(protocol.Holding(step=99)), protocol.OkAnswer)
    assert isinstance(client.call(protocol.Holding(step=99, released=True)), protocol.OkAnswer)
    unfollowed = protocol.Unfollowed(reason="it trains with no optimizer")
    assert isinstance(client.call(unfollowed), protocol.OkAnswer)
    waited = client.call(protocol.AwaitRestore(seconds=5))
    assert waited == protocol.HelloAnswer(restored=None), waited
    refused = protocol.Staged(step=1, kind="jit", dir=str(tmp_path), files=())
    assert isinstance(client.call(refused), protocol.ErrorAnswer)
    client.close()
    agent.wait_for(lambda: agent.status()["last_committed"] is not None, 30, "a commit")
    recorder.close()

    requests, answers = _parse(recorder)
    sent_ops = {request.OP for request in requests}
    assert sent_ops == set(protocol.OPS), sent_ops
    [hello] = [r for r in requests if isinstance(r, protocol.Hello)]
    assert hello.pid == run.pid and hello.framework == "transformers"
    staged = [r for r in requests if isinstance(r, protocol.Staged)]
    assert {s.kind for s in staged} == {protocol.KIND_PERIODIC, protocol.KIND_JIT}
    # The JIT checkpoint's files went one by one into the directory its staged completes.
    [jit] = [s for s in staged if s.kind == protocol.KIND_JIT and s.step != refused.step]
    parts = [r for r in requests if isinstance(r, protocol.Staging)]
    assert parts and all(p.dir == jit.dir and p.step == jit.step for p in parts), parts
    assert {name for p in parts for name in p.files} < set(jit.files)
    # The goodbye names the last step end the process saw: the JIT checkpoint's.
    byes = [r for r in requests if isinstance(r, protocol.Bye)]
    assert byes == [protocol.Bye(exit_code=143, step=jit.step)]
    assert {type(a) for a in answers} == {
        protocol.HelloAnswer,
        protocol.StagedAnswer,
        protocol.OkAnswer,
        protocol.StatusAnswer,
        protocol.ErrorAnswer,
    }
    # Building a message and parsing what it says gives the same message back.
    for request in requests:
        assert protocol.decode_request(protocol.encode(request)) == request
