"""A pod's lifecycle, in the kubelet's order.

Start: regular init containers run to completion one after another; a native
sidecar (an init container with ``restartPolicy: Always``) is started and the
next container waits for its startupProbe; then the main containers start
together. The pod is done when every main container has exited; its native
sidecars are then stopped in reverse order.

Termination (preemption, eviction, drain): each running main container's
preStop hook runs inside it, then its PID 1 gets SIGTERM; native sidecars are
stopped the same way once the main containers are gone (Kubernetes >= 1.29),
all within the pod's ``terminationGracePeriodSeconds``, after which whatever
still runs gets SIGKILL. ``kill()`` is the node dying: SIGKILL now, no hooks.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jitckpt.text import escape
from local.podrunner.container import Container, ContainerStatus
from local.podrunner.image import RootSpec
from local.podrunner.node import Node
from local.podrunner.probes import run_startup_probe
from local.podrunner.spec import ObjectStore, PodContext, container_argv, container_env
from local.podrunner.volumes import PodVolumes

DEFAULT_GRACE_SECONDS = 30.0
# The kubelet never stops a container with less grace than this, even past the pod's deadline.
MINIMUM_GRACE_SECONDS = 2.0
SIGTERM, SIGKILL = 15, 9


@dataclass(frozen=True)
class PodEvent:
    """One line of the pod's story, for ``kubectl describe``-like accounts."""

    at: float
    pod: str
    container: str
    reason: str
    message: str


@dataclass(frozen=True)
class ContainerState:
    """One container of a running pod: its status so far, whether it still runs, and
    whether it has started (its startupProbe, where it has one, passed)."""

    status: ContainerStatus
    running: bool
    started: bool


@dataclass
class PodResult:
    name: str
    namespace: str
    ip: str
    phase: str  # "Succeeded" or "Failed"
    reason: str
    terminated: bool  # terminate() or kill() was called
    init_containers: dict[str, ContainerStatus]
    containers: dict[str, ContainerStatus]
    started_at: float
    finished_at: float

    def status(self, container: str) -> ContainerStatus | None:
        """``container``'s status, whether it ran as a main or an init container (a native
        sidecar is one); None if it never started."""
        return self.containers.get(container) or self.init_containers.get(container)

    def exit_code(self, container: str) -> int | None:
        status = self.status(container)
        return status.exit_code if status else None

    def message(self, container: str) -> str:
        status = self.status(container)
        return status.message if status else ""


def _is_native_sidecar(spec: Mapping[str, Any]) -> bool:
    return spec.get("restartPolicy") == "Always"


def _declared_ports(pod_spec: Mapping[str, Any]) -> set[int]:
    ports: set[int] = set()
    for spec in (pod_spec.get("initContainers") or []) + (pod_spec.get("containers") or []):
        ports.update(int(p["containerPort"]) for p in spec.get("ports") or [])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            action = (spec.get(probe) or {}).get("httpGet") or (spec.get(probe) or {}).get(
                "tcpSocket"
            )
            if action and str(action.get("port", "")).isdigit():
                ports.add(int(action["port"]))
    return ports


