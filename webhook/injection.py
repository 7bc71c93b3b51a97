"""Build the injected pod from a trainer pod and validated settings (DESIGN section 3).

Pure: it takes a pod and returns a new one plus the status record and the
warnings; deciding *whether* to inject is ``webhook/mutate.py``'s job. Every
name and path comes from ``shim/layout.py`` so the sidecar and the shim read
back exactly what is written here.

The new pod copies only the objects the injection changes and shares all
others with the input: an admission must be cheap, and the diff skips what
the two share. So neither pod may be changed in place afterwards.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jitckpt import destination as grammar
from shim import layout
from webhook import identity, images, settings
from webhook import patch as patches
from webhook.config import VERSION, WebhookConfig
from webhook.jobs import TrainerPod
from webhook.settings import REASON_KEY, STATUS_KEY
from webhook.status import (
    AGENT,
    RESTORE,
    VOL_LOCAL,
    VOL_PVC,
    VOL_RUN,
    VOL_SECRET,
    VOL_SHIM,
    InjectionStatus,
    strip,
)

STATUS_PORT_NAME = "jitckpt-status"
# WebhookConfig fields recorded in the status "config" next to the settings, so
# an audit can rebuild exactly what was injected.
CONFIG_FIELDS = {
    "sidecar-image": "sidecar_image",
    "sidecar-image-pull-policy": "sidecar_image_pull_policy",
    "sidecar-user-id": "sidecar_user_id",
}
PYTHONPATH = "PYTHONPATH"
# The Secret's files are root-owned, their group the pod's fsGroup if it has one: only
# a mode readable by others lets the sidecar's user read them whatever the fsGroup. The
# volume is mounted into the sidecar alone, so no other container sees the files.
SECRET_FILE_MODE = 0o444
# The startupProbe gates the trainer until the sidecar lets it start; a large
# checkpoint may take hours to download, so allow 12 hours. The kubelet only polls:
# an httpGet probe passes at the first period (1 s at least) after the sidecar is
# ready, and its first one, at the container's start, always fails (the sidecar's
# Python is not listening yet), so every pod's trainer started a second late. The
# probe is an exec instead, whose command waits: it asks the sidecar's /readyz every
# PROBE_POLL seconds for up to PROBE_WAIT (the Python of the sidecar's image, no site
# packages), passing as soon as the sidecar is ready.
PROBE_WAIT = 9
PROBE_POLL = 0.05
PROBE_TIMEOUT = PROBE_WAIT + 1
PROBE_PERIOD = 1
PROBE_FAILURES = 12 * 3600 // (PROBE_TIMEOUT + PROBE_PERIOD)
WAIT_READY = (
    "import http.client, os, sys, time\n"
    f"end = time.monotonic() + {PROBE_WAIT}\n"
    "while True:\n"
    f"    c = http.client.HTTPConnection(os.environ['{layout.ENV_POD_IP}'], "
    f"{layout.STATUS_PORT}, timeout=1)\n"
    "    try:\n"
    "        c.request('GET', '/readyz')\n"
    "        if c.getresponse().status == 200:\n"
    "            sys.exit(0)\n"
    "    except OSError:\n"
    "        pass\n"
    "    finally:\n"
    "        c.close()\n"
    "    if time.monotonic() > end:\n"
    "        sys.exit(1)\n"
    f"    time.sleep({PROBE_POLL})\n"
)
# /bin/sh only (no cat, no pkill): the trainer image may be minimal.
PRESTOP_SCRIPT = (
    f"for f in {layout.RUN_DIR}/{layout.PIDS_SUBDIR}/*.pid; do "
    '[ -r "$f" ] || continue; read -r pid < "$f" && kill -TERM "$pid" 2>/dev/null; '
    "done; exit 0"
)


@dataclass(frozen=True)
class Injected:
    """The injected pod, its status record and what the user should know."""

    pod: dict[str, Any]
    patch: patches.Patch  # RFC 6902, from the input pod to ``pod``
    status: InjectionStatus
    warnings: list[str]


def job_root(destination: str, namespace: str, job: str) -> str:
    """``<destination>/<namespace>/<job>``: one namespace-wide destination serves every job."""
    return grammar.parse(destination).join(namespace, job).uri


NO_CREDENTIALS = "no-credentials"


def no_credentials(root: str, values: Mapping[str, str]) -> str:
    """The reason annotation of a pod whose sidecar has no way to reach the store ``root``:
    what the sidecar will then do, and how to fix it."""
    then = (
        "the sidecar holds the trainer (store-unreachable: fail-closed)"
        if values.get("store-unreachable") == settings.FAIL_CLOSED
        else "the trainer runs unprotected"
    )
    return (
        f"{NO_CREDENTIALS}: {root} is reached with neither a {settings.PREFIX}s3-secret nor "
        "a workload identity (IRSA, EKS Pod Identity) on the trainer container: the "
        f"sidecar cannot reach the store and {then}. Set {settings.PREFIX}s3-secret on the "
        "namespace or the pod, or give its service account an identity"
    )


def _list(holder: dict[str, Any], key: str) -> list[Any]:
    """A copy of ``holder[key]`` put in its place, to extend; an absent or null list becomes []."""
    value = holder.get(key)
    copied = list(value) if isinstance(value, list) else []
    holder[key] = copied
    return copied


def _env(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}


def _volumes(
    values: Mapping[str, str], pvc_claim: str | None, secret: str | None
) -> list[dict[str, Any]]:
    local: dict[str, Any] = {}
    if "local-size-limit" in values:
        local["sizeLimit"] = values["local-size-limit"]
    volumes = [
        {"name": VOL_LOCAL, "emptyDir": local},
        {"name": VOL_RUN, "emptyDir": {"medium": "Memory"}},
        {"name": VOL_SHIM, "emptyDir": {}},
    ]
    if pvc_claim is not None:
        volumes.append({"name": VOL_PVC, "persistentVolumeClaim": {"claimName": pvc_claim}})
    if secret is not None:
        source = {"secretName": secret, "defaultMode": SECRET_FILE_MODE}
        volumes.append({"name": VOL_SECRET, "secret": source})
    return volumes


def _shared_mounts(shim_read_only: bool) -> list[dict[str, Any]]:
    shim: dict[str, Any] = {"name": VOL_SHIM, "mountPath": layout.SHIM_ROOT}
    if shim_read_only:
        shim["readOnly"] = True
    return [
        {"name": VOL_LOCAL, "mountPath": layout.LOCAL_DIR},
        {"name": VOL_RUN, "mountPath": layout.RUN_DIR},
        shim,
    ]


def _security_context(user_id: int) -> dict[str, Any]:
    """Pod Security "restricted", plus a read-only root file system."""
    return {
        "runAsNonRoot": True,
        "runAsUser": user_id,
        "runAsGroup": user_id,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


@dataclass(frozen=True)
class _Plan:
    """What every sidecar container of one injection shares."""

    values: Mapping[str, str]
    config: WebhookConfig
    trainer: TrainerPod
    root: str
    grace: int
    secret: str | None
    pvc: bool
    pull_policy: str
    identity: identity.WorkloadIdentity | None

    def env(self) -> list[dict[str, Any]]:
        values, trainer = self.values, self.trainer
        env = [
            _env(layout.ENV_MODE, values["sidecar-mode"]),
            _env(layout.ENV_DESTINATION, self.root),
            _env(layout.ENV_JOB_NAME, trainer.job_name),
        ]
        env += [
            {"name": layout.ENV_NODE_RANK, **copy.deepcopy(trainer.node_rank)},
            {"name": layout.ENV_NNODES, **copy.deepcopy(trainer.nnodes)},
        ]
        if trainer.nproc_per_node is not None:
            env.append({"name": layout.ENV_NPROC_PER_NODE, **copy.deepcopy(trainer.nproc_per_node)})
        env += [
            _field_env(layout.ENV_POD_NAME, "metadata.name"),
            _field_env(layout.ENV_POD_NAMESPACE, "metadata.namespace"),
            _field_env(layout.ENV_POD_IP, "status.podIP"),
            _env(layout.ENV_STATUS_PORT, str(layout.STATUS_PORT)),
            _env(layout.ENV_DIR, layout.LOCAL_DIR),
            _env(layout.ENV_SOCKET, layout.SOCKET_PATH),
            _env(layout.ENV_GRACE_SECONDS, str(self.grace)),
            _env(layout.ENV_RETENTION, values["s3-retention"]),
            _env(layout.ENV_VERIFY_SSL, values["verify-ssl"]),
            _env(layout.ENV_VERIFY_ACCESS, values["verify-access"]),
            _env(layout.ENV_RESUME, values["resume"]),
        ]
        # Only a platform's explicit choice: the sidecar's default is to run unprotected,
        # and pods injected before this setting existed keep the spec they were given.
        unreachable = values.get("store-unreachable", settings.RUN_UNPROTECTED)
        if unreachable != settings.RUN_UNPROTECTED:
            env.append(_env(layout.ENV_STORE_UNREACHABLE, unreachable))
        piece = values.get("piece-min-size")
        if piece is not None:
            env.append(_env(layout.ENV_PIECE_MIN_SIZE, str(settings.piece_bytes(piece))))
        if self.pvc:
            env.append(_env(layout.ENV_PVC_MOUNT, layout.PVC_MOUNT))
        if self.secret is not None:
            env.append(_env(layout.ENV_S3_SECRET_DIR, layout.S3_SECRET_DIR))
        elif self.identity is not None:
            env += copy.deepcopy(self.identity.env)
        return env

    def container(self, name: str, command: list[str]) -> dict[str, Any]:
        """One sidecar container; the Secret and the claim reach no other container."""
        mounts = _shared_mounts(shim_read_only=False)
        if self.pvc:
            mounts.append({"name": VOL_PVC, "mountPath": layout.PVC_MOUNT})
        if self.secret is not None:
            mounts.append({"name": VOL_SECRET, "mountPath": layout.S3_SECRET_DIR, "readOnly": True})
        elif self.identity is not None:
            mounts += copy.deepcopy(self.identity.mounts)
        quantities = {"cpu": self.values["sidecar-cpu"], "memory": self.values["sidecar-memory"]}
        container: dict[str, Any] = {
            "name": name,
            "image": self.config.sidecar_image,
            "imagePullPolicy": self.pull_policy,
            "command": command,
            "env": self.env(),
        }
        container.update(
            {
                # requests == limits keeps a Guaranteed trainer pod Guaranteed
                "resources": {"requests": dict(quantities), "limits": dict(quantities)},
                "securityContext": _security_context(self.config.sidecar_user_id),
                "terminationMessagePath": "/dev/termination-log",
                "terminationMessagePolicy": "File",
                "volumeMounts": mounts,
            }
        )
        return container


def _status_port() -> list[dict[str, Any]]:
    return [{"name": STATUS_PORT_NAME, "containerPort": layout.STATUS_PORT, "protocol": "TCP"}]


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": layout.STATUS_PORT, "scheme": "HTTP"},
        "periodSeconds": period,
        "timeoutSeconds": 1,
        "successThreshold": 1,
        "failureThreshold": failures,
    }


def _startup_probe() -> dict[str, Any]:
    return {
        "exec": {"command": ["python", "-I", "-S", "-c", WAIT_READY]},
        "periodSeconds": PROBE_PERIOD,
        "timeoutSeconds": PROBE_TIMEOUT,
        "successThreshold": 1,
        "failureThreshold": PROBE_FAILURES,
    }


def _legacy_probes() -> dict[str, Any]:
    """The legacy run container is a regular container, which a pod that probes its own
    containers (as scanners ask) should not be the exception to. Liveness is lenient: a
    restart would cut an upload short."""
    return {"livenessProbe": _probe("/healthz", 10, 6), "readinessProbe": _probe("/readyz", 5, 3)}


def _trainer_env(
    container: dict[str, Any], values: Mapping[str, str], grace: int, warnings: list[str]
) -> tuple[list[str], list[str]]:
    """Add the trainer's env in place; returns (names added, names edited in place)."""
    name = container["name"]
    env = _list(container, "env")
    at = {e.get("name"): i for i, e in enumerate(env) if isinstance(e, dict)}
    existing = {env_name: env[i] for env_name, i in at.items()}
    added: list[str] = []
    prepended: list[str] = []
    python_path = existing.get(PYTHONPATH)
    if python_path is None:
        env.append(_env(PYTHONPATH, layout.SHIM_DIR))
        added.append(PYTHONPATH)
    elif "valueFrom" in python_path:
        warnings.append(
            f"container {name!r} takes PYTHONPATH from valueFrom, which cannot be extended: "
            "the checkpoint shim will not load in it"
        )
    else:
        current = str(python_path.get("value", ""))
        if layout.SHIM_DIR not in current.split(":"):
            value = f"{layout.SHIM_DIR}:{current}" if current else layout.SHIM_DIR
            env[at[PYTHONPATH]] = {**python_path, "value": value}
            prepended.append(PYTHONPATH)
    wanted = [
        (layout.ENV_DIR, layout.LOCAL_DIR),
        (layout.ENV_SOCKET, layout.SOCKET_PATH),
        (layout.ENV_GRACE_SECONDS, str(grace)),
        (layout.ENV_JIT, values["jit"]),
        (layout.ENV_UPLOAD_FINAL, values["upload-final"]),
        (layout.ENV_TORCH_SHUTDOWN, str(layout.shutdown_timeout(grace))),
    ]
    for setting, env_name in (
        ("save-strategy", layout.ENV_SAVE_STRATEGY),
        ("save-steps", layout.ENV_SAVE_STEPS),
        ("save-total-limit", layout.ENV_SAVE_TOTAL_LIMIT),
    ):
        if setting in values:
            wanted.append((env_name, values[setting]))
    for env_name, value in wanted:
        if env_name in existing:
            warnings.append(f"kept container {name!r}'s own {env_name}")
            continue
        env.append(_env(env_name, value))
        added.append(env_name)
    return added, prepended


