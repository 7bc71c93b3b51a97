"""The agent's socket against a hostile trainer: floods, malformed lines, idle and forged peers.

A real ``jitckpt agent`` process and its real Unix socket, spoken to the way
code in the trainer container can: raw bytes, many connections, lines that
never end. The agent must stay alive, small (RSS read from /proc) and
answering, answer every bad line with an error (or close the connection),
and log no traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from local.s3server import LocalS3
from shim import protocol
from shim.channel import Client, SidecarLink
from tests.sidecar import shimtalk
from tests.sidecar.agentproc import AgentProcess

MIB = 1024 * 1024
RSS_LIMIT = 300 * MIB
ANSWER_SECONDS = 5.0  # a legitimate request is answered within this, flood or not


@pytest.fixture
def agent(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> Iterator[AgentProcess]:
    proc = AgentProcess(root=tmp_path, destination=f"s3://{bucket}/ns-a/job-1", s3_env=s3_env)
    yield proc
    proc.kill()


def _connect(path: Path, timeout: float = ANSWER_SECONDS) -> socket.socket:
    """A raw connection; a full accept backlog is waited out, as a blocking connect would."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock.connect(str(path))
            return sock
        except BlockingIOError:  # EAGAIN: the backlog is full until the agent accepts
            if time.monotonic() > deadline:
                sock.close()
                raise
            time.sleep(0.01)


