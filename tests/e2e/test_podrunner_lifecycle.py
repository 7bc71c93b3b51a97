"""The pod runner's kubelet behaviour, with small shell containers.

These pods are written here on purpose: they test the runner's mechanics
(mounts, ordering, probes, signals) in isolation. The tests that run the
product use the webhook's own output instead (test_podrunner_spec.py, test_*e2e*).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from local.podrunner import Node, ObjectStore, Pod


def sh(name: str, script: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": "busybox", "command": ["sh", "-c", script], **extra}


def pod(name: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    volumes = [
        {"name": "run", "emptyDir": {"medium": "Memory"}},
        {"name": "local", "emptyDir": {}},
        {"name": "claim", "persistentVolumeClaim": {"claimName": "shared"}},
    ]
    return {
        "metadata": {"name": name, "namespace": "t"},
        "spec": {"volumes": volumes, "containers": containers, **spec},
    }


MOUNTS = [
    {"name": "run", "mountPath": "/var/run/jitckpt"},
    {"name": "local", "mountPath": "/mnt/jitckpt"},
    {"name": "claim", "mountPath": "/mnt/jitckpt-pvc"},
]


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(root=tmp_path / "node", objects=ObjectStore(secrets={"s": {"K": "v"}}))


def test_each_pod_sees_its_own_volumes_and_shares_the_claim(node: Node) -> None:
    script = (
        'echo "$HOSTNAME" > /mnt/jitckpt/owner; sleep 0.3; '
        'test "$(cat /mnt/jitckpt/owner)" = "$HOSTNAME" || exit 3; '
        'echo "$HOSTNAME" > /mnt/jitckpt-pvc/"$HOSTNAME"; '
        "mountpoint -q /var/run/jitckpt || exit 4"
    )
    pods = [
        Pod(node, pod(f"p{i}", [sh("c", script, volumeMounts=MOUNTS)])).start() for i in range(2)
    ]
    results = [p.wait(30) for p in pods]
    assert [r.exit_code("c") for r in results] == [0, 0], [r.reason for r in results]
    assert sorted(p.name for p in node.claim_path("shared").iterdir()) == ["p0", "p1"]
    assert results[0].ip != results[1].ip
    # emptyDirs are gone with their pod; the claim stays
    assert not (pods[0].dir / "volumes" / "local").exists()


def test_native_sidecar_gates_the_main_container_and_stops_last(node: Node) -> None:
    sidecar = sh(
        "agent",
        "trap 'echo stopped > /mnt/jitckpt-pvc/agent-stopped; exit 0' TERM; "
        "sleep 1; touch /var/run/jitckpt/ready; while true; do sleep 0.05; done",
        restartPolicy="Always",
        volumeMounts=MOUNTS,
        startupProbe={
            "exec": {"command": ["test", "-f", "/var/run/jitckpt/ready"]},
            "periodSeconds": 1,
            "failureThreshold": 10,
        },
    )
    main = sh(
        "trainer",
        "test -f /var/run/jitckpt/ready || exit 5; test ! -e /mnt/jitckpt-pvc/agent-stopped",
        volumeMounts=MOUNTS,
    )
    result = Pod(node, pod("gated", [main], initContainers=[sidecar])).start().wait(30)
    assert result.phase == "Succeeded", result.reason
    assert result.exit_code("agent") == 0  # it got SIGTERM after the trainer was done
    assert (node.claim_path("shared") / "agent-stopped").exists()


def test_failing_startup_probe_fails_the_pod_and_never_starts_main(node: Node) -> None:
    sidecar = sh(
        "agent",
        "sleep 30",
        restartPolicy="Always",
        startupProbe={
            "httpGet": {"path": "/readyz", "port": 8471},
            "periodSeconds": 0.2,
            "failureThreshold": 3,
        },
    )
    p = Pod(
        node,
        pod(
            "noprobe",
            [sh("trainer", "exit 0")],
            initContainers=[sidecar],
            terminationGracePeriodSeconds=1,
        ),
    )
    result = p.start().wait(30)
    assert result.phase == "Failed"
    assert "startupProbe of agent failed" in result.reason
    assert "trainer" not in result.containers or result.exit_code("trainer") is None


def test_termination_runs_prestop_inside_then_sigterm_then_sigkill(node: Node) -> None:
    trainer = sh(
        "trainer",
        # PID 1 is a shell without a trap: SIGTERM does nothing (as in a real pod).
        # The "training process" registers a pid file; the preStop hook reaches it.
        # ($$$$ is "$$" after the kubelet's $(VAR) expansion of the command.)
        'sh -c \'trap "echo saved > /mnt/jitckpt-pvc/saved; exit 143" TERM; '
        "mkdir -p /var/run/jitckpt/pids; echo $$$$ > /var/run/jitckpt/pids/$$$$.pid; "
        "while true; do sleep 0.05; done' & wait",
        volumeMounts=MOUNTS,
        terminationMessagePath="/dev/termination-log",
        lifecycle={
            "preStop": {
                "exec": {
                    "command": [
                        "/bin/sh",
                        "-c",
                        "for f in /var/run/jitckpt/pids/*.pid; do kill -TERM $(cat $f); done",
                    ]
                }
            }
        },
    )
    stubborn = sh("stubborn", "echo 'bye from stubborn' > /dev/termination-log; sleep 60")
    p = Pod(node, pod("term", [trainer, stubborn], terminationGracePeriodSeconds=2)).start()
    time.sleep(1.0)
    started = time.monotonic()
    p.terminate()
    result = p.wait(30)
    elapsed = time.monotonic() - started
    assert (node.claim_path("shared") / "saved").read_text() == "saved\n"
    assert result.exit_code("stubborn") == 137  # ignored SIGTERM as PID 1, killed at the deadline
    assert result.message("stubborn") == "bye from stubborn\n"
    assert 1.8 <= elapsed < 5, elapsed
    assert result.terminated
    reasons = [(e.container, e.reason) for e in p.events]
    assert reasons.index(("trainer", "PreStopHook")) < reasons.index(("trainer", "Killing"))


def test_a_sidecar_stopped_past_the_deadline_still_gets_sigterm_and_the_minimum_grace(
    node: Node,
) -> None:
    """The trainer (PID 1 without a trap) uses the whole grace period; the kubelet then
    stops the native sidecar with its minimum of 2 s, not a SIGKILL with no SIGTERM."""
    sidecar = sh(
        "agent",
        "trap 'sleep 0.5; echo stopped > /mnt/jitckpt-pvc/agent-stopped; exit 0' TERM; "
        "while true; do sleep 0.05; done",
        restartPolicy="Always",
        volumeMounts=MOUNTS,
    )
    p = Pod(
        node,
        pod(
            "late",
            [sh("trainer", "sleep 60")],
            initContainers=[sidecar],
            terminationGracePeriodSeconds=1,
        ),
    ).start()
    time.sleep(1.0)
    p.terminate()
    result = p.wait(30)
    assert result.exit_code("trainer") == 137
    assert result.exit_code("agent") == 0
    assert (node.claim_path("shared") / "agent-stopped").read_text() == "stopped\n"


def test_kill_takes_every_process_of_the_container(node: Node) -> None:
    # a daemonized grandchild in its own session still dies with PID 1
    script = "setsid sh -c 'sleep 300' & echo started > /mnt/jitckpt-pvc/k; sleep 300"
    p = Pod(node, pod("killed", [sh("c", script, volumeMounts=MOUNTS)])).start()
    deadline = time.monotonic() + 10
    while not (node.claim_path("shared") / "k").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    p.kill()
    result = p.wait(10)
    assert result.exit_code("c") == 137
    launch = (p.dir / "containers" / "c" / "init.pid").read_text()
    assert not Path(f"/proc/{launch}").exists()


def test_legacy_layout_restore_init_then_regular_sidecar(node: Node) -> None:
    restore = sh("restore", "echo restored > /mnt/jitckpt/state", volumeMounts=MOUNTS)
    trainer = sh(
        "trainer",
        'test "$(cat /mnt/jitckpt/state)" = restored && touch /var/run/jitckpt/bye',
        volumeMounts=MOUNTS,
    )
    agent = sh(
        "agent",
        "while [ ! -e /var/run/jitckpt/bye ]; do sleep 0.05; done; echo ok > /dev/termination-log",
        volumeMounts=MOUNTS,
    )
    result = Pod(node, pod("legacy", [trainer, agent], initContainers=[restore])).start().wait(30)
    assert result.phase == "Succeeded", result.reason
    assert result.exit_code("restore") == 0
    assert result.message("agent") == "ok\n"


def test_failed_init_container_stops_the_pod(node: Node) -> None:
    result = (
        Pod(
            node,
            pod("initfail", [sh("trainer", "exit 0")], initContainers=[sh("restore", "exit 7")]),
        )
        .start()
        .wait(30)
    )
    assert result.phase == "Failed"
    assert result.reason == "init container restore exited with 7"
    assert result.exit_code("trainer") is None


def test_a_pod_still_running_says_which_container_and_its_last_escaped_lines(
    node: Node,
) -> None:
    script = r"printf 'one\ntwo\nthree \033[2J\n'; sleep 300"
    done = sh("done", "echo finished")
    p = Pod(node, pod("stuck", [sh("c", script), done])).start()
    with pytest.raises(TimeoutError):
        p.wait(3)
    described = p.still_running(lines=2)
    p.kill()
    p.wait(10)
    assert described == ["c still running (two | three \\x1b[2J)"], described