def _prestop(container: dict[str, Any], warnings: list[str]) -> bool:
    """Add the hook that SIGTERMs the registered processes; False when one exists."""
    lifecycle = container.get("lifecycle") or {}
    container["lifecycle"] = lifecycle
    if "preStop" in lifecycle:
        warnings.append(
            f"kept container {container['name']!r}'s own preStop hook: training processes "
            "behind a shell PID 1 get SIGTERM only if that hook or the shell forwards it"
        )
        return False
    container["lifecycle"] = {
        **lifecycle,
        "preStop": {"exec": {"command": ["/bin/sh", "-c", PRESTOP_SCRIPT]}},
    }
    return True


def build(
    pod: dict[str, Any],
    trainer: TrainerPod,
    *,
    values: Mapping[str, str],
    sources: Mapping[str, str],
    namespace: str,
    config: WebhookConfig,
) -> Injected:
    """The injected pod for validated ``values`` (destination set); ``pod`` is not touched."""
    spec = {**pod["spec"]}
    out = {**pod, "metadata": {**pod["metadata"]}, "spec": spec}
    warnings: list[str] = []
    mode = values["sidecar-mode"]
    destination = grammar.parse(values["destination"])
    pvc_claim = destination.name if destination.scheme == grammar.PVC else None
    secret = values.get("s3-secret")
    if secret is not None and pvc_claim is not None:
        warnings.append(f"s3-secret {secret!r} is not given to the sidecar of a pvc:// destination")
        secret = None
        values = {k: v for k, v in values.items() if k != "s3-secret"}
    root = job_root(values["destination"], namespace, trainer.job_name)

    before = spec.get("terminationGracePeriodSeconds")
    wanted_grace = int(values["grace-period-seconds"])
    grace = max(wanted_grace, before) if isinstance(before, int) else wanted_grace
    status = InjectionStatus(
        version=VERSION,
        mode=mode,
        jobKind=trainer.kind,
        jobName=trainer.job_name,
        destination=root,
        config={**values, **{k: str(getattr(config, a)) for k, a in CONFIG_FIELDS.items()}},
        configSources={k: v for k, v in sources.items() if k in values},
    )
    if grace != before:
        spec["terminationGracePeriodSeconds"] = grace
        status.gracePeriod = {"from": before if isinstance(before, int) else None, "to": grace}

    volumes = _volumes(values, pvc_claim, secret)
    _list(spec, "volumes").extend(volumes)
    status.volumes = [v["name"] for v in volumes]

    containers = spec["containers"] = list(spec["containers"])
    trainer_container = containers[trainer.container_index] = {
        **containers[trainer.container_index]
    }
    _list(trainer_container, "volumeMounts").extend(_shared_mounts(shim_read_only=True))
    added, prepended = _trainer_env(trainer_container, values, grace, warnings)
    status.env = {trainer_container["name"]: added}
    if prepended:
        status.prependedEnv = {trainer_container["name"]: prepended}
    if _prestop(trainer_container, warnings):
        status.preStop = [trainer_container["name"]]

    # The pod's own workload identity, when the store's credentials are not a Secret.
    found = None
    unreachable = None
    if secret is None and pvc_claim is None:
        found = identity.find(pod["spec"]["containers"][trainer.container_index])
        warnings += found.warnings if found is not None else []
        if found is None and not config.identity_webhook:
            unreachable = no_credentials(root, values)
    every = [*(spec.get("initContainers") or []), *containers]
    pull = images.strictest(config.sidecar_image_pull_policy, every)
    plan = _Plan(values, config, trainer, root, grace, secret, pvc_claim is not None, pull, found)
    init = _list(spec, "initContainers")
    if mode == "native":
        agent = plan.container(AGENT, ["jitckpt", "agent"])
        agent["restartPolicy"] = "Always"
        agent["ports"] = _status_port()
        agent["startupProbe"] = _startup_probe()
        # First: it restores while, e.g., a worker's init container waits for the master.
        init.insert(0, agent)
        status.initContainers = [AGENT]
    else:
        restore = plan.container(RESTORE, ["jitckpt", "agent", "--phase", "restore"])
        run = plan.container(AGENT, ["jitckpt", "agent", "--phase", "run"])
        run["ports"] = _status_port()
        run.update(_legacy_probes())
        init.insert(0, restore)
        containers.append(run)
        status.initContainers = [RESTORE]
        status.containers = [AGENT]

    # One diff of the spec serves both the patch and (usually) the digest.
    spec_ops = patches.diff({"spec": pod["spec"]}, {"spec": out["spec"]})
    # The digest is taken against the pod as ``strip`` rebuilds it, so an audit
    # that re-derives the injection from a stripped pod computes the same one.
    canonical = strip(out, status)
    if canonical["spec"] == pod["spec"]:
        status.patchSha256 = patches.digest(spec_ops)
    else:  # e.g. a null list in the input, which strip leaves out
        status.patchSha256 = patches.spec_digest(canonical, out)
    marks = {STATUS_KEY: status.to_json()}
    if unreachable is not None:
        marks[REASON_KEY] = unreachable
        warnings.append(unreachable)
    out, annotation_ops = patches.annotate(out, marks)
    return Injected(out, [*annotation_ops, *spec_ops], status, warnings)