def _memory(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (the peak) of ``pid``, in bytes."""
    found: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            found[name] = int(value.split()[0]) * 1024
    return found


def _status_within_bound(agent: AgentProcess) -> dict[str, object]:
    """A legitimate ``status`` on a fresh connection; the client gives up after the bound."""
    client = Client(str(agent.socket), timeout=ANSWER_SECONDS)
    try:
        answer = client.call(protocol.Status())
    finally:
        client.close()
    assert isinstance(answer, protocol.StatusAnswer), answer
    return answer.status


def _read_line(sock: socket.socket) -> bytes:
    """One line from ``sock`` (byte by byte: nothing of the next line is taken), b"" once closed."""
    data = b""
    while not data.endswith(b"\n"):
        try:
            byte = sock.recv(1)
        except ConnectionResetError:
            return b""
        if not byte:
            return b""
        data += byte
    return data


def test_floods_leave_the_agent_alive_small_and_answering(agent: AgentProcess) -> None:
    agent.start()
    agent.wait_ready()
    assert agent.process is not None
    pid = agent.process.pid
    # The trainer's own connection, said hello first: junk connections push out others first.
    trainer = _connect(agent.socket)
    trainer.sendall(protocol.encode(shimtalk.hello(4321)))
    assert json.loads(_read_line(trainer))["ok"] is True

    held: list[socket.socket] = []
    try:
        for _ in range(500):  # idle connections that never say anything
            held.append(_connect(agent.socket))
        partial = b'{"v":1,"op":"status","pad":"' + b"x" * (protocol.MAX_LINE - 40)
        assert len(partial) < protocol.MAX_LINE
        for _ in range(300):  # each holds a line just under the cap, never finished
            sock = _connect(agent.socket)
            held.append(sock)
            with contextlib.suppress(OSError):  # closed to make room for a newer one
                sock.sendall(partial)
        # 64 MiB without a newline: an error answer or a closed connection, never buffered.
        flood = _connect(agent.socket, timeout=30)
        sent = 0
        with contextlib.suppress(OSError):
            chunk = b"y" * MIB
            while sent < 64 * MIB:
                flood.sendall(chunk)
                sent += len(chunk)
        reply = _read_line(flood)
        assert reply == b"" or json.loads(reply)["ok"] is False, reply
        flood.close()

        status = _status_within_bound(agent)
        assert status["phase"] == "ready"
        # The trainer's connection survived the flood and still answers on the same socket.
        trainer.sendall(protocol.encode(protocol.Status()))
        assert json.loads(_read_line(trainer))["ok"] is True
        assert agent.process.poll() is None
        memory = _memory(pid)
        assert memory["VmHWM"] < RSS_LIMIT, memory
        assert len(os.listdir(f"/proc/{pid}/fd")) < 300  # connections are capped
    finally:
        for sock in held:
            sock.close()
        trainer.close()
    assert "Traceback" not in agent.log()
    assert agent.terminate() == 0


# What the trainer's code could write instead of a request, and what the agent must do:
# "error": an error answer, the connection serves on; "silent": no answer (an op that is
# never answered), the connection serves on; "closed": the agent closes the connection.
BAD_LINES: list[tuple[str, bytes, str]] = [
    ("nested arrays", b"[" * 60000, "error"),
    (
        "nested objects",
        b'{"v":1,"op":"status","x":' + b'{"a":' * 2000 + b"1" + b"}" * 2001,
        "error",
    ),
    ("Infinity", b'{"v":1,"op":"sigterm","step":Infinity}', "error"),
    ("-Infinity", b'{"v":1,"op":"sigterm","step":-Infinity}', "error"),
    ("NaN", b'{"v":1,"op":"progress","step":1,"max_steps":2,"epoch":NaN}', "error"),
    ("overflowing float", b'{"v":1,"op":"progress","step":1,"max_steps":2,"epoch":1e999}', "error"),
    ("400-digit step", b'{"v":1,"op":"sigterm","step":' + b"9" * 400 + b"}", "error"),
    ("20-digit step", b'{"v":1,"op":"sigterm","step":99999999999999999999}', "error"),
    ("string step", b'{"v":1,"op":"sigterm","step":"5"}', "error"),
    ("bool step", b'{"v":1,"op":"sigterm","step":true}', "error"),
    ("float step", b'{"v":1,"op":"sigterm","step":5.0}', "error"),
    (
        "negative pid",
        b'{"v":1,"op":"hello","pid":-1,"rank":0,"local_rank":0,'
        b'"world_size":1,"node_rank":0,"nnodes":1,"framework":"x"}',
        "error",
    ),
    (
        "huge nnodes",
        b'{"v":1,"op":"hello","pid":5,"rank":0,"local_rank":0,'
        b'"world_size":1,"node_rank":0,"nnodes":1000000000,"framework":"x"}',
        "error",
    ),
    (
        "files not a list",
        b'{"v":1,"op":"staged","step":1,"kind":"jit","dir":"d","files":"a"}',
        "error",
    ),
    (
        "files of numbers",
        b'{"v":1,"op":"staged","step":1,"kind":"jit","dir":"d","files":[1]}',
        "error",
    ),
    (
        "file outside",
        b'{"v":1,"op":"staged","step":1,"kind":"jit","dir":"d","files":["../x"]}',
        "error",
    ),
    (
        "absolute file",
        b'{"v":1,"op":"staged","step":1,"kind":"jit","dir":"d","files":["/etc/x"]}',
        "error",
    ),
    (
        "unknown kind",
        b'{"v":1,"op":"staged","step":1,"kind":"weird","dir":"d","files":[]}',
        "error",
    ),
    (
        "lone surrogate",
        b'{"v":1,"op":"staged","step":1,"kind":"jit","dir":"\\ud800","files":[]}',
        "error",
    ),
    (
        "oversize files list",
        b'{"v":1,"op":"staged","step":1,"kind":"jit","dir":"d","files":['
        + b",".join(b'"f%d"' % i for i in range(5000))
        + b"]}",
        "error",
    ),
    ("version as a string", b'{"v":"1","op":"status"}', "error"),
    ("version 2", b'{"v":2,"op":"status"}', "error"),
    ("no version", b'{"op":"status"}', "error"),
    ("unknown op", b'{"v":1,"op":"teleport"}', "error"),
    ("no op", b'{"v":1}', "error"),
    ("op not a string", b'{"v":1,"op":["status"]}', "error"),
    ("missing fields", b'{"v":1,"op":"staged"}', "error"),
    ("hello with a pid only", b'{"v":1,"op":"hello","pid":5}', "error"),
    ("not UTF-8", b'{"v":1,"op":"\xff\xfe"}', "error"),
    ("not an object", b"[1,2]", "error"),
    ("a bare string", b'"status"', "error"),
    ("not JSON", b"status please", "error"),
    ("empty line", b"", "error"),
    ("bad progress", b'{"v":1,"op":"progress","step":-1,"max_steps":0,"epoch":0}', "silent"),
    ("bad lease", b'{"v":1,"op":"lease","pid":0}', "silent"),
    (
        "line over the cap",
        b'{"v":1,"op":"status","pad":"' + b"z" * protocol.MAX_LINE + b'"}',
        "closed",
    ),
]


def test_malformed_lines_get_an_error_answer_and_no_traceback(agent: AgentProcess) -> None:
    agent.start()
    agent.wait_ready()
    status_line = protocol.encode(protocol.Status())
    outcomes: dict[str, str] = {}
    for name, line, _ in BAD_LINES:
        with _connect(agent.socket) as sock:
            with contextlib.suppress(OSError):  # the agent may close before reading it all
                sock.sendall(line + b"\n" + status_line)
            first = _read_line(sock)
            if not first:
                outcomes[name] = "closed"
                continue
            answer = json.loads(first)
            if answer.get("ok") is False:
                assert isinstance(answer["error"], str) and answer["error"], (name, answer)
                second = _read_line(sock)
                if not second:
                    outcomes[name] = "closed"
                    continue
                assert "status" in json.loads(second), (name, second)
                outcomes[name] = "error"
            else:
                assert "status" in answer, (name, answer)  # the status came back first
                outcomes[name] = "silent"
    assert outcomes == {name: expected for name, _, expected in BAD_LINES}
    # Unknown fields are ignored; the agent still serves a trainer the normal way.
    with _connect(agent.socket) as sock:
        sock.sendall(b'{"v":1,"op":"status","from_the_future":{"x":[1,2]}}\n')
        assert json.loads(_read_line(sock))["ok"] is True
    client = Client(str(agent.socket))
    assert client.call(shimtalk.hello(77)) == protocol.HelloAnswer(None)
    assert client.call(protocol.Bye(exit_code=0)) == protocol.OkAnswer()
    client.close()
    assert agent.process is not None and agent.process.poll() is None
    log = agent.log()
    assert "Traceback" not in log, log
    assert "refused a line" in log
    assert agent.terminate() == 0


def test_hellos_without_bye_do_not_hold_the_drain(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    """Only a process whose connection or lease is open holds the drain, until its ``bye``."""
    agent = AgentProcess(
        root=tmp_path,
        destination=f"s3://{bucket}/ns-a/job-1",
        s3_env=s3_env,
        extra_env={"JITCKPT_GRACE_SECONDS": "120"},
    )
    try:
        agent.start()
        agent.wait_ready()
        # Forged hellos: many pids on one connection (one entry: the connection's last
        # hello), and hellos of processes that left without bye. None of them is alive,
        # so none may hold the drain.
        forger = Client(str(agent.socket))
        for pid in range(100, 140):
            assert isinstance(forger.call(shimtalk.hello(pid)), protocol.HelloAnswer)
        forger.close()
        for pid in (200, 201):
            gone = Client(str(agent.socket))
            gone.call(shimtalk.hello(pid))
            gone.close()
        # A live process: its connection is open and it has not said bye.
        live = Client(str(agent.socket))
        live.call(shimtalk.hello(300))
        agent.wait_for(lambda: len(agent.status()["clients"]) == 4, 10, "4 clients")

        assert agent.process is not None
        agent.process.send_signal(signal.SIGTERM)
        agent.wait_for(lambda: agent.status()["phase"] == "stopping", 10, "the drain")
        time.sleep(1.0)  # several drain polls: the live process holds it
        assert agent.process.poll() is None
        # Another connection says the live process's pid, then bye: that ends only its
        # own entry (issue 22, class 3: no connection decides when the sidecar leaves).
        impostor = Client(str(agent.socket))
        impostor.call(shimtalk.hello(300))
        assert impostor.call(protocol.Bye(exit_code=0)) == protocol.OkAnswer()
        time.sleep(1.0)
        assert agent.process.poll() is None
        impostor.close()
        assert live.call(protocol.Bye(exit_code=143)) == protocol.OkAnswer()
        live.close()
        # Far less than the 115 s the grace deadline would take.
        assert agent.wait(timeout=60) == 0
    finally:
        agent.kill()
    assert "grace deadline reached" not in agent.log()


def _still_open(sock: socket.socket) -> bool:
    """True while the agent keeps ``sock`` open (nothing to read, no end of stream)."""
    sock.setblocking(False)
    try:
        return not sock.recv(1)  # b"": closed; data: the agent said something unasked
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)


def test_idle_connections_close_processes_connections_stay_and_the_shim_reconnects(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    """Anonymous connections time out; a lease and a hello'd connection are their process's."""
    agent = AgentProcess(
        root=tmp_path,
        destination=f"s3://{bucket}/ns-a/job-1",
        s3_env=s3_env,
        extra_env={"JITCKPT_SOCKET_IDLE_SECONDS": "1"},
    )
    try:
        agent.start()
        agent.wait_ready()
        idle = _connect(agent.socket, timeout=30)
        dribbler = _connect(agent.socket, timeout=30)
        lease = _connect(agent.socket, timeout=30)
        lease.sendall(protocol.encode(protocol.Lease(pid=os.getpid())))
        trainer = _connect(agent.socket, timeout=30)
        trainer.sendall(protocol.encode(shimtalk.hello(os.getpid())))
        assert json.loads(_read_line(trainer))["ok"] is True

        stop = threading.Event()

        def dribble() -> None:  # a line that never ends, a byte at a time
            with contextlib.suppress(OSError):
                while not stop.wait(0.2):
                    dribbler.sendall(b" ")

        thread = threading.Thread(target=dribble, daemon=True)
        thread.start()
        assert _read_line(idle) == b""  # closed by the agent after a second idle
        assert _read_line(dribbler) == b""  # bytes without a line do not count as activity
        stop.set()
        thread.join()
        # Three idle periods later the lease and the trainer's connection are still open,
        # and the trainer's still answers.
        time.sleep(3.0)
        assert _still_open(lease) and _still_open(trainer)
        trainer.sendall(protocol.encode(protocol.Status()))
        assert json.loads(_read_line(trainer))["ok"] is True
        # After its lease a connection accepts nothing else.
        lease.sendall(protocol.encode(protocol.Status()))
        assert _read_line(lease) == b""
        for sock in (lease, idle, dribbler, trainer):
            sock.close()

        # The sidecar restarts (a native sidecar is restarted in place): the shim's client
        # finds its connection closed, reconnects and says its hello again first.
        link = SidecarLink(str(agent.socket))
        assert link.hello(shimtalk.hello(os.getpid())) == protocol.HelloAnswer(None)
        agent.kill()
        agent.start()
        agent.wait_ready()
        status = link.call(protocol.Status())
        assert isinstance(status, protocol.StatusAnswer)
        assert [c["pid"] for c in status.status["clients"]] == [os.getpid()]
        assert link.call(protocol.Bye(exit_code=0)) == protocol.OkAnswer()
        assert agent.terminate() == 0
    finally:
        agent.kill()
    log = agent.log()
    assert "Traceback" not in log
    assert "a lease connection said more than its lease" in log