class Pod:
    """One pod of an injected spec, run as local processes on a ``Node``."""

    def __init__(
        self,
        node: Node,
        manifest: Mapping[str, Any],
        on_event: Callable[[PodEvent], None] | None = None,
        *,
        objects: ObjectStore | None = None,
        service_env: Mapping[str, str] | None = None,
    ) -> None:
        """``objects`` replaces the node's Secrets and ConfigMaps for this pod (a kubelet
        fetches each pod's own from the API server); ``service_env`` is what the kubelet
        puts before the container's own env (the ``kubernetes`` Service's address)."""
        self.node = node
        self.objects = objects if objects is not None else node.objects
        self.service_env = dict(service_env or {})
        metadata = dict(manifest.get("metadata") or {})
        if not metadata.get("name"):
            metadata["name"] = str(metadata.get("generateName", "pod-")) + secrets.token_hex(3)
        metadata.setdefault("namespace", "default")
        metadata.setdefault("uid", secrets.token_hex(8))
        self.spec: dict[str, Any] = dict(manifest.get("spec") or {})
        self.name = str(metadata["name"])
        self.namespace = str(metadata["namespace"])
        self.ip = node.allocate_ip(_declared_ports(self.spec))
        self.context = PodContext(
            metadata=metadata,
            spec=self.spec,
            pod_ip=self.ip,
            node_name=str(self.spec.get("nodeName") or "localhost"),
        )
        self.dir = node.pod_dir(self.namespace, self.name, str(metadata["uid"]))
        self.grace_seconds = float(
            self.spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS)
        )
        self.events: list[PodEvent] = []
        self._on_event = on_event
        self._containers: dict[str, Container] = {}
        self._specs: dict[str, Mapping[str, Any]] = {}
        self._probed: set[str] = set()  # startupProbe passed
        self._volumes: PodVolumes | None = None
        self._terminate_at: float | None = None
        self._killed = False
        self._requested = False  # terminate() or kill() was called from outside
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._result: PodResult | None = None
        self._started_at = 0.0

    # --- public API -----------------------------------------------------------

    def start(self) -> Pod:
        """Run the pod's lifecycle in a background thread."""
        self._started_at = time.time()
        self._thread = threading.Thread(
            target=self._lifecycle, name=f"pod-{self.name}", daemon=True
        )
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> PodResult:
        """Block until the pod is over; raise TimeoutError after ``timeout`` seconds."""
        assert self._thread is not None, "start() first"
        self._thread.join(timeout)
        if self._result is None:
            raise TimeoutError(f"pod {self.name} still running after {timeout} s")
        return self._result

    def terminate(self, grace_seconds: float | None = None) -> None:
        """Begin graceful termination (preStop, SIGTERM, grace period, SIGKILL); returns at once."""
        if self._terminate_at is None:
            self._requested = True
            grace = self.grace_seconds if grace_seconds is None else grace_seconds
            self._terminate_at = time.monotonic()
            self.grace_seconds = grace
            self._event("", "Killing", f"terminating the pod, grace period {grace:g} s")
            self._wake.set()

    def kill(self) -> None:
        """The node is gone: SIGKILL every container now, no hooks, no grace."""
        self._killed = True
        self._requested = True
        self._event("", "Killing", "SIGKILL to every container (no grace period)")
        for container in list(self._containers.values()):
            container.signal(SIGKILL)
        self._wake.set()

    def volume_path(self, volume: str) -> Path | None:
        """Where the pod's volume ``volume`` lies on this machine (None before it exists)."""
        return self._volumes.paths.get(volume) if self._volumes is not None else None

    def update_secret(self, secret: str, data: Mapping[str, str]) -> int:
        """What the kubelet does when Secret ``secret`` changes: rotate the pod's volumes
        of it in place (its env, read once at start, never changes); how many there were."""
        return self._volumes.update_secret(secret, data) if self._volumes is not None else 0

    def container(self, name: str) -> Container:
        return self._containers[name]

    def still_running(self, lines: int = 3) -> list[str]:
        """Each container still running, with the last ``lines`` lines of its log: what a
        pod that did not end in time was doing, for the error that says so (the lines are
        the containers' own output, escaped: it is printed to the user's terminal)."""
        described = []
        for name, container in list(self._containers.items()):
            if not container.running:
                continue
            try:
                tail = container.log_path.read_bytes()[-4096:].decode("utf-8", "replace")
            except OSError:
                tail = ""
            last = " | ".join(escape(line) for line in tail.strip().splitlines()[-lines:])
            described.append(f"{name} still running ({last or 'no output'})")
        return described

    @property
    def started_at(self) -> float:
        return self._started_at

    @property
    def done(self) -> bool:
        return self._result is not None

    def states(self) -> dict[str, ContainerState]:
        """Every container started so far, as a kubelet reports it (``local/kubelet``)."""
        states = {}
        for name, container in list(self._containers.items()):
            if container.status.exit_code is None and not container.running:
                container.wait(0)  # it has exited: collect its code and message
            running = container.status.exit_code is None
            probed = "startupProbe" not in self._specs[name] or name in self._probed
            states[name] = ContainerState(container.status, running, running and probed)
        return states

    # --- lifecycle ------------------------------------------------------------

    def _event(self, container: str, reason: str, message: str) -> None:
        event = PodEvent(time.time(), self.name, container, reason, message)
        self.events.append(event)
        if self._on_event is not None:
            self._on_event(event)

    @property
    def _stopping(self) -> bool:
        return self._killed or self._terminate_at is not None

    def _make(self, spec: Mapping[str, Any]) -> Container:
        assert self._volumes is not None
        name = str(spec["name"])
        state = self.dir / "containers" / name
        state.mkdir(parents=True, exist_ok=True)
        image = self.node.image_root(str(spec.get("image", "")))
        env = dict(image.config.env) if image else self.node.base_env(str(spec.get("image", "")))
        env["HOSTNAME"] = str(self.spec.get("hostname") or self.name)
        env.update(self.service_env)
        env.update(container_env(spec, self.context, self.objects))
        root = None
        if image is not None:
            uid, gid = image.user(spec, self.spec)
            context = spec.get("securityContext") or {}
            root = RootSpec(
                image=image.rootfs,
                scratch=state / "root",
                read_only=bool(context.get("readOnlyRootFilesystem")),
                uid=uid,
                gid=gid,
                no_new_privileges=context.get("allowPrivilegeEscalation") is False,
            )
        entrypoint, cmd = (image.config.entrypoint, image.config.cmd) if image else ([], [])
        container = Container(
            name=name,
            label=f"{self.name}/{name}",
            argv=container_argv(spec, env, entrypoint, cmd),
            env=env,
            mounts=self._volumes.mounts_for(
                spec, state / "termination-log", host_mount_points=root is None
            ),
            working_dir=spec.get("workingDir") or (image.config.working_dir if image else None),
            state_dir=state,
            termination_log=state / "termination-log",
            fallback_to_logs=spec.get("terminationMessagePolicy") == "FallbackToLogsOnError",
            stream=self.node.stream,
            root=root,
        )
        self._containers[name] = container
        self._specs[name] = spec
        return container

    def _launch(self, spec: Mapping[str, Any]) -> Container:
        container = self._make(spec)
        container.start()
        self._event(container.name, "Started", " ".join(container.argv))
        post_start = ((spec.get("lifecycle") or {}).get("postStart") or {}).get("exec")
        if post_start:
            result = container.exec(post_start["command"], self.grace_seconds)
            if result.exit_code != 0:
                self._event(container.name, "FailedPostStartHook", result.output[-300:])
                container.signal(SIGKILL)
        return container

    def _lifecycle(self) -> None:
        reason = ""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._volumes = PodVolumes.create(
                self.context,
                self.dir,
                self.node.claims_dir,
                self.objects,
                self.context.metadata["uid"],
            )
            reason = self._run_init_containers()
            if not reason and not self._stopping:
                for spec in self.spec.get("containers") or []:
                    self._launch(spec)
                self._wait_main()
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            self._event("", "Failed", reason)
        finally:
            self._shutdown()
            self._result = self._summarize(reason)
            if self._volumes is not None:
                self._volumes.remove()
            self.node.release_ip(self.ip)

    def _run_init_containers(self) -> str:
        for spec in self.spec.get("initContainers") or []:
            if self._stopping:
                return ""
            container = self._launch(spec)
            if _is_native_sidecar(spec):
                probe = spec.get("startupProbe")
                if not probe:
                    continue
                outcome = run_startup_probe(probe, spec, container, self.ip, lambda: self._stopping)
                if outcome.passed:
                    self._probed.add(container.name)
                    self._event(
                        container.name,
                        "Started",
                        f"startupProbe passed after {outcome.seconds:.1f} s",
                    )
                    continue
                if self._stopping:
                    return ""
                return f"startupProbe of {container.name} failed: {outcome.detail}"
            while container.wait(0.05) is None:
                if self._killed:
                    break
                if self._terminate_at is not None:
                    self._stop_group([container])
                    break
            code = container.wait()
            if code != 0:
                return f"init container {container.name} exited with {code}"
        return ""

    def _main(self) -> list[Container]:
        names = [str(spec["name"]) for spec in self.spec.get("containers") or []]
        return [self._containers[n] for n in names if n in self._containers]

    def _sidecars(self) -> list[Container]:
        names = [
            str(s["name"]) for s in self.spec.get("initContainers") or [] if _is_native_sidecar(s)
        ]
        return [self._containers[n] for n in names if n in self._containers]

    def _wait_main(self) -> None:
        while any(c.running for c in self._main()) and not self._stopping:
            self._wake.wait(0.05)
        if self._terminate_at is not None:
            self._stop_group(self._main())

    def _deadline(self) -> float:
        assert self._terminate_at is not None
        return self._terminate_at + self.grace_seconds

    def _stop_group(self, containers: list[Container]) -> None:
        """preStop hooks then SIGTERM, in parallel; wait for exit until the grace deadline,
        or the kubelet's minimum grace after the SIGTERM where that is later: a sidecar
        stopped after the trainers used the whole period still gets its SIGTERM and 2 s."""
        running = [c for c in containers if c.running]
        threads = [threading.Thread(target=self._stop_one, args=(c,)) for c in running]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        until = max(self._deadline(), time.monotonic() + MINIMUM_GRACE_SECONDS)
        for container in running:
            while container.running and time.monotonic() < until and not self._killed:
                container.wait(0.05)

    def _stop_one(self, container: Container) -> None:
        hook = ((self._specs[container.name].get("lifecycle") or {}).get("preStop") or {}).get(
            "exec"
        )
        if hook:
            remaining = self._deadline() - time.monotonic()
            result = container.exec(hook["command"], remaining)
            outcome = "ran" if result.exit_code == 0 else f"exited {result.exit_code}"
            self._event(
                container.name, "PreStopHook", f"{outcome}: {' '.join(hook['command'])}"[:200]
            )
        container.signal(SIGTERM)
        self._event(container.name, "Killing", "SIGTERM to PID 1")

    def _shutdown(self) -> None:
        """Stop what still runs: sidecars in reverse order, then SIGKILL at the deadline."""
        if self._terminate_at is None:
            self._terminate_at = time.monotonic()  # pod done: the sidecars get a full grace period
        for sidecar in reversed(self._sidecars()):
            if not self._killed:
                self._stop_group([sidecar])
        for container in self._containers.values():
            if container.running:
                self._event(container.name, "Killing", "grace period over: SIGKILL")
                container.signal(SIGKILL)
            container.wait()

    def _summarize(self, reason: str) -> PodResult:
        main = {c.name: c.status for c in self._main()}
        init = {n: c.status for n, c in self._containers.items() if n not in main}
        succeeded = not reason and bool(main) and all(s.exit_code == 0 for s in main.values())
        if not reason and not succeeded:
            failed = [f"{n} exited {s.exit_code}" for n, s in main.items() if s.exit_code != 0]
            reason = ", ".join(failed) or "no main container ran"
        return PodResult(
            name=self.name,
            namespace=self.namespace,
            ip=self.ip,
            phase="Succeeded" if succeeded else "Failed",
            reason=reason,
            terminated=self._requested,
            init_containers=init,
            containers=main,
            started_at=self._started_at,
            finished_at=time.time(),
        )
